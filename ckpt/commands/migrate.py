"""Use case: move a running tree to another host (docs/design.md, "Migration"): pre-copy
rounds of ordinary dumps through the shared store, a final --stop dump held frozen, the
destination's restore held before it runs, then the source ended, the decision recorded, and
the destination's tree let run. Fail closed: until the source is ended, any failure thaws it
and ends what the destination restored; after, the destination's tree is the only copy (and
if it dies, the checkpoint is restored at the source)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, TypeVar

from ckpt.commands.dump import DumpRequest, DumpResult, DumpSession
from ckpt.commands.group_member import Committed, Held, LocalDumpMember, Prepared, Released
from ckpt.commands.restore import RestoreRequest
from ckpt.commands.results import JsonResult
from ckpt.errors import CkptError, GroupFailed, MemberLost, MigrationFailed, ProcessNotFound, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Origin, Store
from ckpt.store.groups import GroupManifest
from ckpt.store.password import PasswordSource
from ckpt.system import procs
from ckpt.system.signals import Deferral, deferred_interrupts

# The pre-copy stops once a round found this many pages or fewer new (P.Haul's floor), or
# this share of the tree's pages: without the kernel's dirty-page tracking every round
# freezes the tree as long as the final dump does, to save the final dump only the sending of
# what is left (measured: 256 MiB rewriting 1%/s, rounds sent 67032, 546, 231, 207 pages,
# each frozen 230-280 ms)...
PRECOPY_FLOOR_PAGES = 64
PRECOPY_FLOOR_SHARE = 0.01
# ...or found more than this share of the round before's (the rounds stopped shrinking).
PRECOPY_SHRINK = 0.9
MAX_ROUNDS = 16
# A group member's last phase (release, then commit, or its restore here) has this many phase
# timeouts: each of its steps is bounded on its own.
RUN_SLACK = 20.0
T = TypeVar("T")


@dataclass
class MigrateRequest:
    pid: int
    to: str  # the destination host, as ssh knows it
    name: str | None = None  # the checkpoints' name
    rounds: int = 4  # pre-copy rounds at most (0: the final dump alone)
    lazy: bool | None = None  # the destination's restore (None: lazy where it can be)
    tcp_close: bool | None = None  # None: established where the destination holds the address
    hold_limit: float = 60.0  # seconds the source stays frozen at most, whatever happens
    phase_timeout: float = 120.0  # seconds the destination has for each phase


@dataclass
class PrecopyRound:
    round: int
    checkpoint: str
    pages: int  # the tree's pages
    new_pages: int  # those the store lacked: what this round sent
    bytes_new: int
    frozen_ms: float | None
    duration_ms: float | None

    @classmethod
    def of(cls, number: int, result: DumpResult) -> PrecopyRound:
        stats = result.manifest.stats
        return cls(number, result.manifest.id, int(stats.get("pages") or 0), int(stats.get("pages_new") or 0),
                   result.manifest.bytes_stored, stats.get("freeze_ms"), stats.get("duration_ms"))


@dataclass
class MigrateResult(JsonResult):
    checkpoint: str  # the final checkpoint, kept
    source: dict  # host, pid
    destination: dict  # host, pid (in the destination's PID namespace)
    rounds: list[PrecopyRound]
    final: dict  # pages, new_pages, bytes_new, frozen_ms of the final dump
    downtime_ms: float  # from the final freeze to the destination's tree running
    lazy: bool | None
    duration_ms: float
    restore: dict = field(default_factory=dict)  # the destination's RestoreResult.to_json()
    restored_at_source: bool = False  # the destination failed after the source ended

    def to_json(self) -> dict:
        return {"checkpoint": self.checkpoint, "source": self.source, "destination": self.destination,
                "rounds": [vars(r) for r in self.rounds], "final": self.final, "downtime_ms": self.downtime_ms,
                "lazy": self.lazy, "duration_ms": self.duration_ms, "restore": self.restore,
                "restored_at_source": self.restored_at_source}


def precopy_done(rounds: list[PrecopyRound], limit: int) -> bool:
    """Whether the pre-copy stops after these rounds (docs/design.md, "Migration: Phases")."""
    if len(rounds) >= limit:
        return True
    if not rounds:
        return False
    last = rounds[-1].new_pages
    if last <= max(PRECOPY_FLOOR_PAGES, PRECOPY_FLOOR_SHARE * rounds[-1].pages):
        return True
    return len(rounds) >= 2 and last > PRECOPY_SHRINK * rounds[-2].new_pages


def final_stats(source: LocalDumpMember) -> dict:
    """What the final dump sent (its manifest is committed inside the hold)."""
    manifest = source.session.manifest
    stats = manifest.stats if manifest is not None else {}
    return {"pages": stats.get("pages"), "new_pages": stats.get("pages_new"),
            "bytes_new": manifest.bytes_stored if manifest is not None else None, "frozen_ms": stats.get("freeze_ms")}


def source_gone(pid: int, wait: float = 2.0) -> bool:
    """Whether a source tree's root is gone (or a zombie), waiting a little: a root CRIU has
    just killed may still be running its way out (state R or D) for a moment."""
    deadline = time.monotonic() + wait
    while procs.process_state(pid) not in (None, "Z", "X"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def decide(store: Store, checkpoint: str, pid: int, destination: str, reporter: Reporter) -> None:
    """Records that the source of checkpoint is gone. Not recorded (the store failed), the
    destination's tree runs all the same: only a coordinator that dies from here on leaves it
    to an agent that will not find the decision."""
    try:
        store.migrations.decide(checkpoint, socket.gethostname(), pid, destination)
    except CkptError as exc:
        reporter.warn(f"the move of {pid} could not be recorded ({exc.message}); going on")


def forget_decision(store: Store, checkpoint: str, reporter: Reporter) -> None:
    try:
        store.migrations.forget(checkpoint)
    except CkptError as exc:
        reporter.warn(f"the migration's decision stays in the store ({exc.message})")


def restore_here(store: Store, checkpoint: str, host: str, failure: CkptError, reporter: Reporter,  # noqa: PLR0913
                 settings: Settings, passwords: PasswordSource):
    """The checkpoint of a tree its destination could not run, restored on this host."""
    from ckpt.commands.restore import restore

    try:
        return restore(store.location, RestoreRequest(ref=checkpoint), reporter, settings=settings,
                       passwords=passwords)
    except CkptError as exc:
        raise MigrationFailed(f"the migration failed on {host} ({failure.message}) and the restore here failed "
                              f"too ({exc.message})",
                              hint=f"checkpoint {checkpoint} holds the tree: 'ckpt restore {checkpoint}'") from exc
    finally:
        forget_decision(store, checkpoint, reporter)


class Destination(Protocol):
    """The destination's restore member (a RemoteMember over ssh), told its checkpoint late."""

    label: str
    checkpoint: str  # the checkpoint it restores, once known

    def connect(self) -> None:  # ssh and hello: before the freeze, so not downtime
        ...

    def prepare_checkpoint(self, checkpoint: str, group_peers: list | None = None) -> Prepared:
        ...

    def capture(self) -> Held:
        ...

    def release(self) -> Released:
        ...

    def commit(self) -> Committed:
        ...

    def abort(self) -> None:
        ...


