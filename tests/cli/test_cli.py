"""The command line in-process: help, usage errors, JSON shapes. No CRIU needed."""

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from ckpt.cli.main import app, main
from tests.helpers import env_settings, ROOT, manifest_only_checkpoint

COMMANDS = ["init", "check", "dump", "restore", "list", "show", "diff", "rm", "verify", "forget", "prune", "copy",
            "run", "migrate", "_member", "clone", "copy-info"]
SCHEDULE_COMMANDS = ["add", "list", "rm", "run"]
KEY_COMMANDS = ["list", "add", "remove", "passwd"]
JOURNAL_COMMANDS = ["list", "show", "rm"]
CACHE_COMMANDS = ["warm"]


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_every_command_is_registered_and_has_help_with_examples(capsys):
    registered = sorted(c.name for c in app.registered_commands)
    assert registered == sorted(COMMANDS)
    for command in COMMANDS:
        code, out, err = run(capsys, command, "--help")
        assert code == 0, err
        assert "Examples:" in out and f"ckpt {command}" in out, command
    for group, commands in (("schedule", SCHEDULE_COMMANDS), ("key", KEY_COMMANDS), ("journal", JOURNAL_COMMANDS),
                            ("cache", CACHE_COMMANDS)):
        for command in commands:
            code, out, err = run(capsys, group, command, "--help")
            assert code == 0, err
            assert "Examples:" in out and f"ckpt {group} {command}" in out, command


def test_list_on_empty_store_is_an_empty_json_array(capsys, isolated_env):
    from ckpt.store import Store

    Store.open(isolated_env, create=True, settings=env_settings())
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0 and json.loads(out) == []


def test_usage_errors_are_one_line_with_exit_2(capsys):
    code, out, err = run(capsys, "verify")
    assert code == 2 and err.startswith("Error: give either a checkpoint ID or --all")
    code, out, err = run(capsys, "dump", "notapid")
    assert code == 2 and "Traceback" not in err
    code, out, err = run(capsys, "frobnicate")
    assert code == 2 and "No such command" in err


def test_restore_from_a_missing_store_says_so(capsys, tmp_path):
    code, out, err = run(capsys, "show", "latest", "--store", str(tmp_path / "none"))
    assert code == 3 and "no ckpt store" in err and out == ""


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("ckpt ")


