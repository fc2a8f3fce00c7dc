"""The journal of irreversible actions: per agent, what it started and what came of it.

A rollback takes an agent back to the memory of one of its checkpoints; what it did to the
outside world since (a mail sent, a payment made) is not rolled back. The journal remembers
those actions outside the process, in the store next to the checkpoints, so that a copy
restored from before an action finds its record and skips or reconciles it instead of doing
it again (see "Journal" in docs/design.md).

Records are blobs of the store's backend, so they work on every store (local, encrypted, S3)
and travel with it. Each record is two write-once blobs named by a hash of its key:
  journal/<agent>/<hash>.intent.json   written (put_if_absent) before the action
  journal/<agent>/<hash>.done.json     written (put_if_absent) with its outcome
Write-once names make every question a single read by name, need no lock (a prune never
deletes a record a checkpoint may still need, see prunable()), and let two copies of one
agent racing for the same action find out which of them started it: exactly one
put_if_absent wins. Each write is durable when it returns.

Copy k of clone C (`ckpt clone`) writes in a branch of the agent's journal,
journal/<agent>/<branch>/<hash>.<state>.json (branch_name(C, k)), and sees the agent's own records only up to
the checkpoint it was restored from (a Branch): each copy does what came after the
checkpoint once, on its own.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import blake3

from ckpt.errors import DamagedCheckpoint, InvalidReference, PermissionProblem, StoreError
from ckpt.store import ids
from ckpt.store.backends import Backend, BlobExists, BlobInfo, BlobNotFound

JOURNAL_PREFIX = "journal/"
FORMAT = 1
INTENT, DONE = "intent", "done"
# The state shown for a record that cannot be read (never written as one).
DAMAGED = "damaged"
# 128 bits of BLAKE3 name a key: no collision in any journal, and the name stays short enough
# for an encrypted store (its names' encrypted part is at most 140 bytes: a 64-character
# agent name, "/", 32 digits, ".intent.json").
KEY_HASH_DIGITS = 32
# A record may go once it is older than the oldest checkpoint of its agent by this much:
# records are stamped by the agent's host and checkpoint IDs by the dumping host, whose clocks
# may differ (a store shared by two hosts), and a journal is too small for haste to matter.
PRUNE_MARGIN = timedelta(minutes=10)
# Writes that never finished (a temp file left by kill -9) are swept once this old: agents
# write records without the store's lock, so a younger one may be a write in progress.
LEFTOVER_AGE = 3600.0


@dataclass(frozen=True)
class Entry:
    """One action's record: state "intent" (started, outcome unknown) or "done" (its outcome
    recorded). `time` is when that state was written (ISO 8601, UTC, the writer's clock)."""

    key: str
    state: str
    outcome: object = None
    time: str = ""

    @property
    def done(self) -> bool:
        return self.state == DONE

    def to_json(self) -> dict:
        return {"key": self.key, "state": self.state, "outcome": self.outcome, "time": self.time}


@dataclass
class Removal:
    """The plan of a removal of records (Journal.plan_removal): the records, and their blobs in
    the order they go (intents, then outcomes). `missing`: keys asked for that have no record."""

    agent: str
    entries: list[Entry]
    intents: list[str]
    dones: list[str]
    missing: list[str]


# A branch is named "<12 hex digits of the BLAKE3 of the clone id>-<copy>" (a copy is 1..999):
# one short path component (see Branch). 48 bits: two clones of one agent never share one.
BRANCH_HASH_DIGITS = 12
BRANCH_RE = re.compile(r"^[0-9a-f]{12}-[1-9][0-9]{0,2}$")


@dataclass(frozen=True)
class Branch:
    """Where copy `copy` of clone `clone` keeps its records, and up to when it sees the
    agent's own: `cutoff`, when CRIU froze the tree for the checkpoint it was restored from
    (the identity file's frozen_at; for a checkpoint that did not record it, the time in its
    ID, when its dump began). A record of the agent written later is the original's, after
    the checkpoint: the copy never sees it, and does that action itself (once, in its branch).

    The branch's name is short, a hash of the clone ID (not copies/<clone id>-<k>): an
    encrypted store turns the name after "journal/" into a file name 1.6 times as long (plus
    its write's temp suffix), which must fit 255 bytes; a 64-character agent, "/", a branch
    of 16 characters, "/", 32 digits and ".intent.json" (126) makes 250."""

    clone: str
    copy: int
    cutoff: datetime

    @property
    def name(self) -> str:
        return branch_name(self.clone, self.copy)

    @classmethod
    def of_checkpoint(cls, clone: str, copy: int, checkpoint_id: str, frozen_at: float | None = None) -> Branch:
        """frozen_at: when CRIU froze the tree (seconds since the epoch; the checkpoint's
        stats.frozen_at), else the time in its ID (older checkpoints: when the dump began)."""
        if isinstance(frozen_at, (int, float)) and frozen_at > 0:
            return cls(clone, copy, datetime.fromtimestamp(frozen_at, timezone.utc))
        return cls(clone, copy, _id_time(ids.check_id(checkpoint_id)))


def branch_name(clone: str, copy: int) -> str:
    """The name of the branch of copy `copy` of clone `clone` in every agent's journal."""
    digest = blake3.blake3(ids.check_id(clone).encode()).hexdigest()[:BRANCH_HASH_DIGITS]
    name = f"{digest}-{int(copy)}"
    if not BRANCH_RE.match(name):
        raise ValueError(f"invalid copy number {copy!r}: copies are numbered 1 to 999")
    return name


def check_agent(agent: str) -> str:
    """An agent is named like its checkpoints (a checkpoint name): the name is a blob path
    component, so nothing unvalidated becomes one."""
    if not isinstance(agent, str) or not ids.NAME_RE.match(agent):
        raise InvalidReference(f"invalid agent name {agent!r} for the journal",
                               hint="use the name of the agent's checkpoints: 1-64 letters, digits, '.', '_' or "
                                    "'-', starting with a letter")
    return agent


def key_hash(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError("a journal key is a non-empty string")
    return blake3.blake3(key.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_HASH_DIGITS]


def blob_name(agent: str, key: str, state: str, branch: str | None = None) -> str:
    """journal/<agent>/<hash>.<state>.json, or in a copy's branch journal/<agent>/<branch>/..."""
    where = f"{check_agent(agent)}/" + (f"{branch}/" if branch is not None else "")
    return f"{JOURNAL_PREFIX}{where}{key_hash(key)}.{state}.json"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class Journal:
    """The journal of one agent in one store (through its backend); with a branch, the
    journal as copy `branch.copy` of a clone sees it: its branch first, then the agent's own
    records up to branch.cutoff, and it writes in its branch only."""

    def __init__(self, backend: Backend, agent: str, branch: Branch | None = None):
        self.backend = backend
        self.agent = check_agent(agent)
        self.branch = branch
        self._where = branch.name if branch is not None else None  # where this journal writes

    def intent(self, key: str, now: str | None = None) -> Entry | None:
        """Records, durably, that the action `key` is about to be done. Returns None when this
        call recorded it (go ahead), else the record already there: done (skip it: its
        outcome is known) or an intent (started before, by an earlier run or a copy of this
        agent, outcome unknown: reconcile with the outside world, then record())."""
        if self.branch is not None:
            # The agent's records up to the checkpoint are fixed: a copy that finds one there
            # (done, or started before the checkpoint) treats it as its own and writes nothing.
            found = self.entry(key)
            if found is not None:
                return found
        try:
            self.backend.put_if_absent(self._name(key, INTENT), self._render(key, INTENT, None, now))
        except BlobExists:
            found = self.entry(key)
            if found is None:  # deleted meanwhile: only a prune does that, to a done record
                # Deleted between the two reads: a prune removes only records whose outcome
                # is older than every checkpoint, so the action was done long ago.
                raise StoreError(f"the journal record of {key!r} of agent {self.agent} was pruned while it was "
                                 "read: the action was done before the oldest checkpoint of the agent",
                                 hint="an agent must remember in its memory what it did before its checkpoints"
                                 ) from None
            return found
        except OSError as exc:
            raise self._failed("recording an intent", exc) from exc
        done = self._read(key, DONE, self._where)  # recorded done without an intent before (record() alone)
        return done

    def record(self, key: str, outcome: object, now: str | None = None) -> Entry:
        """Records, durably, the outcome of the action `key` (any JSON value but None). The
        first outcome recorded stays: returns the record the journal holds, which is this one
        unless an outcome was recorded before."""
        if outcome is None:
            raise ValueError("a journal outcome cannot be None (it could not be told from no record): "
                             "record True, a string or a dict")
        data = self._render(key, DONE, outcome, now)
        if self.branch is not None and (before := self._before(key)) is not None and before.done:
            return before  # recorded before the checkpoint: the first outcome
        try:
            self.backend.put_if_absent(self._name(key, DONE), data)
        except BlobExists:
            found = self._read(key, DONE, self._where)
            if found is not None:
                return found
        except OSError as exc:
            raise self._failed("recording an outcome", exc) from exc
        return self._parse(data, self._name(key, DONE), key)

    def entry(self, key: str) -> Entry | None:
        """The record of `key`: done, intent, or None if there is none."""
        found = self._read(key, DONE, self._where) or self._read(key, INTENT, self._where)
        if found is None and self.branch is not None:
            found = self._before(key)
        return found

    def get(self, key: str) -> object:
        """The outcome recorded for `key`, or None."""
        found = self._read(key, DONE, self._where) or self._before(key)
        return found.outcome if found is not None and found.done else None

    def _before(self, key: str) -> Entry | None:
        """In a branch: the agent's own record of `key` as it was at the checkpoint (its
        outcome if recorded by then, else its intent if started by then), or None."""
        if self.branch is None:
            return None
        for state in (DONE, INTENT):
            found = self._read(key, state, None)
            if found is not None and _written_by(found, self.branch.cutoff):
                return found
        return None

    def _name(self, key: str, state: str) -> str:
        return blob_name(self.agent, key, state, self._where)

    def entries(self) -> list[Entry]:
        """Every record of the agent (a done record hides its intent), in no particular order;
        those of its own level only (a copy's branch is not the agent's)."""
        by_hash: dict[str, Entry] = {}
        for info in self._own_blobs():
            digest, state = _split(info.name)
            if state is None:
                continue
            try:
                found = self._parse(self.backend.get(info.name), info.name, None)
            except (BlobNotFound, DamagedCheckpoint):
                continue
            if state == DONE or digest not in by_hash:
                by_hash[digest] = found
        return list(by_hash.values())

    def plan_removal(self, keys: list[str] | None = None) -> Removal:
        """What removing records would delete (nothing is deleted here): every record of the
        agent, or those of `keys` (a key without a record is named in `missing`). A record that
        cannot be read is removed too (its entry says "damaged"). Unfinished writes (temp files)
        are left to prune, which sweeps them once they are old."""
        names = sorted(info.name for info in self._own_blobs() if _split(info.name)[1] is not None)
        removal = Removal(self.agent, [], [], [], [])
        if keys is None:
            removal.entries = sorted(self.entries(), key=lambda e: (e.time, e.key))
            targets = names
        else:
            targets = []
            for key in dict.fromkeys(keys):
                held = [name for name in (blob_name(self.agent, key, INTENT), blob_name(self.agent, key, DONE))
                        if name in names]
                if not held:
                    removal.missing.append(key)
                    continue
                try:
                    entry = self.entry(key)
                except DamagedCheckpoint:
                    entry = None
                removal.entries.append(entry or Entry(key, DAMAGED))
                targets += held
        removal.intents = [name for name in targets if _split(name)[1] == INTENT]
        removal.dones = [name for name in targets if _split(name)[1] == DONE]
        return removal

    def remove(self, removal: Removal) -> None:
        """Deletes what plan_removal() found: intents first, then their outcomes (each batch
        durable before the next), so that a reader never meets an intent whose outcome is gone
        (it would reconcile an action that is known to be done), as prunable() does."""
        try:
            for batch in (removal.intents, removal.dones):
                if batch:
                    self.backend.delete(batch)
        except OSError as exc:
            raise self._failed("removing records", exc) from exc

    def branches(self) -> list[str]:
        """The branches of the agent's journal (branch_name()), one per copy that wrote."""
        prefix = f"{JOURNAL_PREFIX}{self.agent}/"
        found = {info.name[len(prefix):].partition("/")[0] for info in self.backend.list(prefix)
                 if "/" in info.name[len(prefix):]}
        return sorted(name for name in found if BRANCH_RE.match(name))

    # ---- blobs ---------------------------------------------------------------------------

    def _own_blobs(self) -> list[BlobInfo]:
        """The blobs of the agent's own level (listing is by prefix: branches are below it)."""
        prefix = f"{JOURNAL_PREFIX}{self.agent}/"
        return [info for info in self.backend.list(prefix) if "/" not in info.name[len(prefix):]]

    def _render(self, key: str, state: str, outcome: object, now: str | None) -> bytes:
        record = {"format": FORMAT, "agent": self.agent, "key": key, "state": state, "time": now or _now(),
                  "host": socket.gethostname(), "pid": os.getpid()}
        if state == DONE:
            record["outcome"] = outcome
        try:
            return json.dumps(record).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the outcome of {key!r} is not a JSON value: {exc}") from None

    def _read(self, key: str, state: str, branch: str | None = None) -> Entry | None:
        name = blob_name(self.agent, key, state, branch)
        try:
            data = self.backend.get(name)
        except BlobNotFound:
            return None
        except OSError as exc:
            raise self._failed("reading a record", exc) from exc
        return self._parse(data, name, key)

    def _parse(self, data: bytes, name: str, key: str | None) -> Entry:
        try:
            record = json.loads(data)
            entry = Entry(record["key"], record["state"], record.get("outcome"), record["time"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedCheckpoint(f"journal record {self.backend.where(name)} is damaged ({exc})",
                                    hint="remove it if its action's outcome is known otherwise") from exc
        if (key is not None and entry.key != key) or entry.state not in (INTENT, DONE):
            raise DamagedCheckpoint(f"journal record {self.backend.where(name)} names another action "
                                    f"({entry.key!r}, {entry.state})")
        return entry

    def _failed(self, what: str, exc: OSError) -> StoreError | PermissionProblem:
        from ckpt.store.fsutil import translate_os_error

        return translate_os_error(exc, f"{what} in the journal of {self.agent}")


def _written_by(entry: Entry, cutoff: datetime) -> bool:
    """Whether the record was written at or before cutoff (a time that cannot be read: no, the
    copy then does the action itself rather than take another's outcome for its own)."""
    try:
        written = datetime.fromisoformat(entry.time)
    except ValueError:
        return False
    return written.tzinfo is not None and written <= cutoff


def _split(name: str) -> tuple[str, str | None]:
    """journal/<agent>/<hash>.<state>.json -> (hash, state), or (.., None) for other names."""
    last = name.rpartition("/")[2]
    digest, _, rest = last.partition(".")
    state = rest.removesuffix(".json") if rest.endswith(".json") else None
    return digest, state if state in (INTENT, DONE) else None


def agents(backend: Backend) -> list[str]:
    """The agents that have records in the store, by name (a name that is not an agent's, which
    only a hand-made blob could give, is left out)."""
    found = {info.name[len(JOURNAL_PREFIX):].partition("/")[0] for info in backend.list(JOURNAL_PREFIX)}
    return sorted(name for name in found if ids.NAME_RE.match(name))


def oldest_checkpoints(checkpoints: Iterable[tuple[str, str | None]]) -> dict[str, datetime]:
    """Per agent (a checkpoint name), when its oldest remaining checkpoint began: no rollback of
    the agent goes further back."""
    oldest: dict[str, datetime] = {}
    for checkpoint_id, name in checkpoints:
        if name and ids.is_id(checkpoint_id):
            began = _id_time(checkpoint_id)
            oldest[name] = min(began, oldest.get(name, began))
    return oldest


def needed(entry: Entry, oldest_checkpoint: datetime | None, margin: timedelta = PRUNE_MARGIN) -> bool:
    """Whether a copy of the agent restored from one of its remaining checkpoints may rely on
    this record (the rule of prunable()): an intent always, while the agent has a checkpoint; an
    outcome recorded later than `margin` before the oldest one began. Without a checkpoint no
    rollback can happen. An unreadable time counts as needed."""
    if oldest_checkpoint is None:
        return False
    if not entry.done:
        return True
    try:
        written = datetime.fromisoformat(entry.time)
    except ValueError:
        return True
    return written.tzinfo is None or written >= oldest_checkpoint - margin


def _id_time(checkpoint_id: str) -> datetime:
    """The time in a checkpoint ID: when its dump began (for a checkpoint the agent asked for,
    when it asked), before the freeze."""
    return datetime.strptime(checkpoint_id[:19] + "000", "%Y%m%d-%H%M%S-%f").replace(tzinfo=timezone.utc)


def prunable(backend: Backend, checkpoints: Iterable[tuple[str, str | None]],
             margin: timedelta = PRUNE_MARGIN, now: float | None = None) -> list[list[str]]:
    """The journal blobs a prune may delete, as batches to delete in order, given every
    remaining checkpoint as (id, name).

    A rollback only goes back to a remaining checkpoint, and the memory of a checkpoint knows
    every action whose outcome was recorded before its dump began. So a record may go when its
    outcome was recorded, by the agent's clock, at least `margin` before the oldest remaining
    checkpoint named like the agent began. Kept: records of agents with no checkpoint (a
    running agent that has not checkpointed yet may still rely on them); intents without an
    outcome (a checkpoint may have been taken between the intent and the outcome, and a copy
    restored from it must find the intent); unreadable records. Leftovers of unfinished writes
    go once LEFTOVER_AGE old. First batch: intents (and leftovers); second: their done records,
    so that a reader never sees an intent whose outcome was deleted (it would reconcile in
    vain)."""
    oldest = oldest_checkpoints(checkpoints)
    intents: list[str] = []
    dones: list[str] = []
    infos = backend.list(JOURNAL_PREFIX)
    by_agent: dict[str, list[BlobInfo]] = {}
    for info in infos:
        by_agent.setdefault(info.name[len(JOURNAL_PREFIX):].partition("/")[0], []).append(info)
    for agent, agent_infos in by_agent.items():
        if agent not in oldest:
            continue
        cutoff = oldest[agent] - margin
        names = {info.name for info in agent_infos}
        for info in agent_infos:
            digest, state = _split(info.name)
            if state != DONE:
                continue
            try:
                record = json.loads(backend.get(info.name))
                written = datetime.fromisoformat(record["time"])
            except (BlobNotFound, DamagedCheckpoint, ValueError, KeyError, TypeError):
                continue
            if written.tzinfo is None or written >= cutoff:
                continue
            intent = info.name.rpartition("/")[0] + f"/{digest}.{INTENT}.json"
            if intent in names:
                intents.append(intent)
            dones.append(info.name)
    clock = backend.now() if now is None else now
    leftovers = [info.name for info in backend.list(JOURNAL_PREFIX, incomplete=True)
                 if info.modified is not None and info.modified < clock - LEFTOVER_AGE]
    return [batch for batch in (intents + leftovers, dones) if batch]
