"""The journal of a clone's copies (ckpt/store/journal.py Branch, ckpt/agent/journal.py,
ckpt/agent/identity.py): copy k of clone C writes in its own branch, sees the agent's own
records up to the checkpoint it was restored from, never another copy's nor the original's
later ones; prune and `ckpt journal` keep working with branches in the store."""

import json
import os
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest

from ckpt.agent import identity
from ckpt.agent.journal import Journal as AgentJournal
from ckpt.store import ids
from ckpt.store.journal import BRANCH_RE, Branch, Journal, blob_name, branch_name, prunable
from ckpt.system import procfs
from tests.unit.test_backends import open_backend

CHECKPOINT = "20261130-230102-123-3fa9c1"
CLONE = "20261130-231500-000-abcdef"
AT = datetime(2026, 11, 30, 23, 1, 2, 123000, tzinfo=timezone.utc)  # the time in CHECKPOINT


def stamp(seconds: float) -> str:
    """A record time `seconds` after the checkpoint's dump began."""
    return (AT + timedelta(seconds=seconds)).isoformat()


@pytest.fixture(params=["local", "enc-local"])
def backend(request, tmp_path):
    return open_backend(("enc:" if request.param == "enc-local" else "") + str(tmp_path / "store"))


def copy(backend, k: int) -> Journal:
    return Journal(backend, "agent", Branch.of_checkpoint(CLONE, k, CHECKPOINT))


def test_the_branch_is_the_time_in_the_checkpoint_id():
    branch = Branch.of_checkpoint(CLONE, 3, CHECKPOINT)
    assert branch.cutoff == AT and branch.name == branch_name(CLONE, 3) and branch.name.endswith("-3")
    assert blob_name("agent", "k", "done", branch.name).startswith(f"journal/agent/{branch.name}/")
    assert branch_name(CLONE, 3) != branch_name("20261130-231500-000-abcdee", 3)
    assert BRANCH_RE.match(branch_name(CLONE, 999))
    for bad in (0, 1000, -1):
        with pytest.raises(ValueError):
            branch_name(CLONE, bad)


def test_a_record_between_the_dumps_start_and_the_freeze_is_the_copys_past(backend):
    """The cutoff is the freeze (stats.frozen_at), not the dump's start (the ID's time): what
    the agent recorded while ckpt prepared the dump is in the copy's memory already."""
    frozen_at = (AT + timedelta(seconds=0.4)).timestamp()
    Journal(backend, "agent").record("call-1", "one", now=stamp(0.2))  # after the ID's time, before the freeze
    Journal(backend, "agent").record("call-2", "two", now=stamp(0.6))  # after the freeze: the original's
    branch = Branch.of_checkpoint(CLONE, 1, CHECKPOINT, frozen_at)
    assert branch.cutoff == AT + timedelta(seconds=0.4)
    copy_1 = Journal(backend, "agent", branch)
    assert copy_1.get("call-1") == "one"
    assert copy_1.intent("call-2") is None  # not seen: the copy does it itself
    assert Branch.of_checkpoint(CLONE, 1, CHECKPOINT, None).cutoff == AT  # older checkpoints: the ID's time


def test_the_longest_branch_name_fits_an_encrypted_store(tmp_path):
    backend = open_backend("enc:" + str(tmp_path / "store"))
    agent = "a" * 64
    journal = Journal(backend, agent, Branch.of_checkpoint(CLONE, 999, CHECKPOINT))
    assert journal.intent("k") is None
    assert journal.record("k", 1).outcome == 1


def test_a_copy_sees_what_was_done_before_the_checkpoint(backend):
    original = Journal(backend, "agent")
    original.record("call-1", "one", now=stamp(-5))
    for k in (1, 2):
        seen = copy(backend, k).intent("call-1")
        assert seen is not None and seen.done and seen.outcome == "one"  # skipped in every copy
        assert copy(backend, k).get("call-1") == "one"
        assert copy(backend, k).record("call-1", "again").outcome == "one"  # the first outcome stays
    assert Journal(backend, "agent").branches() == []  # nothing was written in a branch