DestinationFactory = Callable[[Store, RestoreRequest, str], Destination]  # ..., the host


def check_request(request: MigrateRequest) -> None:
    from ckpt.commands.group_remote import check_host

    if request.pid <= 0:
        raise UsageError(f"{request.pid} is not a PID", hint="give the root PID of the tree to move")
    check_host(request.to)
    if not 0 <= request.rounds <= MAX_ROUNDS:
        raise UsageError(f"--rounds {request.rounds} is out of range", hint=f"give 0 to {MAX_ROUNDS}")


def _check_running(pid: int) -> None:
    procs.check_pid(pid)
    if procs.process_state(pid) in (None, "Z", "X"):
        raise ProcessNotFound(f"no process with PID {pid}", hint="give the root PID of a running tree ('ps -ef')")


def migrate(store_root: StoreLocation, request: MigrateRequest, reporter: Reporter = NullReporter(), *,
            settings: Settings, passwords: PasswordSource | None = None,
            destination: DestinationFactory | None = None) -> MigrateResult:
    """Moves the tree of request.pid to request.to through the store at store_root (which the
    destination must reach: an S3 store or a directory shared at the same path)."""
    check_request(request)
    procs.require_root()
    _check_running(request.pid)
    passwords = PasswordSource.passed_or_settings(passwords, settings)
    store = Store.open(store_root, True, settings=settings, passwords=passwords)  # as a dump would
    far = destination or ssh_destination(settings, passwords, request.phase_timeout, request.hold_limit, reporter)
    template = RestoreRequest(ref="", lazy=request.lazy, tcp_close=request.tcp_close, migrated=True)
    migration = _Migration(store, request, far(store, template, request.to), reporter, settings, passwords)
    migration.rehearsal = far(store, replace(template, rehearsal=True), request.to)
    return migration.run()


