"""ckpt.journal: exactly-once irreversible actions across rollbacks.

An agent restored from a checkpoint goes on from that checkpoint's memory: anything it did to
the outside world after the checkpoint (a mail sent, a payment made) it has forgotten, and
would do again. The journal remembers such actions outside the process, durably, in the store
the agent checkpoints into (ckpt/store/journal.py), so that the restored copy finds them:

    from ckpt import journal

    prior = journal.intent("pay-invoice-17")    # durable before the call
    if prior is None:                           # nobody started it: do it
        outcome = pay(invoice)
    elif prior.done:                            # done before the rollback: skip it
        outcome = prior.outcome
    else:                                       # started, outcome unknown: ask the world
        outcome = lookup_payment(invoice) or pay(invoice)
    journal.record("pay-invoice-17", outcome)   # durable when it returns

or, the same in one call, `journal.once(key, action, reconcile)`.

Which journal: the agent's name (`journal.use(agent=NAME)`, else the CKPT_NAME setting) is the
name of its checkpoints, by which records are kept and pruned; the store is `use(store=...)`,
else the CKPT_STORE setting (the store `ckpt.checkpoint()` and `ckpt dump` use). A record
older than the agent's oldest remaining checkpoint is pruned: the agent must keep in its own
memory what it did before a checkpoint (its memory is checkpointed); the journal covers the
gap between a checkpoint and the actions after it.

The same through `ckpt run`'s CKPT_SOCKET line protocol: handle_protocol() below.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ckpt import settings
from ckpt.agent import arguments, identity
from ckpt.errors import CkptError, OutcomeUnknown, UsageError
from ckpt.store import Store
from ckpt.store.journal import Branch, Entry, Journal as StoreJournal, check_agent

__all__ = ["Entry", "Journal", "journal", "handle_protocol"]


def _critical_section() -> AbstractContextManager:
    """A journal write must not be frozen halfway: a checkpoint would hold an open temp file
    that is renamed away right after, and could not be restored. So each call is a
    no_checkpoint() section (ckpt/agent/sections.py), where that is available."""
    try:
        from ckpt.agent.sections import no_checkpoint
    except ImportError:  # a build without critical sections: writes take milliseconds
        return nullcontext()
    return no_checkpoint()


class Journal:
    """The journal of one agent: `ckpt.journal` is the one of the agent named by CKPT_NAME in
    the store of CKPT_STORE, unless use() says otherwise. Records survive kill -9, restores
    and moves to another host (they are in the store); each write is durable when it returns.
    Keys are any non-empty strings naming one action (e.g. "post-step-17"); outcomes any JSON
    value but None."""

    def __init__(self, agent: str | None = None, store: str | Path | None = None):
        self._agent = arguments.optional_str(agent, "Journal(): agent")
        self._location = arguments.optional_store(store, "Journal(): store")
        self._opened: tuple[object, str, Branch | None, StoreJournal] | None = None

    def use(self, agent: str | None = None, store: str | Path | None = None) -> Journal:
        """Names the agent (its checkpoints' name) and/or the store (a directory or an s3://
        URL), instead of CKPT_NAME and CKPT_STORE; what is not given stays. Returns the journal.
        Raises TypeError for an agent that is not a str, or a store not a str or path."""
        agent = arguments.optional_str(agent, "journal.use(): agent")
        store = arguments.optional_store(store, "journal.use(): store")
        if agent is not None:
            self._agent = check_agent(agent)
        if store is not None:
            self._location = store
        self._opened = None
        return self

    @property
    def agent(self) -> str:
        agent = self._agent or settings.Settings.from_environment().name
        if not agent:
            raise UsageError("the journal does not know the agent's name",
                             hint="set CKPT_NAME=NAME (the name of the agent's checkpoints) or call "
                                  "ckpt.journal.use(agent=NAME)")
        return check_agent(agent)

    def _journal(self) -> StoreJournal:
        # The program's own process: its settings are its environment, read at each call as the
        # program may change it (the agent API's edge, as the CLI is ckpt's).
        environment = settings.Settings.from_environment()
        location = (settings.store_from_flag(self._location) if self._location is not None
                    else environment.store)
        agent = self.agent
        branch = _branch(environment)
        if self._opened is None or self._opened[:3] != (location, agent, branch):
            # Opened once and kept: an encrypted store costs a key derivation (0.1 s) to open.
            # A local store holds no descriptor open between calls.
            if self._opened is not None and self._opened[:2] == (location, agent):
                store_backend = self._opened[3].backend
            else:
                store_backend = Store.open(location, create=not settings.is_remote(location),
                                           settings=environment).backend
            self._opened = (location, agent, branch, StoreJournal(store_backend, agent, branch))
        return self._opened[3]

    def intent(self, key: str) -> Entry | None:
        """Records, durably, that the action `key` is about to be done. None: this call recorded
        it, go ahead. Otherwise the record already there: `.done` (skip the action: its
        `.outcome` is known) or an intent (started before a rollback or a crash, outcome
        unknown: find out from the outside world whether it happened, then record())."""
        with _critical_section():
            return self._journal().intent(key)

    def record(self, key: str, outcome: object) -> Entry:
        """Records, durably, the outcome of the action `key` (with or without an intent
        first). The first outcome recorded stays: returns the record the journal holds."""
        with _critical_section():
            return self._journal().record(key, outcome)

    def get(self, key: str) -> object:
        """The outcome recorded for `key`, or None (no record, or an intent only)."""
        with _critical_section():
            return self._journal().get(key)

    def entry(self, key: str) -> Entry | None:
        """The record of `key` (`.state` "intent" or "done", `.outcome`, `.time`), or None."""
        with _critical_section():
            return self._journal().entry(key)

    def once(self, key: str, action: Callable[[], object],
             reconcile: Callable[[], object] | None = None) -> object:
        """Does `action()` once per key across rollbacks and crashes, and returns its outcome:
        recorded -> the recorded outcome, without calling anything; never started -> intent,
        action(), record; started but no outcome (the process died or was rolled back in
        between) -> reconcile(), which finds out from the outside world what happened (and
        may call action() itself if it did not), then record. Without reconcile, that case
        raises OutcomeUnknown. If action() raises, the intent stays and the next call
        reconciles: whether a failed call had an effect is for the outside world to say."""
        prior = self.intent(key)
        if prior is not None and prior.done:
            return prior.outcome
        if prior is None:
            outcome = action()
        elif reconcile is None:
            raise OutcomeUnknown(f"the action {key!r} of agent {self.agent} was started (at {prior.time}) but its "
                                 "outcome was never recorded",
                                 hint="pass reconcile= to find out from the outside world, then it is recorded")
        else:
            outcome = reconcile()
        return self.record(key, outcome).outcome


journal = Journal()


def _branch(environment: settings.Settings) -> Branch | None:
    """In copy k of clone C, the branch C-k of the journal, which sees the agent's records up
    to the checkpoint the copy was restored from (docs/design.md, "Journal"); else None. Looked
    up at each call (a stat of /proc/self/ns/pid): a checkpoint of the original restored as a
    copy carries this object in its memory, and must write in its branch from its first call."""
    found = identity.remembered.current(identity.copies_dir(environment))
    if found is None:
        return None
    return Branch.of_checkpoint(found["clone"], found["copy"], found["checkpoint"], found.get("frozen_at"))


# ---- the CKPT_SOCKET protocol ---------------------------------------------------------------

PROTOCOL_VERBS = ("JOURNAL-INTENT", "JOURNAL-RECORD", "JOURNAL-GET")


def _outcome_text(outcome: object) -> str:
    """An outcome on one line: a string as it is (unless it holds a line break), anything
    else (a Python agent's dict) as JSON."""
    if isinstance(outcome, str) and "\n" not in outcome and "\r" not in outcome:
        return outcome
    return json.dumps(outcome)


def _answer(entry: Entry | None) -> str:
    if entry is None:
        return "OK NONE"
    if entry.done:
        return f"OK DONE {_outcome_text(entry.outcome)}"
    return f"OK INTENT {entry.time}"


def handle_protocol(words: list[str], store: Store, agent: str | None) -> str:
    """One journal request of the CKPT_SOCKET protocol (`ckpt run`): `words` is the request
    line split on blanks, `store` and `agent` the supervisor's store and --name. Returns the
    answer line, without its line break:

        JOURNAL-INTENT KEY           -> OK NEW              (recorded now: do the action)
                                        OK INTENT <time>    (started before, outcome unknown: reconcile)
                                        OK DONE <outcome>   (done before: skip it)
        JOURNAL-RECORD KEY OUTCOME   -> OK DONE <outcome>   (the outcome the journal holds: the first recorded)
        JOURNAL-GET KEY              -> OK NONE | OK INTENT <time> | OK DONE <outcome>
        anything wrong               -> ERROR <reason>

    A key is one word; an outcome is the rest of the line (recorded as a string; its words
    joined by single blanks). Every write is durable before the answer is sent."""
    if not words or words[0] not in PROTOCOL_VERBS:
        return f"ERROR unknown request {words[0] if words else ''!r}; journal requests: {', '.join(PROTOCOL_VERBS)}"
    verb, args = words[0], words[1:]
    if len(args) != 1 if verb != "JOURNAL-RECORD" else len(args) < 2:
        usage = {"JOURNAL-INTENT": "JOURNAL-INTENT KEY", "JOURNAL-GET": "JOURNAL-GET KEY",
                 "JOURNAL-RECORD": "JOURNAL-RECORD KEY OUTCOME"}[verb]
        return f"ERROR usage: {usage}"
    if not agent:
        return "ERROR the journal needs the agent's name: start it with `ckpt run --name NAME`"
    try:
        records = StoreJournal(store.backend, agent)
        if verb == "JOURNAL-INTENT":
            prior = records.intent(args[0])
            return "OK NEW" if prior is None else _answer(prior)
        if verb == "JOURNAL-RECORD":
            return _answer(records.record(args[0], " ".join(args[1:])))
        return _answer(records.entry(args[0]))
    except CkptError as exc:
        return f"ERROR {exc.message}"
    except ValueError as exc:
        return f"ERROR {exc}"
