"""The journal of irreversible actions (ckpt/store/journal.py, ckpt/agent/journal.py): records
on every kind of store, durable across processes, one winner among racing copies, pruned only
when no remaining checkpoint can need them, and the CKPT_SOCKET verbs."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from ckpt.agent.journal import Journal as AgentJournal, handle_protocol
from ckpt.errors import DamagedCheckpoint, InvalidReference, OutcomeUnknown, UsageError
from ckpt.store import Store, ids
from ckpt.store.journal import Journal, blob_name, prunable
from ckpt.store.repository import Manifest
from tests.helpers import env_settings, ckpt_json
from tests.unit.test_backends import OPEN, REPO, open_backend


@pytest.fixture(params=["local", "enc-local", "s3", "enc-s3", "cached"])
def spec(request, tmp_path):
    if request.param == "cached":  # a remote store as ckpt opens it: Cache(Encrypted(S3))
        return f"cached:{tmp_path / 'cache'}|enc:{request.getfixturevalue('s3_url')}"
    encrypted = "enc:" if request.param.startswith("enc-") else ""
    if request.param.endswith("local"):
        return encrypted + str(tmp_path / "store")
    return encrypted + request.getfixturevalue("s3_url")


@pytest.fixture
def backend(spec):
    return open_backend(spec)


def test_intent_then_outcome_on_every_store(backend):
    journal = Journal(backend, "mailer")
    assert journal.entry("send-1") is None and journal.get("send-1") is None
    assert journal.intent("send-1") is None  # recorded now: go ahead
    again = journal.intent("send-1")  # a copy restored after the intent finds it
    assert again is not None and again.state == "intent" and not again.done and again.outcome is None
    assert journal.get("send-1") is None  # no outcome yet
    done = journal.record("send-1", {"message_id": "<a@b>"})
    assert done.done and done.outcome == {"message_id": "<a@b>"}
    assert journal.get("send-1") == {"message_id": "<a@b>"}
    assert journal.intent("send-1") == done  # done before: skip it
    # The first outcome stays; a second record is told what the journal holds.
    assert journal.record("send-1", "other").outcome == {"message_id": "<a@b>"}
    assert journal.entry("send-1") == done
    # An outcome without an intent first; keys are any strings.
    for key in ("pay 17 €", "a/b/../c", "x" * 5000, "\n"):
        assert journal.record(key, True).outcome is True
        assert journal.get(key) is True
    assert {e.key for e in journal.entries()} == {"send-1", "pay 17 €", "a/b/../c", "x" * 5000, "\n"}
    # Kept per agent.
    assert Journal(backend, "other-agent").get("send-1") is None


def test_bad_keys_outcomes_and_agents_are_refused(tmp_path):
    journal = Journal(open_backend(str(tmp_path / "store")), "agent")
    with pytest.raises(ValueError, match="cannot be None"):
        journal.record("k", None)
    with pytest.raises(ValueError, match="not a JSON value"):
        journal.record("k", object())
    with pytest.raises(ValueError, match="non-empty string"):
        journal.intent("")
    assert journal.entry("k") is None  # nothing half-written by the refusals
    for agent in ("../x", "", "a/b", "-x", "x" * 65):
        with pytest.raises(InvalidReference, match="invalid agent name"):
            Journal(journal.backend, agent)


def test_a_damaged_record_is_reported_not_taken_for_absent(tmp_path):
    backend = open_backend(str(tmp_path / "store"))
    backend.put(blob_name("agent", "k", "done"), b"{not json")
    with pytest.raises(DamagedCheckpoint, match="journal record .* is damaged"):
        Journal(backend, "agent").get("k")


def run(spec: str, body: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPEN + "from ckpt.store.journal import Journal\n" + body, spec,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)


def test_records_are_durable_across_processes(spec):
    """One process records and dies (kill -9, right after record() returned); a new process
    reads what it recorded."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OPEN + """
