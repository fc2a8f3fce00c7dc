"""docs/json.md documents every command's --json output; the cheap shapes are checked here,
in-process (the ones that need CRIU: tests/integration/test_json_shapes.py)."""

import json

import pytest
import typer

from ckpt.cli.main import app, main
from tests import jsonshape
from tests.helpers import env_settings


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def commands_with_json() -> set[str]:
    """Every command path of the CLI that takes --json ("dump", "schedule rm"...)."""
    found = set()

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        if any(p.name == "json_out" for p in command.params):
            found.add(" ".join(path))

    walk(typer.main.get_command(app), [])
    return found


def test_every_command_has_json_and_a_documented_shape():
    schemas = jsonshape.load()
    documented = {name.split(":")[0] for name in schemas if name.split(":")[0] in commands_with_json()}
    # (hidden: `ckpt _member`, whose stdout is the group protocol's, JSON already)
    every_command = {c.name for c in app.registered_commands if not c.hidden} - {None}
    for group in ("schedule", "key", "journal", "cache"):
        every_command |= {f"{group} {c.name}" for c in typer.main.get_command(app).commands[group].commands.values()}
    assert commands_with_json() == every_command, "every command takes --json"
    assert documented == every_command, "docs/json.md has a schema for every command"
    assert {"run: started", "run: checkpoint", "run: died", "run: restore_delayed", "run: restored",
            "run: exit"} <= set(schemas)


def test_the_checker_finds_what_differs_from_the_doc():
    """So that a passing shape test means something."""
    good = {"ready": True, "checks": [{"name": "criu", "ok": True, "detail": "d", "fix": "", "required": True}]}
    assert jsonshape.check(good, "check") == []
    assert jsonshape.check({**good, "extra": 1}, "check") == ["check: (top): field 'extra' is not documented"]
    assert jsonshape.check({"checks": []}, "check") == ["check: ready is missing"]
    assert jsonshape.check({**good, "ready": "yes"}, "check") == ["check: ready is 'yes', not boolean"]
    bad_element = {**good, "checks": [{**good["checks"][0], "ok": 1}]}
    assert jsonshape.check(bad_element, "check") == ["check: checks[].ok is 1, not boolean"]
    # shared shapes, alternatives and optional fields
    outcome = {"time": "t", "outcome": "failed", "error": "e"}
    assert jsonshape.check({"name": "a", "cron": "* * * * *", "every": None, "target": {"pid": 1},
                            "retention": None, "pre_dump": None}, "schedule rm") == []
    assert jsonshape.check([{"name": "a", "target": {"pid": "1"}, "cron": "c", "every": None, "next_run": "n",
                             "last": outcome, "retention": None, "pre_dump": None, "copy_to": None,
                             "installed": None, "scheduler": "cron", "will_run": True, "problem": None}],
                           "schedule list") == ["schedule list: [].target: target: pid is '1', not integer"]
    assert jsonshape.check({"name": "a", "cron": "c", "target": {"match": "x"}, "retention": {"keep_last": 1},
                            "installed": "i", "log": "l"}, "schedule add") != []


def test_check(capsys):
    code, out, err = run(capsys, "check", "--json")
    assert code in (0, 5), err  # 5: not ready, with its JSON all the same
    jsonshape.assert_shape(json.loads(out), "check")


def test_list_and_schedule_list_of_an_empty_store(capsys, isolated_env):
    from ckpt.store import Store

    Store.open(isolated_env, create=True, settings=env_settings())  # only dump and schedule add create a store
    for command, schema in ((["list"], "list"), (["schedule", "list"], "schedule list")):
        code, out, err = run(capsys, *command, "--json")
        assert code == 0, err
        assert json.loads(out) == []
        jsonshape.assert_shape(json.loads(out), schema)


def test_a_failing_command_prints_no_json(capsys, isolated_env):
    from ckpt.store import Store

    Store.open(isolated_env, create=True, settings=env_settings())
    for argv in (["show", "latest"], ["rm", "nosuch"], ["schedule", "rm", "nosuch"], ["schedule", "run", "nosuch"]):
        code, out, err = run(capsys, *argv, "--json")
        assert code != 0 and out == "" and err.startswith("Error: "), argv


def test_init_of_a_local_store_plain_and_encrypted(capsys, tmp_path, monkeypatch):
    code, out, err = run(capsys, "init", str(tmp_path / "plain"), "--json")
    assert code == 0, err
    created = json.loads(out)
    jsonshape.assert_shape(created, "init")
    assert created["encrypted"] is False and (tmp_path / "plain" / "store.json").exists()
    monkeypatch.setenv("CKPT_PASSWORD", "pw")
    code, out, err = run(capsys, "init", str(tmp_path / "sealed"), "--encrypt", "--json")
    assert code == 0, err
    created = json.loads(out)
    jsonshape.assert_shape(created, "init")
    assert created["encrypted"] is True and created["key"]
    assert b"format" not in (tmp_path / "sealed" / "store.json").read_bytes()  # encrypted on disk
    code, out, err = run(capsys, "init", str(tmp_path / "sealed"), "--json")
    assert code == 2 and out == "" and "already" in err


def test_list_and_show_of_a_group_through_the_cli(isolated_env, tmp_path):
    """`ckpt list --json` and `ckpt show GROUP --json` as a user runs them, against docs/json.md;
    and the table: the group one row, its members indented beneath it."""
    from ckpt.store import Store
    from tests.commands.conftest import Checkpoints, Groups
    from tests.helpers import ckpt, ckpt_json

    store = Store.open(isolated_env, create=True, settings=env_settings())
    made = Checkpoints(store, tmp_path)
    plain = made.make("web")
    group = Groups(store, made).make("agent", members=2)
    unfinished = Groups(store, made).make("agent", commit=False)
    listed = ckpt_json("list")
    jsonshape.assert_shape(listed, "list")
    assert [(r["id"], (r["group"] or {}).get("id")) for r in listed] == [
        (plain.id, None), (group.checkpoint_ids[0], group.id), (group.checkpoint_ids[1], group.id)]
    shown = ckpt_json("show", "agent")
    jsonshape.assert_shape(shown, "show: group")
    assert shown["id"] == group.id and [m["checkpoint"] for m in shown["members"]] == group.checkpoint_ids
    member = ckpt_json("show", group.checkpoint_ids[0])  # (its whole shape needs CRIU's images: integration)
    assert member["group"] == {"id": group.id, "name": "agent"}
    table = ckpt("list").stdout.splitlines()
    assert [line.split()[0] for line in table[1:]] == [plain.id, group.id, *group.checkpoint_ids]
    assert table[2].split()[4] == "-" and "group: 2 members on host-a, host-b, freeze skew 2.0 ms" in table[2]
    assert all(line.startswith("  " + i) for line, i in zip(table[3:], group.checkpoint_ids, strict=True))
    assert not any(i in line for line in table for i in unfinished.checkpoint_ids)
    text = ckpt("show", group.id).stdout
    assert f"group checkpoint agent ({group.id})" in text and "freeze skew 2.0 ms" in text
    assert all(i in text for i in group.checkpoint_ids)
