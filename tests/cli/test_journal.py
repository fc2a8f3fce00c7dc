"""`ckpt journal list|show|rm` over records the agent API wrote (ckpt.journal), in-process: what
each shows, their --json against docs/json.md, and rm's all-or-nothing and safety net."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from ckpt.agent.journal import Journal
from ckpt.cli.main import main
from ckpt.store import Store
from tests import jsonshape
from tests.helpers import env_settings, manifest_only_checkpoint


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def store(isolated_env):
    return Store.open_local(isolated_env, create=True, settings=env_settings())


def poster(store) -> Journal:
    """The journal of an agent 'poster' after a run: two steps done, a third only started, and
    a shell agent's string outcome."""
    journal = Journal(agent="poster", store=store.root)
    for step in (0, 1):
        assert journal.intent(f"post-step-{step}") is None
        journal.record(f"post-step-{step}", {"step": step, "count": 1})
    journal.intent("post-step-2")
    journal.record("mail-7", "sent id=42")
    return journal


def test_list_and_show_say_what_the_agent_did(capsys, store):
    poster(store)
    Journal(agent="mailer", store=store.root).record("report", True)
    manifest_only_checkpoint(store, "poster", datetime.now(timezone.utc))

    code, out, err = run(capsys, "journal", "list", "--json")
    assert code == 0, err
    listed = json.loads(out)
    jsonshape.assert_shape(listed, "journal list")
    assert [(a["agent"], a["records"], a["done"], a["intents"], a["checkpoints"]) for a in listed] == [
        ("mailer", 1, 1, 0, 0), ("poster", 4, 3, 1, 1)]
    code, out, err = run(capsys, "journal", "list")
    assert code == 0 and out.split("\n")[0].split() == ["AGENT", "RECORDS", "DONE", "INTENTS", "NEWEST", "CHECKPOINTS"]

    code, out, err = run(capsys, "journal", "show", "poster", "--json")
    assert code == 0, err
    shown = json.loads(out)
    jsonshape.assert_shape(shown, "journal show")
    assert [(r["key"], r["state"], r["outcome"]) for r in shown] == [
        ("post-step-0", "done", {"step": 0, "count": 1}), ("post-step-1", "done", {"step": 1, "count": 1}),
        ("post-step-2", "intent", None), ("mail-7", "done", "sent id=42")]
    code, out, err = run(capsys, "journal", "show", "poster")
    lines = out.splitlines()
    assert lines[0].split() == ["KEY", "STATE", "TIME", "OUTCOME"]
    assert [line.split()[:2] for line in lines[1:]] == [["post-step-0", "done"], ["post-step-1", "done"],
                                                        ["post-step-2", "intent"], ["mail-7", "done"]]
    assert lines[1].rstrip().endswith('{"step": 0, "count": 1}') and lines[4].rstrip().endswith(" sent id=42")
    code, out, err = run(capsys, "journal", "show", "poster", "mail-7", "post-step-2", "--json")
    assert [r["key"] for r in json.loads(out)] == ["mail-7", "post-step-2"]
    code, out, err = run(capsys, "journal", "show", "poster", "post-step-9")
    assert code == 3 and "has no record of 'post-step-9'" in err and out == ""
    code, out, err = run(capsys, "journal", "show", "nobody")
    assert code == 0 and out == "" and "no records of agent nobody" in err
    code, out, err = run(capsys, "journal", "show", "../etc")
    assert code == 2 and "invalid agent name" in err


def test_rm_removes_all_or_the_keys_given_and_the_next_run_does_them_again(capsys, store):
    journal = poster(store)
    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-1", "post-step-9")
    assert code == 3 and "no record of 'post-step-9'" in err
    assert journal.get("post-step-1") is not None, "all or nothing: nothing was removed"

    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-1", "--dry-run", "--json")
    assert code == 0, err
    planned = json.loads(out)
    jsonshape.assert_shape(planned, "journal rm")
    assert planned["dry_run"] is True and [r["key"] for r in planned["removed"]] == ["post-step-1"]
    assert journal.get("post-step-1") is not None

    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-1", "post-step-2")
    assert code == 0 and out.split() == ["post-step-1", "post-step-2"] and "removed 2 record(s)" in err
    assert journal.entry("post-step-1") is None and journal.entry("post-step-2") is None
    assert journal.intent("post-step-1") is None, "a next run does the removed action again"

    code, out, err = run(capsys, "journal", "rm", "poster", "--json")
    assert code == 0, err
    assert sorted(r["key"] for r in json.loads(out)["removed"]) == ["mail-7", "post-step-0", "post-step-1"]
    assert run(capsys, "journal", "list", "--json")[1].strip() == "[]"
    code, out, err = run(capsys, "journal", "rm", "poster")
    assert code == 3 and "no records of agent poster" in err


def test_rm_of_records_a_checkpoint_may_need_is_refused_unless_forced(capsys, store):
    """A copy restored from a checkpoint taken before an action's outcome was recorded relies
    on that record (prune's rule): removing it would make the copy do the action again."""
    journal = poster(store)
    now = datetime.now(timezone.utc)
    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-0")
    assert code == 0, "no checkpoint of the agent: nothing can roll back to before the action"
    journal.record("post-step-0", {"step": 0, "count": 1})

    manifest_only_checkpoint(store, "poster", now - timedelta(hours=1))
    manifest_only_checkpoint(store, "other", now - timedelta(days=2))
    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-0", "post-step-2")
    assert code == 2 and "2 of these records may be needed" in err and "--force" in err, err
    assert journal.entry("post-step-0") is not None and journal.entry("post-step-2") is not None

    code, out, err = run(capsys, "journal", "rm", "poster", "post-step-0", "--force")
    assert code == 0 and out.split() == ["post-step-0"], err
    assert "removing 1 record(s) that a checkpoint of poster may need" in err
    assert journal.entry("post-step-0") is None

    # Records older than the agent's oldest checkpoint (by prune's margin) are needed by none.
    old = Journal(agent="old-agent", store=store.root)
    from ckpt.store.journal import Journal as StoreJournal

    StoreJournal(store.backend, "old-agent").record("sent-1", "ok", now=(now - timedelta(days=3)).isoformat())
    manifest_only_checkpoint(store, "old-agent", now - timedelta(days=1))
    code, out, err = run(capsys, "journal", "rm", "old-agent")
    assert code == 0 and out.split() == ["sent-1"], err
    assert old.entry("sent-1") is None