def test_list_and_help_do_not_import_pycriu():
    """`import pycriu` costs ~0.1 s; commands that do not need CRIU must not pay it."""
    code = ("import sys; from ckpt.cli.main import main\n"
            "try:\n    main(['list', '--json'])\nexcept SystemExit:\n    pass\n"
            "assert 'pycriu' not in sys.modules, 'pycriu imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_passwords_of_an_encrypted_store_are_added_changed_and_removed(capsys, tmp_path, monkeypatch):
    store = tmp_path / "sealed"
    files = {}
    for word in ("pw1", "pw2", "pw3"):
        files[word] = tmp_path / word
        files[word].write_text(word + "\n")
        files[word].chmod(0o600)
    monkeypatch.setenv("CKPT_PASSWORD", "pw1")
    assert run(capsys, "init", str(store), "--encrypt")[0] == 0
    monkeypatch.setenv("CKPT_STORE", str(store))
    code, out, err = run(capsys, "key", "add", "--new-password-file", str(files["pw2"]), "--json")
    assert code == 0, err
    second = json.loads(out)["added"]
    code, out, err = run(capsys, "key", "list", "--json")
    listed = json.loads(out)
    assert len(listed) == 2 and [k["id"] for k in listed if k["current"]] != [second]
    first = [k["id"] for k in listed if k["current"]][0]
    monkeypatch.setenv("CKPT_PASSWORD", "pw2")
    assert run(capsys, "list")[0] == 0
    code, out, err = run(capsys, "key", "passwd", "--new-password-file", str(files["pw3"]), "--json")
    assert code == 0, err
    code, out, err = run(capsys, "list")
    assert code == 4 and "password" in err  # pw2's key was replaced by pw3's
    monkeypatch.setenv("CKPT_PASSWORD", "pw3")
    code, out, err = run(capsys, "key", "remove", first, "--json")
    assert code == 0 and json.loads(out) == {"removed": first}, err
    monkeypatch.setenv("CKPT_PASSWORD", "pw1")
    assert run(capsys, "list")[0] == 4
    monkeypatch.setenv("CKPT_PASSWORD", "pw3")
    code, out, err = run(capsys, "key", "list", "--json")
    only = json.loads(out)
    assert len(only) == 1 and only[0]["current"]
    code, out, err = run(capsys, "key", "remove", only[0]["id"])
    assert code != 0 and "Traceback" not in err  # never the last key, never the one in use
    code, out, err = run(capsys, "key", "list", "--store", str(tmp_path / "plain-none"))
    assert code == 3


def test_global_options_work_after_the_subcommand_too(capsys, tmp_path, monkeypatch):
    """The password error tells users to pass --password-file: it must work where they type it."""
    store = tmp_path / "sealed"
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    pw.chmod(0o600)
    monkeypatch.setenv("CKPT_PASSWORD", "secret")
    assert run(capsys, "init", str(store), "--encrypt")[0] == 0
    monkeypatch.delenv("CKPT_PASSWORD")
    monkeypatch.setenv("CKPT_STORE", str(store))
    code, out, err = run(capsys, "list", "--json")
    assert code == 4 and "--password-file" in err
    for argv in (["--password-file", str(pw), "list", "--json"], ["list", "--json", "--password-file", str(pw)],
                 ["list", f"--password-file={pw}", "--json"]):
        code, out, err = run(capsys, *argv)
        assert code == 0 and json.loads(out) == [], (argv, err)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("ckpt.cli.cmd_list.list_checkpoints", broken)
    monkeypatch.setenv("CKPT_PASSWORD", "secret")
    for argv in (["--debug", "list"], ["list", "--debug"]):
        code, out, err = run(capsys, *argv)
        assert code == 70 and "Traceback" in err and "RuntimeError: boom" in err, argv
    code, out, err = run(capsys, "list")
    assert code == 70 and "Traceback" not in err


def test_shell_completion_is_on(capsys, monkeypatch):
    import typer.completion

    # typer asks shellingham which shell runs it: under make (sh) or an orphaned test run (none)
    # that is no shell it completes for. The user's bash is what matters here.
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    code, out, err = run(capsys, "--show-completion")
    assert code == 0, err
    assert "_CKPT_COMPLETE" in out and "complete " in out, out


def help_texts():
    """(command path, its HELP string) for every command and group."""
    from ckpt.cli.main import command

    def walk(cmd, path):
        yield " ".join(path), cmd.help or ""
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(command(), []))


def example_lines(text):
    lines = text.split("Examples:", 1)[1].splitlines() if "Examples:" in text else []
    return [line.strip() for line in lines if line.strip().startswith("ckpt")]


@pytest.mark.parametrize("columns", ["60", "80"])
def test_examples_in_help_are_never_broken(capsys, monkeypatch, columns):
    """A flag split over two lines ('--keep-' / 'daily 7') cannot be copied."""
    monkeypatch.setenv("COLUMNS", columns)
    texts = help_texts()
    assert sum(len(example_lines(text)) for _, text in texts) > 40
    for path, text in texts:
        code, out, err = run(capsys, *path.split(), "--help")
        assert code == 0, err
        shown = {line.strip() for line in out.splitlines()}
        for example in example_lines(text):
            assert example in shown, f"'ckpt {path} --help' at {columns} columns breaks: {example}\n{out}"


def test_list_of_a_name_the_store_lacks_says_what_it_holds(capsys, isolated_env):
    from ckpt.store import Store

    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    now = datetime.now(timezone.utc)
    for n, name in enumerate(["agent"] * 3 + ["web", None]):
        manifest_only_checkpoint(store, name, now - timedelta(minutes=n))
    code, out, err = run(capsys, "list", "--name", "nothere")
    assert code == 0 and out == ""
    assert err.strip() == "no checkpoint named 'nothere' (the store holds 5; names: agent, web)", err
    code, out, err = run(capsys, "list", "--name", "agnet")
    assert "did you mean 'agent'?" in err, err
    assert json.loads(run(capsys, "list", "--name", "nothere", "--json")[1]) == []


