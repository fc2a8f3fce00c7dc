"""`ckpt journal`: the records of the journal of irreversible actions (ckpt.journal; "Journal"
in docs/design.md): which agents have records, what each record says, and removing them.

An agent's records are what keeps a copy restored from one of its checkpoints from doing an
action again: removing one that a remaining checkpoint may need is refused unless forced."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ckpt.commands.results import JsonResult
from ckpt.errors import JournalRecordNotFound, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.journal import Entry, Journal, agents, check_agent, needed, oldest_checkpoints


def _oldest(store: Store) -> dict[str, datetime]:
    return oldest_checkpoints((m.id, m.name) for m in store.manifests())


def _checkpoint_counts(store: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    for manifest in store.manifests():
        if manifest.name:
            counts[manifest.name] = counts.get(manifest.name, 0) + 1
    return counts


def list_agents(store: Store) -> list[dict]:
    """One row per agent with records, by name (`ckpt journal list --json`, docs/json.md)."""
    checkpoints = _checkpoint_counts(store)
    rows = []
    for agent in agents(store.backend):
        entries = Journal(store.backend, agent).entries()
        rows.append({
            "agent": agent,
            "records": len(entries),
            "done": sum(1 for e in entries if e.done),
            "intents": sum(1 for e in entries if not e.done),
            "newest": max((e.time for e in entries), default=None),
            "checkpoints": checkpoints.get(agent, 0),
        })
    return rows


@dataclass(frozen=True)
class JournalRecords(JsonResult):
    agent: str
    entries: list[Entry]

    def to_json(self) -> list[dict]:
        return [e.to_json() for e in self.entries]


def show(store: Store, agent: str, keys: list[str] | None = None) -> JournalRecords:
    """The agent's records, oldest first (`ckpt journal show --json`): all of them, or those of
    `keys`, each of which must have one."""
    journal = Journal(store.backend, check_agent(agent))
    if not keys:
        return JournalRecords(agent, sorted(journal.entries(), key=lambda e: (e.time, e.key)))
    found: list[Entry] = []
    missing = []
    for key in dict.fromkeys(keys):
        entry = journal.entry(key)
        if entry is None:
            missing.append(key)
        else:
            found.append(entry)
    if missing:
        raise _not_found(agent, missing)
    return JournalRecords(agent, found)


def remove(store: Store, agent: str, keys: list[str] | None = None, dry_run: bool = False, force: bool = False,
           reporter: Reporter = NullReporter()) -> dict:
    """Removes the agent's records (all, or those of `keys`: all or nothing, every key must have
    a record). Refused, unless `force`, when a remaining checkpoint of the agent may need one of
    them: a copy restored from it would do that action again (the rule prune follows)."""
    journal = Journal(store.backend, check_agent(agent))
    with store.lock(exclusive=True):  # no prune deletes the same records meanwhile
        removal = journal.plan_removal(keys or None)
        if removal.missing:
            raise _not_found(agent, removal.missing)
        if not removal.intents and not removal.dones:
            raise JournalRecordNotFound(f"the journal has no records of agent {agent}",
                                        hint="'ckpt journal list' lists the agents that have some")
        oldest = _oldest(store).get(agent)
        at_risk = [e for e in removal.entries if needed(e, oldest)]
        if at_risk and not force:
            raise UsageError(
                f"{len(at_risk)} of these records may be needed: agent {agent} has checkpoints from before "
                f"{'its action' if len(at_risk) == 1 else 'their actions'} ended, and a copy restored from one "
                f"would do {'it' if len(at_risk) == 1 else 'them'} again ({', '.join(repr(e.key) for e in at_risk[:3])}"
                f"{'...' if len(at_risk) > 3 else ''})",
                hint=f"remove the checkpoints named {agent} first, or pass --force if none will be restored")
        if at_risk:
            reporter.warn(f"removing {len(at_risk)} record(s) that a checkpoint of {agent} may need: a copy "
                          "restored from it would do those actions again")
        if not dry_run:
            journal.remove(removal)
    return {"agent": agent, "removed": [e.to_json() for e in removal.entries], "dry_run": dry_run}


def _not_found(agent: str, keys: list[str]) -> JournalRecordNotFound:
    listed = ", ".join(repr(k) for k in keys)
    return JournalRecordNotFound(f"the journal of agent {agent} has no record of {listed}",
                                 hint=f"'ckpt journal show {agent}' lists its records")