def test_each_copy_does_what_came_after_the_checkpoint_once(backend):
    original = Journal(backend, "agent")
    original.intent("call-2", now=stamp(3))  # the original, after the checkpoint
    original.record("call-2", "original's", now=stamp(4))
    for k in (1, 2, 3):
        journal = copy(backend, k)
        assert journal.entry("call-2") is None and journal.get("call-2") is None  # not the original's
        assert journal.intent("call-2") is None  # go ahead: this copy's own
        again = journal.intent("call-2")
        assert again is not None and not again.done  # a second try in the same copy reconciles
        assert journal.record("call-2", f"copy {k}").outcome == f"copy {k}"
    for k in (1, 2, 3):
        assert copy(backend, k).get("call-2") == f"copy {k}"  # never another copy's
    assert original.get("call-2") == "original's"  # the original never sees a copy's
    assert {e.key: e.outcome for e in original.entries()} == {"call-2": "original's"}
    assert original.branches() == sorted(branch_name(CLONE, k) for k in (1, 2, 3))


def test_an_action_in_flight_at_the_checkpoint_is_reconciled_in_the_copy(backend):
    original = Journal(backend, "agent")
    original.intent("pay", now=stamp(-1))  # started before the checkpoint ...
    original.record("pay", "paid", now=stamp(2))  # ... and finished after it, by the original
    seen = copy(backend, 1).intent("pay")
    assert seen is not None and not seen.done  # as the copy's memory left it: reconcile
    assert copy(backend, 1).get("pay") is None
    assert copy(backend, 1).record("pay", "reconciled").outcome == "reconciled"
    assert copy(backend, 1).get("pay") == "reconciled"


def test_a_record_of_an_unreadable_time_is_not_taken_for_the_copys(backend):
    Journal(backend, "agent").record("k", "x", now="not a time")
    assert copy(backend, 1).intent("k") is None


def test_prune_keeps_branches_by_the_agents_rule(backend):
    """A copy's later checkpoints are the agent's (named like it): a branch record goes when an
    agent record would, once older than the agent's oldest checkpoint (less the margin)."""
    old, new = stamp(3600), stamp(3 * 3600)  # the oldest remaining checkpoint: 2 h after AT
    for journal, prefix in ((Journal(backend, "agent"), "a-"), (copy(backend, 1), "c-")):
        journal.intent(prefix + "old")
        journal.record(prefix + "old", 1, now=old)
        journal.record(prefix + "new", 1, now=new)
        journal.intent(prefix + "open")
    batches = prunable(backend, [(ids.new_id(AT + timedelta(hours=2)), "agent")])
    expected = [blob_name("agent", key, state, where) for key, where in (("a-old", None),
                                                                         ("c-old", branch_name(CLONE, 1)))
                for state in ("intent", "done")]
    assert sorted(n for batch in batches for n in batch) == sorted(expected)
    assert set(batches[0]) == {n for n in expected if n.endswith("intent.json")}  # intents first
    assert prunable(backend, []) == []  # an agent without a checkpoint: every record kept


def test_removing_an_agents_records_leaves_its_branches_to_prune(backend):
    Journal(backend, "agent").record("a", 1)
    copy(backend, 1).record("b", 2)
    journal = Journal(backend, "agent")
    removal = journal.plan_removal()
    assert [e.key for e in removal.entries] == ["a"]
    assert all(f"/{branch_name(CLONE, 1)}/" not in name for name in removal.intents + removal.dones)


# ---- the agent's side: the identity file picks the branch ------------------------------------


def write_identity(directory, inode, copy_number, checkpoint=CHECKPOINT, init=None):
    """init: (host PID, start ticks); default this test's process, alive (the namespaces
    fixture makes every process's PID namespace the test's current one)."""
    directory.mkdir(parents=True, exist_ok=True)
    if init is None:
        init = (os.getpid(), procfs.start_ticks(os.getpid()))
    (directory / f"pidns-{inode}.json").write_text(json.dumps({
        "format": 2, "clone": CLONE, "copy": copy_number, "copies": 4, "checkpoint": checkpoint,
        "name": "agent", "created": "2026-11-30T23:15:00+00:00", "init": list(init)}))


@pytest.fixture
def namespaces(monkeypatch, tmp_path):
    """Makes the caller's PID namespace whatever inode the test sets; CKPT_COPIES_DIR a temp dir."""
    current = {"inode": 1000}
    monkeypatch.setattr(identity, "pidns_inode", lambda pid="self": current["inode"])
    monkeypatch.setattr(identity, "remembered", identity.Remembered())
    directory = tmp_path / "copies"
    monkeypatch.setenv("CKPT_COPIES_DIR", str(directory))
    return current, directory