def test_a_mistyped_checkpoint_gets_a_did_you_mean(capsys, isolated_env):
    from ckpt.store import Store

    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    now = datetime.now(timezone.utc)
    manifest_only_checkpoint(store, "nightly-report", now - timedelta(minutes=2))
    newest = manifest_only_checkpoint(store, "agent", now)
    code, out, err = run(capsys, "show", "nightly-reprot")
    assert code == 3 and err.startswith("Error: no checkpoint with ID or name 'nightly-reprot'"), err
    assert "did you mean 'nightly-report'?" in err and err.count("\n") == 1, err
    typo = newest[:-1] + ("0" if newest[-1] != "0" else "1")
    code, out, err = run(capsys, "show", typo)
    assert code == 3 and f"did you mean '{newest}'?" in err, err
    code, out, err = run(capsys, "show", "zzzzzz")
    assert code == 3 and "did you mean" not in err and "see 'ckpt list'" in err, err


@pytest.mark.parametrize("output", [
    "Looks good.\n(00.012) Error (criu/sk-inet.c:818): Can't check shutdown state of inet socket",
    "Warn  (criu/cr-check.c:1300): time namespaces are not supported\nLooks good but some kernel features are "
    "missing\nwhich, depending on your process tree, may cause\ndump or restore failure.",
])
def test_a_criu_check_that_passes_with_a_warning_shows_as_a_warning(capsys, monkeypatch, output):
    """It was shown as 'ok   criu check: <the warning>'."""
    monkeypatch.setattr("ckpt.commands.check.run_check", lambda binary, feature=None: (True, output))
    code, out, err = run(capsys, "check")
    line = next(line for line in out.splitlines() if "criu check" in line)
    assert line.startswith("warn criu check: passed with warnings: "), line
    assert "Looks good but" not in line and ("inet socket" in line or "time namespaces" in line), line
    code, out, err = run(capsys, "check", "--json")
    found = next(c for c in json.loads(out)["checks"] if c["name"] == "criu check")
    assert found["ok"] is False and found["required"] is False and found["fix"], found


QUIET_AND_VERBOSE = ["list", "show", "diff", "check", "run", "dump", "restore", "verify", "copy", "forget", "prune",
                     "rm"]


def test_quiet_and_verbose_are_on_every_command_that_reports(capsys, isolated_env):
    for command in QUIET_AND_VERBOSE:
        code, out, err = run(capsys, command, "--help")
        assert "-q, --quiet" in out and "-v, --verbose" in out, command
    from ckpt.store import Store

    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    checkpoint_id = manifest_only_checkpoint(store, "agent", datetime.now(timezone.utc))
    code, out, err = run(capsys, "list")
    assert code == 0 and "1 checkpoint(s)" in err and f"store {isolated_env}" not in err
    code, out, err = run(capsys, "list", "-q")
    assert code == 0 and checkpoint_id in out and err == ""
    assert run(capsys, "list", "-q", "--name", "nothere")[2] == ""
    code, out, err = run(capsys, "list", "-v")
    assert code == 0 and f"store {isolated_env}" in err and "[0." in err, err
    code, out, err = run(capsys, "show", "agent", "--verbose")
    assert code == 0 and f"agent is checkpoint {checkpoint_id}" in err, err
    code, out, err = run(capsys, "list", "-q", "-v")
    assert code == 2 and err.startswith("Error: --quiet and --verbose contradict each other") and out == ""