def ssh_destination(settings: Settings, passwords: PasswordSource, timeout: float, hold_limit: float,
                    reporter: Reporter) -> DestinationFactory:
    """Destinations reached over ssh (`ckpt _member` there), as group members on other hosts are."""
    from ckpt.commands.group_remote import RemoteLink, RemoteMember

    def make(store: Store, restore: RestoreRequest, host: str) -> Destination:
        link = RemoteLink.for_store(store, settings, passwords, timeout=timeout, hold_limit=hold_limit)
        return RemoteDestination(RemoteMember(host, restore, link, reporter, label=host))
    return make


class RemoteDestination:
    """A RemoteMember restoring the migration's checkpoint, its agent told it is a migration's
    destination (member_agent.MigrationDestination: it reads the decision before it aborts)."""

    def __init__(self, member):
        self.member, self.label = member, member.label
        self.checkpoint = ""

    def connect(self) -> None:
        self.member.connect()

    def prepare_checkpoint(self, checkpoint: str, group_peers: list | None = None) -> Prepared:
        self.checkpoint = checkpoint
        self.member.request = replace(self.member.request, ref=checkpoint, group_peers=group_peers or [])
        return self.member.prepare(extra={"migration": True})

    def capture(self) -> Held:
        return self.member.capture()

    def release(self) -> Released:
        return self.member.release()

    def commit(self) -> Committed:
        return self.member.commit()

    def abort(self) -> None:
        self.member.abort()