from ckpt.store.journal import Journal
import os, signal
journal = Journal(open_backend(sys.argv[1]), "agent")
journal.intent("started")
journal.intent("finished")
journal.record("finished", {"n": 17})
os.kill(os.getpid(), signal.SIGKILL)
""", spec], cwd=REPO)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    read = run(spec, """
journal = Journal(open_backend(sys.argv[1]), "agent")
import json
print(json.dumps([journal.entry("started").state, journal.get("finished"), journal.entry("never")]))
""")
    assert json.loads(read.stdout) == ["intent", {"n": 17}, None]


def test_of_copies_racing_for_an_intent_exactly_one_goes_ahead(spec):
    """Two copies of one agent (the original and a restored one, or two hosts) both reach the
    same action: exactly one is told to do it, each time."""
    body = """
import time
journal = Journal(open_backend(sys.argv[1]), "agent")
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
print(sum(journal.intent(f"action-{i}") is None for i in range(10)))
"""
    start = str(time.time() + 3)
    racers = [subprocess.Popen([sys.executable, "-c", OPEN + "from ckpt.store.journal import Journal\n" + body,
                                spec, start], cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    wins = [int(p.communicate(timeout=60)[0]) for p in racers]
    assert sum(wins) == 10, wins


# ---- pruning ---------------------------------------------------------------------------------

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).isoformat()


def checkpoint_at(minutes: float) -> str:
    return ids.new_id(T0 + timedelta(minutes=minutes))


def test_prune_keeps_every_record_a_remaining_checkpoint_may_need(tmp_path):
    backend = open_backend(str(tmp_path / "store"))
    agent = Journal(backend, "agent")
    agent.intent("old-done", now=at(0))
    agent.record("old-done", 1, now=at(1))
    agent.record("old-done-no-intent", 1, now=at(2))
    agent.intent("old-intent-only", now=at(0))  # frozen mid-action in some checkpoint: kept
    agent.intent("done-near-checkpoint", now=at(50))
    agent.record("done-near-checkpoint", 1, now=at(55))  # within the margin of the oldest checkpoint
    agent.record("after", 1, now=at(120))
    lonely = Journal(backend, "no-checkpoints")  # an agent that has not checkpointed yet
    lonely.record("old", 1, now=at(0))
    checkpoints = [(checkpoint_at(100), "agent"), (checkpoint_at(60), "agent"), (checkpoint_at(5), "other"),
                   (checkpoint_at(1), None)]
    batches = prunable(backend, checkpoints)
    # The oldest checkpoint of "agent" began at minute 60: records done 10 min before go.
    assert batches == [[blob_name("agent", "old-done", "intent")],
                       sorted([blob_name("agent", "old-done", "done"),
                               blob_name("agent", "old-done-no-intent", "done")])]
    for batch in batches:
        backend.delete(batch)
    assert agent.get("old-done") is None and agent.get("old-done-no-intent") is None
    assert agent.entry("old-intent-only").state == "intent"
    assert agent.get("done-near-checkpoint") == 1 and agent.get("after") == 1 and lonely.get("old") == 1
    assert prunable(backend, checkpoints) == []
    assert prunable(backend, []) == []  # no checkpoint at all: nothing is known to be safe


def test_prune_sweeps_only_old_leftovers_of_writes(tmp_path):
    backend = open_backend(str(tmp_path / "store"))
    Journal(backend, "agent").record("k", 1)
    directory = tmp_path / "store" / "journal" / "agent"
    young, old = directory / ".x.done.json.1.tmp", directory / ".y.done.json.2.tmp"
    young.write_bytes(b"{")
    old.write_bytes(b"{")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert prunable(backend, [(checkpoint_at(0), "agent")]) == [["journal/agent/.y.done.json.2.tmp"]]


def make_checkpoint(store: Store, name: str, when: datetime) -> str:
    """A manifest without images: enough for prune's plan, which is all this test runs."""
    checkpoint_id = ids.new_id(when)
    store.commit(Manifest(id=checkpoint_id, created=when.isoformat(), pid=1234, command="agent", processes=[],
                          files=[], name=name))
    return checkpoint_id


def test_ckpt_prune_and_forget_prune_the_journal(isolated_env):
    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    now = datetime.now(timezone.utc)
    journal = Journal(store.backend, "agent")
    journal.record("before-first", 1, now=(now - timedelta(hours=3)).isoformat())
    journal.record("between", 2, now=(now - timedelta(hours=1)).isoformat())
    journal.record("after", 3, now=now.isoformat())
    make_checkpoint(store, "agent", now - timedelta(hours=2))
    make_checkpoint(store, "agent", now - timedelta(minutes=30))
    assert ckpt_json("prune", "--dry-run")["journal_records"] == 1
    assert journal.get("before-first") == 1  # a dry run removes nothing
    assert ckpt_json("prune")["journal_records"] == 1
    assert journal.get("before-first") is None and journal.get("between") == 2
    # Forgetting the first checkpoint makes the record before the second one unneeded.
    forgot = ckpt_json("forget", "--keep-last", "1", "--prune")
    assert len(forgot["remove"]) == 1
    assert journal.get("between") is None and journal.get("after") == 3