def test_schedule_list_shortens_an_error_the_json_keeps_whole(capsys, isolated_env, tmp_path, monkeypatch):
    import os

    from ckpt.schedule.book import ScheduleBook

    monkeypatch.setenv("CKPT_CRON_DIR", str(tmp_path / "cron.d"))
    monkeypatch.setenv("CKPT_SCHEDULER", "cron")
    code, out, err = run(capsys, "schedule", "add", "agent", "--pid", str(os.getpid()), "--every", "5m")
    assert code == 0, err
    error = "CRIU dump failed: " + "Error (criu/files-reg.c:1234): cannot dump a file " * 6
    book = ScheduleBook(isolated_env, env_settings())
    book.record("agent", {"time": "2026-12-03T10:00:00", "outcome": "failed", "error": error})
    code, out, err = run(capsys, "schedule", "list")
    assert code == 0 and error not in out and error[:39] + "…" in out, out
    assert "--json" in err, err  # where the whole error is
    code, out, err = run(capsys, "schedule", "list", "--json")
    assert json.loads(out)[0]["last"]["error"] == error


@pytest.mark.parametrize("argv,message", [
    (["clone", "agent", "--copies", "0"], "--copies must be 1 to 64, not 0"),
    (["clone", "agent", "--copies", "65"], "--copies must be 1 to 64, not 65"),
    (["clone", "agent", "--copies", "2", "--net", "bridge"], "--net must be one of auto, own, host"),
    (["restore", "agent", "--copies", "0"], "--copies must be 1 to 64, not 0"),
])
def test_clone_refuses_bad_copies_in_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_copy_info_says_nothing_outside_a_copy(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_COPIES_DIR", str(tmp_path))
    code, out, err = run(capsys, "copy-info")
    assert (code, out) == (0, "")
    code, out, _ = run(capsys, "copy-info", "--json")
    assert (code, out.strip()) == (0, "null")


def test_copy_info_prints_shell_assignments(capsys, tmp_path, monkeypatch):
    from ckpt.agent import identity
    from ckpt.cli.cmd_copy_info import assignments

    import os

    from ckpt.system import procfs

    # Its init: this test's process (alive, in the namespace the file is named by).
    record = {"format": 2, "clone": "20261130-231500-000-abcdef", "copy": 3, "copies": 4,
              "checkpoint": "20261130-230102-123-3fa9c1", "name": "agent", "created": "2026-11-30T23:15:00+00:00",
              "init": [os.getpid(), procfs.start_ticks(os.getpid())]}
    assert assignments(record) == ["CKPT_COPY=3", "CKPT_COPIES=4", "CKPT_CLONE=20261130-231500-000-abcdef",
                                   "CKPT_CHECKPOINT=20261130-230102-123-3fa9c1"]
    (tmp_path / f"pidns-{identity.pidns_inode()}.json").write_text(json.dumps(record))
    monkeypatch.setenv("CKPT_COPIES_DIR", str(tmp_path))
    code, out, _ = run(capsys, "copy-info")
    assert code == 0 and out.splitlines()[0] == "CKPT_COPY=3"
    code, out, _ = run(capsys, "copy-info", "--json")
    assert json.loads(out) == record


def test_cache_warm_of_a_local_store_says_it_has_no_cache(capsys, isolated_env):
    from ckpt.store import Store

    Store.open_local(isolated_env, create=True, settings=env_settings())
    code, out, err = run(capsys, "cache", "warm", "latest")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "is a local directory: it has no cache" in err and "--store s3://" in err
    code, out, err = run(capsys, "cache", "warm")
    assert code == 2 and "Missing argument" in err, err


def test_a_command_line_builds_only_the_command_it_names():
    from ckpt.cli.main import COMMAND_MODULES, build_app, named_command

    assert named_command(["--debug", "--password-file", "list", "dump", "42"]) == "dump"  # "list": the file
    assert named_command(["--password-file=pw", "restore", "x"]) == "restore"
    assert named_command(["--help", "dump"]) is None  # the whole help
    assert named_command(["lst"]) is None and named_command([]) is None  # a typo: the whole app suggests
    # Each name is the one its module registers, and the whole app has them all.
    for name in COMMAND_MODULES:
        built = build_app([name])
        names = {c.name for c in built.registered_commands} | {g.name for g in built.registered_groups}
        assert names == {name}, (name, names)