class _Migration:
    def __init__(self, store: Store, request: MigrateRequest, destination: Destination | None,  # noqa: PLR0913
                 reporter: Reporter, settings: Settings, passwords: PasswordSource):
        self.store, self.request, self._destination = store, request, destination
        self.reporter, self.settings, self.passwords = reporter, settings, passwords
        self.origin = Origin("migrate", request.name)
        self.started = time.monotonic()
        self.rounds: list[PrecopyRound] = []
        # A second destination member: prepares a restore of the last pre-copy checkpoint there
        # and lets it go, so that a host that cannot take the tree refuses before it is frozen.
        self.rehearsal: Destination | None = None

    @property
    def destination(self) -> Destination:
        if self._destination is None:
            raise RuntimeError("a group member's migration takes its pre-copy rounds only")
        return self._destination

    def run(self) -> MigrateResult:
        try:
            self.reporter.step(f"reaching {self.request.to}")
            self.destination.connect()
            self._precopy()
            self._rehearse()
            return self._move()
        except BaseException:
            self.destination.abort()
            raise
        finally:
            self._remove_rounds()

    def _rehearse(self) -> None:
        """The destination prepares the restore of the last pre-copy checkpoint (its images
        checked against that host, the tree's PIDs free there) and drops it: a host that lacks
        what the tree needs, or holds one of its PIDs, refuses while the tree still runs."""
        rehearsal, self.rehearsal = self.rehearsal, None
        if rehearsal is None or not self.rounds:
            return
        self.reporter.step(f"checking that {self.request.to} can restore the tree (before freezing it)")
        try:
            rehearsal.prepare_checkpoint(self.rounds[-1].checkpoint)
        finally:
            rehearsal.abort()

    def _session(self, stop: bool) -> DumpSession:
        request = DumpRequest(pid=self.request.pid, name=self.request.name, stop=stop, origin=self.origin)
        return DumpSession(self.store.location, request, self.reporter, settings=self.settings,
                           passwords=self.passwords, store=self.store)

    def _precopy(self) -> None:
        """Dumps of the running tree until the pages new to the store stop shrinking."""
        while not precopy_done(self.rounds, self.request.rounds):
            self.rounds.append(self._precopy_round())

    def _precopy_round(self) -> PrecopyRound:
        phase("migrate.precopy")
        with self._session(stop=False) as session:
            session.prepare()
            session.capture()
            session.commit()
            result = session.finish()
        done = PrecopyRound.of(len(self.rounds) + 1, result)
        self.reporter.step(f"pre-copy round {done.round} of PID {self.request.pid}: {done.new_pages} of "
                           f"{done.pages} pages new ({done.bytes_new / (1 << 20):.1f} MiB sent), "
                           f"frozen {done.frozen_ms} ms")
        return done

    def _move(self) -> MigrateResult:
        source = LocalDumpMember(self._session(stop=True), str(self.request.pid), self.request.hold_limit)
        try:
            try:
                source.prepare()
                held = source.capture()  # frozen, dumped, its checkpoint committed: held in CRIU's post-dump
                phase("migrate.frozen")
                self.reporter.step(f"checkpoint {held.checkpoint} committed; restoring it on {self.request.to}")
                self.destination.prepare_checkpoint(held.checkpoint)
                self.destination.capture()
                phase("migrate.restored-held")
                # Ending the source and recording it are one step for Ctrl-C: cut in two, neither
                # copy would run (the destination's agent ends its tree without the decision).
                with deferred_interrupts():
                    self._end_source(source)
            except BaseException:
                source.abort()  # not ended: CRIU thaws the source, which runs on; ended: its staging goes
                raise
            return self._run_destination(held, final_stats(source))
        finally:
            self._finish_source(source)

    def _end_source(self, source: LocalDumpMember) -> None:
        """CRIU ends the source tree (--stop); then the decision is recorded."""
        try:
            source.release()
        except CkptError:
            if not source_gone(self.request.pid):
                raise  # CRIU failed and thawed it: the source runs on
            self.reporter.warn("CRIU reported a failure after ending the source tree; the destination takes over")
        decide(self.store, source.session.checkpoint_id, self.request.pid, self.request.to, self.reporter)
        phase("migrate.decided")

    def _run_destination(self, held: Held, final: dict) -> MigrateResult:
        checkpoint = held.checkpoint
        try:
            released = self.destination.release()
        except MemberLost as exc:
            # The agent may have let the tree run, or may yet (it finds the decision): restoring
            # it here too could make two copies. The decision stays for the agent to read.
            raise MemberLost(f"{exc.message}; the source was ended and the move recorded: the tree runs on "
                             f"{self.request.to} once its agent sees the channel end, unless that host failed too",
                             hint=f"look on {self.request.to}; if it is not there, 'ckpt restore {checkpoint}' "
                                  "brings it back") from exc
        except CkptError as exc:  # the agent answered: its tree did not run, and it ended it
            return self._back_at_source(held, final, exc)
        downtime_ms = round((time.time() - held.frozen_at) * 1000, 1)
        phase("migrate.running")
        self.reporter.step(f"the tree runs on {self.request.to} (PID {released.pid}); it was down {downtime_ms:.0f} ms")
        try:
            restored = self.destination.commit().result or {}
        except CkptError as exc:
            self.reporter.warn(f"the tree runs on {self.request.to}, but its agent did not finish cleanly "
                               f"({exc.message})")
            restored = {}
        forget_decision(self.store, checkpoint, self.reporter)
        return self._result(checkpoint, final, downtime_ms, {"host": self.request.to, "pid": released.pid}, restored)

    def _finish_source(self, source: LocalDumpMember) -> None:
        """The final dump's own clean-up (its tree is gone, or runs on after an abort)."""
        if source.session.manifest is None or source.session.aborted:
            return
        try:
            source.commit()
        except CkptError as exc:
            self.reporter.warn(f"the final dump did not clean up after itself ({exc.message})")

    def _back_at_source(self, held: Held, final: dict, failure: CkptError) -> MigrateResult:
        """The destination's tree failed after the source ended: the checkpoint comes back here."""
        self.reporter.warn(f"{self.request.to} could not run the tree ({failure.message}); restoring it here")
        self.destination.abort()
        result = restore_here(self.store, held.checkpoint, self.request.to, failure, self.reporter, self.settings,
                              self.passwords)
        downtime_ms = round((time.time() - held.frozen_at) * 1000, 1)
        outcome = self._result(held.checkpoint, final, downtime_ms, {"host": socket.gethostname(), "pid": result.pid},
                               result.to_json())
        outcome.restored_at_source = True
        return outcome

    def _result(self, checkpoint: str, final: dict, downtime_ms: float, destination: dict,  # noqa: PLR0913
                restored: dict) -> MigrateResult:
        return MigrateResult(
            checkpoint, {"host": socket.gethostname(), "pid": self.request.pid}, destination, self.rounds, final,
            downtime_ms, restored.get("lazy") is not None if restored else self.request.lazy,
            round((time.monotonic() - self.started) * 1000, 1), restored)

    def _remove_rounds(self) -> None:
        """The pre-copy checkpoints: their pages are the final checkpoint's too (or, after a
        failure, were only there to be sent early). Under the shared lock: they are this
        migration's own, and no other command has a reason to read them."""
        if not self.rounds:
            return
        try:
            with self.store.lock(exclusive=False):
                self.store.remove([r.checkpoint for r in self.rounds])
        except CkptError as exc:
            self.reporter.warn(f"the pre-copy checkpoints stay ({exc.message}): 'ckpt rm' removes them")