def test_the_agent_journal_writes_in_its_copys_branch(namespaces, tmp_path):
    current, directory = namespaces
    store = tmp_path / "store"
    journal = AgentJournal(agent="agent", store=str(store))
    journal.record("call-1", "one")  # the original, before its checkpoint
    time.sleep(0.01)  # the checkpoint's ID is in ms
    current["inode"] = 2002  # restored as copy 2
    write_identity(directory, 2002, 2, checkpoint=_id_now())
    assert journal.get("call-1") == "one"
    assert journal.once("call-2", lambda: "copy 2's") == "copy 2's"
    current["inode"] = 3003  # copy 3 of the same checkpoint
    write_identity(directory, 3003, 3, checkpoint=json.loads((directory / "pidns-2002.json").read_text())["checkpoint"])
    assert journal.once("call-2", lambda: "copy 3's") == "copy 3's"
    backend = open_backend(str(store))
    assert Journal(backend, "agent").branches() == sorted([branch_name(CLONE, 2), branch_name(CLONE, 3)])
    assert Journal(backend, "agent").get("call-2") is None  # the original's level holds none


def test_a_plain_restore_of_a_copys_checkpoint_stays_that_copy(namespaces):
    current, directory = namespaces
    write_identity(directory, 2002, 2)
    current["inode"] = 2002
    assert identity.remembered.current(directory)["copy"] == 2
    current["inode"] = 5005  # a new PID namespace without an identity file: CRIU made it
    assert identity.remembered.current(directory)["copy"] == 2
    assert identity.read_identity(directory) is None  # copy_info() says what the file says


def test_the_original_has_no_identity(namespaces):
    _, directory = namespaces
    assert identity.remembered.current(directory) is None
    assert identity.read_identity(directory) is None


@pytest.mark.parametrize("record", [
    {"format": 3, "clone": CLONE, "copy": 1, "checkpoint": CHECKPOINT, "init": [1, 1]},
    {"format": 1, "clone": CLONE, "copy": 1, "copies": 4, "checkpoint": CHECKPOINT},  # names no init
    {"format": 2, "clone": CLONE, "copy": 1, "copies": 4, "checkpoint": CHECKPOINT},
    {"format": 2, "clone": CLONE, "copy": 1, "checkpoint": CHECKPOINT, "init": "1"},
    {"format": 1, "clone": CLONE, "copy": 0, "checkpoint": CHECKPOINT},
    {"format": 1, "clone": CLONE, "copy": True, "checkpoint": CHECKPOINT},
    {"format": 1, "clone": "../x", "copy": 1, "checkpoint": CHECKPOINT},
    {"format": 1, "clone": CLONE, "copy": 1},
    [1, 2],
])
def test_what_is_not_an_identity_is_ignored(tmp_path, record):
    (tmp_path / "pidns-7.json").write_text(json.dumps(record))
    assert identity.read_identity(tmp_path, 7) is None


def test_an_identity_of_another_user_is_ignored(namespaces):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    _, directory = namespaces
    write_identity(directory, 1000, 1)
    assert identity.read_identity(directory)["copy"] == 1
    os.chown(directory / "pidns-1000.json", 65534, 65534)
    assert identity.read_identity(directory) is None


def test_an_identity_whose_init_is_gone_is_ignored(namespaces):
    """A namespace's inode is reused once it is gone: a file left by a copy that ended must not
    make a later process think it is that copy."""
    _, directory = namespaces
    ended = subprocess.Popen(["true"])
    ended.wait()
    write_identity(directory, 1000, 1, init=(ended.pid, 1))
    assert identity.read_identity(directory) is None
    me = os.getpid()
    write_identity(directory, 1000, 1, init=(me, procfs.start_ticks(me) + 1))  # the PID, another process
    assert identity.read_identity(directory) is None
    write_identity(directory, 1000, 1)
    assert identity.read_identity(directory)["copy"] == 1


def test_an_identity_whose_init_is_in_another_namespace_is_ignored(tmp_path):
    """Real namespaces: the init named lives, but is not in the namespace the file is named by."""
    me = os.getpid()
    own = identity.pidns_inode()
    write_identity(tmp_path, own, 1, init=(me, procfs.start_ticks(me)))
    assert identity.read_identity(tmp_path)["copy"] == 1
    write_identity(tmp_path, own + 1, 2, init=(me, procfs.start_ticks(me)))
    assert identity.read_identity(tmp_path, own + 1) is None


def _id_now() -> str:
    return ids.new_id()