# ---- the library -----------------------------------------------------------------------------

def test_the_library_journal_follows_ckpt_name_and_ckpt_store(isolated_env, monkeypatch):
    journal = AgentJournal()
    with pytest.raises(UsageError, match="does not know the agent's name"):
        journal.get("k")
    monkeypatch.setenv("CKPT_NAME", "agent")
    assert journal.intent("k") is None  # creates the store, as a first dump would
    journal.record("k", "ok")
    assert Journal(Store.open_local(isolated_env, settings=env_settings()).backend, "agent").get("k") == "ok"
    monkeypatch.setenv("CKPT_NAME", "bad/name")
    with pytest.raises(InvalidReference):
        journal.get("k")
    elsewhere = isolated_env.parent / "elsewhere"
    other = AgentJournal().use(agent="agent2", store=elsewhere)
    other.record("k", 1)
    assert Journal(Store.open_local(elsewhere, settings=env_settings()).backend, "agent2").get("k") == 1


def test_once_does_an_action_once_and_reconciles_an_unknown_outcome(isolated_env):
    journal = AgentJournal(agent="agent")
    calls = []
    assert journal.once("a", lambda: calls.append("a") or "sent") == "sent"
    assert journal.once("a", lambda: calls.append("again") or "again") == "sent"
    assert calls == ["a"]

    def fails():
        calls.append("b")
        raise ConnectionError("cut")
    with pytest.raises(ConnectionError):
        journal.once("b", fails)
    # Started, outcome unknown: without a way to find out, once() refuses to guess.
    with pytest.raises(OutcomeUnknown, match="'b' of agent agent was started"):
        journal.once("b", fails)
    assert journal.once("b", fails, reconcile=lambda: "found it done") == "found it done"
    assert journal.once("b", fails) == "found it done"
    assert calls == ["a", "b"]


# ---- the CKPT_SOCKET verbs -------------------------------------------------------------------

def test_journal_verbs_of_the_socket_protocol(isolated_env):
    store = Store.open_local(isolated_env, create=True, settings=env_settings())

    def ask(line: str, agent: str | None = "agent") -> str:
        return handle_protocol(line.split(), store, agent)

    assert ask("JOURNAL-GET mail-1") == "OK NONE"
    assert ask("JOURNAL-INTENT mail-1") == "OK NEW"
    assert ask("JOURNAL-INTENT mail-1").startswith("OK INTENT 20")
    assert ask("JOURNAL-GET mail-1").startswith("OK INTENT ")
    assert ask("JOURNAL-RECORD mail-1 sent  as <x@y>") == "OK DONE sent as <x@y>"
    assert ask("JOURNAL-RECORD mail-1 other") == "OK DONE sent as <x@y>"
    assert ask("JOURNAL-INTENT mail-1") == "OK DONE sent as <x@y>"
    assert ask("JOURNAL-GET mail-1") == "OK DONE sent as <x@y>"
    Journal(store.backend, "agent").record("from-python", {"n": 1})
    assert ask("JOURNAL-GET from-python") == 'OK DONE {"n": 1}'
    assert ask("JOURNAL-GET mail-1", agent="other") == "OK NONE"
    assert ask("JOURNAL-GET") == "ERROR usage: JOURNAL-GET KEY"
    assert ask("JOURNAL-INTENT a b") == "ERROR usage: JOURNAL-INTENT KEY"
    assert ask("JOURNAL-RECORD a") == "ERROR usage: JOURNAL-RECORD KEY OUTCOME"
    assert ask("JOURNAL-GET k", agent=None).startswith("ERROR the journal needs the agent's name")
    assert ask("JOURNAL-GET k", agent="../x").startswith("ERROR invalid agent name")
    assert ask("JOURNAL-BOGUS k").startswith("ERROR unknown request")