# ---- a group --------------------------------------------------------------------------------


@dataclass
class MigrateGroupRequest:
    members: list[int]  # root PIDs on this host
    to: str  # the destination of every member not in places
    places: dict[int, str] = field(default_factory=dict)  # member PID -> its own destination
    name: str | None = None  # the group's name
    rounds: int = 4
    lazy: bool | None = None
    tcp_close: bool | None = None
    hold_limit: float = 60.0
    phase_timeout: float = 120.0

    def destination(self, pid: int) -> str:
        return self.places.get(pid, self.to)

    @classmethod
    def like(cls, one: MigrateRequest, members: list[int], places: dict[int, str]) -> MigrateGroupRequest:
        """The group's request with the options of a single one (the CLI's)."""
        return cls(members=members, to=one.to, places=places, name=one.name, rounds=one.rounds, lazy=one.lazy,
                   tcp_close=one.tcp_close, hold_limit=one.hold_limit, phase_timeout=one.phase_timeout)


@dataclass
class MigrateGroupResult(JsonResult):
    group: str  # the final group checkpoint, kept
    members: list[dict]  # pid, checkpoint, destination {host, pid}
    rounds: list[dict]  # round, pages, new_pages, bytes_new (every member's)
    downtime_ms: float  # from the first member's freeze to the last member running on its host
    duration_ms: float

    def to_json(self) -> dict:
        return {"group": self.group, "members": self.members, "rounds": self.rounds,
                "downtime_ms": self.downtime_ms, "duration_ms": self.duration_ms}


def migrate_group(store_root: StoreLocation, request: MigrateGroupRequest, reporter: Reporter = NullReporter(), *,
                  settings: Settings, passwords: PasswordSource | None = None,
                  destination: DestinationFactory | None = None) -> MigrateGroupResult:
    """Moves every member of a group, each to its host, as one consistent cut: pre-copy rounds
    of every member, then a --stop group dump whose members are restored held at their
    destinations before any source is ended (docs/design.md, "Migration")."""
    from ckpt.commands.group_remote import check_host

    for pid in request.members:
        check_request(MigrateRequest(pid=pid, to=request.destination(pid), rounds=request.rounds))
    for host in request.places.values():
        check_host(host)
    procs.require_root()
    for pid in request.members:
        _check_running(pid)
    passwords = PasswordSource.passed_or_settings(passwords, settings)
    store = Store.open(store_root, True, settings=settings, passwords=passwords)  # as a dump would
    return _GroupMigration(store, request, reporter, settings, passwords, destination).run()


class _GroupMigration:
    """A group's migration: its members' pre-copy rounds, then a --stop group dump whose hooks
    restore every member held at its destination (before_release) and, once every source is
    ended, record the decisions and let the destinations run (after_release)."""

    def __init__(self, store: Store, request: MigrateGroupRequest, reporter: Reporter,  # noqa: PLR0913
                 settings: Settings, passwords: PasswordSource, destination: DestinationFactory | None):
        self.store, self.request, self.reporter = store, request, reporter
        self.settings, self.passwords = settings, passwords
        make = destination or ssh_destination(settings, passwords, request.phase_timeout, request.hold_limit,
                                              reporter)
        template = RestoreRequest(ref="", lazy=request.lazy, tcp_close=request.tcp_close, migrated=True)
        self.destinations = [make(store, template, request.destination(pid)) for pid in request.members]
        # each member's pre-copy rounds, as a migration of its own would take them
        self.single = [_Migration(store, MigrateRequest(pid=pid, to=request.destination(pid), name=request.name,
                                                        rounds=request.rounds), None, reporter, settings, passwords)
                       for pid in request.members]
        self.group: GroupManifest | None = None  # committed, every source held
        self.outcomes: list[dict] = [{} for _ in request.members]  # per member: released, restored here
        self.deferral: Deferral | None = None  # the interrupts deferred through the sources' end
        self.started = time.monotonic()

    def run(self) -> MigrateGroupResult:
        try:
            self._each("reach its destination", lambda d: d.connect())
            rounds = self._precopy()
            dumped = self._move()
        except CkptError as exc:
            self._settle()
            raise GroupFailed(f"the group's migration failed: {exc.message} ({self._fates()})",
                              hint=exc.hint if self.group is None else "ckpt list shows the group's checkpoint",
                              exit_code=int(exc.exit_code)) from exc
        except BaseException:
            self._settle()
            raise
        finally:
            for single in self.single:
                single._remove_rounds()
        lost = [(pid, o["lost"]) for pid, o in zip(self.request.members, self.outcomes, strict=True) if "lost" in o]
        if lost:
            raise MemberLost(f"the group's sources were ended, but the channel to {len(lost)} destination(s) was "
                             f"lost: {'; '.join(f'{pid}: {why}' for pid, why in lost)} ({self._fates()})",
                             hint="each such tree runs there once its agent sees the channel end; look there")
        return self._result(dumped.group, rounds)

    def _each(self, what: str, step: Callable[[Destination], T], slack: float = 1.0) -> list[T]:
        from ckpt.commands.group import Coordinator

        return Coordinator(self.destinations, self.request.phase_timeout, self.reporter).each(what, step, slack)

    def _precopy(self) -> list[dict]:
        """Rounds of every member, one after the other, until their sum stops shrinking."""
        sums: list[PrecopyRound] = []
        while not precopy_done(sums, self.request.rounds):
            done = []
            for single in self.single:
                single.rounds.append(single._precopy_round())
                done.append(single.rounds[-1])
            sums.append(PrecopyRound(len(sums) + 1, "", sum(r.pages for r in done), sum(r.new_pages for r in done),
                                     sum(r.bytes_new for r in done), max(r.frozen_ms or 0.0 for r in done), None))
        return [{"round": r.round, "pages": r.pages, "new_pages": r.new_pages, "bytes_new": r.bytes_new,
                 "frozen_ms": r.frozen_ms} for r in sums]

    def _move(self):
        from ckpt.commands.group import GroupDumpHooks, GroupDumpRequest, group_dump

        dump = GroupDumpRequest(members=[str(pid) for pid in self.request.members], name=self.request.name,
                                stop=True, hold_limit=self.request.hold_limit,
                                phase_timeout=self.request.phase_timeout, origin=Origin("migrate", self.request.name))
        hooks = GroupDumpHooks(before_release=self._restore_held, after_release=self._let_run,
                               around_release=self._deferred)
        return group_dump(self.store.location, dump, self.reporter, settings=self.settings,
                          passwords=self.passwords, hooks=hooks)

    def _restore_held(self, group: GroupManifest) -> None:
        """Every member restored at its destination and held (the sources frozen)."""
        from ckpt.commands.group import member_connections

        self.group = group
        phase("migrate.frozen")
        connections = member_connections(self.store, group)
        hosts = [self.request.destination(m.pid) for m in group.members]
        peers = [[[list(a), list(b)] for i, pairs in enumerate(connections) if i != index and hosts[i] == hosts[index]
                  for a, b in pairs] for index in range(len(group.members))]
        self._each("prepare its restore", lambda d: d.prepare_checkpoint(
            group.members[self.destinations.index(d)].checkpoint, peers[self.destinations.index(d)]))
        self._each("restore", lambda d: d.capture())
        phase("migrate.restored-held")

    @contextmanager
    def _deferred(self) -> Iterator[None]:
        """Ctrl-C deferred from the sources' release until every decision is written (then the
        agents have what they need to run the trees, whatever happens to this process)."""
        with deferred_interrupts() as deferral:
            self.deferral = deferral
            yield

    def _let_run(self, group: GroupManifest) -> None:
        """Every source ended: the decisions, then every member runs at its destination."""
        for index, member in enumerate(group.members):
            decide(self.store, member.checkpoint, member.pid, self.request.destination(member.pid), self.reporter)
            self.outcomes[index]["decided"] = True
        phase("migrate.decided")
        if self.deferral is not None:
            self.deferral.end()  # an interrupt noted meanwhile is raised here
        # each member's steps are bounded on their own (release, commit; a restore here)
        self._each("run", self._run_one, slack=RUN_SLACK)
        phase("migrate.running")

    def _run_one(self, destination: Destination) -> None:
        """One member's destination let run and finished; its failure handled for it alone."""
        index = self.destinations.index(destination)
        member, outcome = self._members()[index], self.outcomes[index]
        outcome["busy"] = True  # _settle leaves it alone while this runs
        try:
            outcome["released"] = destination.release()
        except MemberLost as exc:
            outcome["lost"] = exc.message  # the agent may let it run yet: not restored here
            self.reporter.warn(f"member {member.pid}: {exc.message}; its tree runs on {destination.label} once its "
                               f"agent sees the channel end (else 'ckpt restore {member.checkpoint}')")
            return
        except CkptError as exc:
            outcome["failed"] = member.checkpoint
            outcome["here"] = restore_here(self.store, member.checkpoint, destination.label, exc, self.reporter,
                                           self.settings, self.passwords)
            return
        finally:
            outcome["busy"] = False
        try:
            destination.commit()
        except CkptError as exc:
            self.reporter.warn(f"member {member.pid} runs on {destination.label}, but its agent did not finish "
                               f"cleanly ({exc.message})")
        forget_decision(self.store, member.checkpoint, self.reporter)

    def _members(self) -> list:
        if self.group is None:
            raise RuntimeError("no group yet")
        return self.group.members

    def _settle(self) -> None:
        """After a failure: a member whose source is gone has its destination decided and let
        run (or finished); one whose source runs on has its destination ended. Each member on
        its own, Ctrl-C deferred: one left undecided with its source gone would run nowhere."""
        with deferred_interrupts():
            for index, destination in enumerate(self.destinations):
                outcome = self.outcomes[index]
                if outcome.get("busy") or {"released", "here", "lost", "failed"} & outcome.keys():
                    continue
                try:
                    self._settle_one(index, destination)
                except Exception as exc:  # noqa: BLE001 (the other members must be settled all the same)
                    self.reporter.warn(f"member {self.request.members[index]} could not be settled: {exc}")

    def _settle_one(self, index: int, destination: Destination) -> None:
        pid = self.request.members[index]
        if self.group is not None and not self.outcomes[index].get("decided") and source_gone(pid):
            decide(self.store, self._members()[index].checkpoint, pid, destination.label, self.reporter)
        # aborted after its decision, the agent lets the tree run; without one, it ends it
        destination.abort()

    def _fates(self) -> str:
        """Where each member is left after a failure: its source runs on, or its destination has it."""
        fates = []
        for pid, destination in zip(self.request.members, self.destinations, strict=True):
            outcome = self.outcomes[self.request.members.index(pid)]
            if "failed" in outcome and "here" not in outcome:
                fates.append(f"{pid} runs nowhere: 'ckpt restore {outcome['failed']}'")
            elif procs.process_state(pid) not in (None, "Z", "X"):
                fates.append(f"{pid} runs on here")
            else:
                fates.append(f"{pid} is left to {destination.label}")
        return "; ".join(fates)

    def _result(self, group: GroupManifest, rounds: list[dict]) -> MigrateGroupResult:
        first_freeze = min(m.frozen_at for m in group.members)
        members, last_running = [], first_freeze
        for member, outcome, destination in zip(group.members, self.outcomes, self.destinations, strict=True):
            row: dict = {"pid": member.pid, "checkpoint": member.checkpoint,
                         "destination": {"host": destination.label, "pid": None}}
            if "released" in outcome:
                row["destination"] = {"host": destination.label, "pid": outcome["released"].pid}
                last_running = max(last_running, outcome["released"].released_at)
            elif "here" in outcome:
                row["destination"] = {"host": socket.gethostname(), "pid": outcome["here"].pid}
                row["restored_at_source"] = True
            else:
                row["lost"] = outcome.get("lost")
            members.append(row)
        return MigrateGroupResult(group.id, members, rounds, round((last_running - first_freeze) * 1000, 1),
                                  round((time.monotonic() - self.started) * 1000, 1))
