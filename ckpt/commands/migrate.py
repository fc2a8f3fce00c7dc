"""Use case: move a running tree to another host (docs/design.md, "Migration"): pre-copy
rounds of ordinary dumps through the shared store, a final --stop dump held frozen, the
destination's restore held before it runs, then the source ended, the decision recorded, and
the destination's tree let run. Fail closed: until the source is ended, any failure thaws it
and ends what the destination restored; after, the destination's tree is the only copy (and
if it dies, the checkpoint is restored at the source)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from ckpt.commands.dump import DumpRequest, DumpResult, DumpSession
from ckpt.commands.group_member import Committed, Held, LocalDumpMember, Prepared, Released
from ckpt.commands.restore import RestoreRequest
from ckpt.commands.results import JsonResult
from ckpt.errors import CkptError, MigrationFailed, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Origin, Store
from ckpt.store.password import PasswordSource
from ckpt.system import procs

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


class Destination(Protocol):
    """The destination's restore member (a RemoteMember over ssh), told its checkpoint late."""

    label: str
    checkpoint: str  # the checkpoint it restores, once known

    def connect(self) -> None:  # ssh and hello: before the freeze, so not downtime
        ...

    def prepare_checkpoint(self, checkpoint: str) -> Prepared:
        ...

    def capture(self) -> Held:
        ...

    def release(self) -> Released:
        ...

    def commit(self) -> Committed:
        ...

    def abort(self) -> None:
        ...


DestinationFactory = Callable[[Store, RestoreRequest], Destination]


def check_request(request: MigrateRequest) -> None:
    from ckpt.commands.group_remote import check_host

    if request.pid <= 0:
        raise UsageError(f"{request.pid} is not a PID", hint="give the root PID of the tree to move")
    check_host(request.to)
    if not 0 <= request.rounds <= MAX_ROUNDS:
        raise UsageError(f"--rounds {request.rounds} is out of range", hint=f"give 0 to {MAX_ROUNDS}")


def migrate(store_root: StoreLocation, request: MigrateRequest, reporter: Reporter = NullReporter(), *,
            settings: Settings, passwords: PasswordSource | None = None,
            destination: DestinationFactory | None = None) -> MigrateResult:
    """Moves the tree of request.pid to request.to through the store at store_root (which the
    destination must reach: an S3 store or a directory shared at the same path)."""
    check_request(request)
    procs.require_root()
    passwords = PasswordSource.passed_or_settings(passwords, settings)
    store = Store.open(store_root, False, settings=settings, passwords=passwords)
    far = destination or ssh_destination(settings, passwords, request, reporter)
    template = RestoreRequest(ref="", lazy=request.lazy, tcp_close=request.tcp_close, migrated=True)
    migration = _Migration(store, request, far(store, template), reporter, settings, passwords)
    migration.rehearsal = far(store, template)
    return migration.run()


def ssh_destination(settings: Settings, passwords: PasswordSource, request: MigrateRequest,
                    reporter: Reporter) -> DestinationFactory:
    from ckpt.commands.group_remote import RemoteLink, RemoteMember

    def make(store: Store, restore: RestoreRequest) -> Destination:
        link = RemoteLink.for_store(store, settings, passwords, timeout=request.phase_timeout,
                                    hold_limit=request.hold_limit)
        return RemoteDestination(RemoteMember(request.to, restore, link, reporter, label=request.to))
    return make


class RemoteDestination:
    """A RemoteMember restoring the migration's checkpoint, its agent told it is a migration's
    destination (member_agent.MigrationDestination: it reads the decision before it aborts)."""

    def __init__(self, member):
        self.member, self.label = member, member.label
        self.checkpoint = ""

    def connect(self) -> None:
        self.member.connect()

    def prepare_checkpoint(self, checkpoint: str) -> Prepared:
        self.checkpoint = checkpoint
        self.member.request = replace(self.member.request, ref=checkpoint)
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
        ended = False
        try:
            source.prepare()
            held = source.capture()  # frozen, dumped, its checkpoint committed: held in CRIU's post-dump
            phase("migrate.frozen")
            self.reporter.step(f"checkpoint {held.checkpoint} committed; restoring it on {self.request.to}")
            self.destination.prepare_checkpoint(held.checkpoint)
            self.destination.capture()
            phase("migrate.restored-held")
            ended = self._end_source(source)
        except BaseException:
            if not ended:
                source.abort()  # CRIU thaws the source: it runs on
            raise
        return self._run_destination(source, held)

    def _end_source(self, source: LocalDumpMember) -> bool:
        """CRIU ends the source tree (--stop); then the decision is recorded."""
        try:
            source.release()
        except CkptError:
            if procs.process_state(self.request.pid) not in (None, "Z", "X"):
                raise  # CRIU failed and thawed it: the source runs on
            self.reporter.warn("CRIU reported a failure after ending the source tree; the destination takes over")
        try:
            self.store.migrations.decide(source.session.checkpoint_id, socket.gethostname(), self.request.pid,
                                         self.request.to)
        except CkptError as exc:
            # The source is gone: the destination's tree runs whatever, only a coordinator that
            # dies from here on leaves none running.
            self.reporter.warn(f"the migration's decision could not be recorded ({exc.message}); going on")
        phase("migrate.decided")
        return True

    def _run_destination(self, source: LocalDumpMember, held: Held) -> MigrateResult:
        checkpoint = held.checkpoint
        try:
            released = self.destination.release()
        except CkptError as exc:
            return self._back_at_source(source, held, exc)
        downtime_ms = round((time.time() - held.frozen_at) * 1000, 1)
        phase("migrate.running")
        self.reporter.step(f"the tree runs on {self.request.to} (PID {released.pid}); it was down {downtime_ms:.0f} ms")
        committed = self.destination.commit()
        final = source.commit().result or {}
        self._forget_decision(checkpoint)
        return self._result(checkpoint, final, downtime_ms, {"host": self.request.to, "pid": released.pid},
                            committed.result or {})

    def _back_at_source(self, source: LocalDumpMember, held: Held, failure: CkptError) -> MigrateResult:
        """The destination's tree failed after the source ended: the checkpoint comes back here."""
        from ckpt.commands.restore import restore

        self.reporter.warn(f"{self.request.to} could not run the tree ({failure.message}); restoring it here")
        self.destination.abort()
        final = source.commit().result or {}
        try:
            result = restore(self.store.location, RestoreRequest(ref=held.checkpoint), self.reporter,
                             settings=self.settings, passwords=self.passwords)
        except CkptError as exc:
            raise MigrationFailed(f"the migration failed on {self.request.to} ({failure.message}) and the restore "
                                  f"here failed too ({exc.message})",
                                  hint=f"checkpoint {held.checkpoint} holds the tree: "
                                       f"'ckpt restore {held.checkpoint}'") from exc
        finally:
            self._forget_decision(held.checkpoint)
        downtime_ms = round((time.time() - held.frozen_at) * 1000, 1)
        outcome = self._result(held.checkpoint, final, downtime_ms, {"host": socket.gethostname(), "pid": result.pid},
                               result.to_json())
        outcome.restored_at_source = True
        return outcome

    def _result(self, checkpoint: str, final: dict, downtime_ms: float, destination: dict,  # noqa: PLR0913
                restored: dict) -> MigrateResult:
        return MigrateResult(
            checkpoint, {"host": socket.gethostname(), "pid": self.request.pid}, destination, self.rounds,
            {"pages": final.get("pages"), "new_pages": final.get("pages_new"),
             "bytes_new": final.get("bytes_stored"), "frozen_ms": final.get("freeze_ms")},
            downtime_ms, restored.get("lazy") is not None if restored else self.request.lazy,
            round((time.monotonic() - self.started) * 1000, 1), restored)

    def _forget_decision(self, checkpoint: str) -> None:
        try:
            self.store.migrations.forget(checkpoint)
        except CkptError as exc:
            self.reporter.warn(f"the migration's decision stays in the store ({exc.message})")

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
    passwords = PasswordSource.passed_or_settings(passwords, settings)
    store = Store.open(store_root, False, settings=settings, passwords=passwords)
    return _GroupMigration(store, request, reporter, settings, passwords, destination).run()


class _GroupMigration:
    def __init__(self, store: Store, request: MigrateGroupRequest, reporter: Reporter,  # noqa: PLR0913
                 settings: Settings, passwords: PasswordSource, destination: DestinationFactory | None):
        self.store, self.request, self.reporter = store, request, reporter
        self.settings, self.passwords = settings, passwords
        self.make = destination or _ssh_destinations(settings, passwords, request, reporter)
        # each member's pre-copy rounds, as a migration of its own would take them
        self.single = [_Migration(store, MigrateRequest(pid=pid, to=request.destination(pid), name=request.name,
                                                        rounds=request.rounds), None, reporter, settings, passwords)
                       for pid in request.members]
        self.destinations: list[Destination] = []
        self.released: list[Released] = []
        self.started = time.monotonic()

    def run(self) -> MigrateGroupResult:
        try:
            rounds = self._precopy()
            result = self._move()
        except BaseException:
            for destination in self.destinations:
                destination.abort()
            raise
        finally:
            for single in self.single:
                single._remove_rounds()
        return self._result(result, rounds)

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
        hooks = GroupDumpHooks(before_release=self._restore_held, after_release=self._let_run)
        self.reporter.step(f"reaching {', '.join(sorted({self.request.destination(p) for p in self.request.members}))}")
        return group_dump(self.store.location, dump, self.reporter, settings=self.settings,
                          passwords=self.passwords, hooks=hooks)

    def _restore_held(self, group) -> None:
        """Every member restored at its destination and held (the sources frozen)."""
        from ckpt.commands.group import Coordinator, member_connections

        phase("migrate.frozen")
        connections = member_connections(self.store, group)
        for index, member in enumerate(group.members):
            host = self.request.destination(member.pid)
            peers = [pair for i, pairs in enumerate(connections) if i != index
                     and self.request.destination(group.members[i].pid) == host for pair in pairs]
            restore = RestoreRequest(ref=member.checkpoint, lazy=self.request.lazy, tcp_close=self.request.tcp_close,
                                     migrated=True, group_peers=[[list(a), list(b)] for a, b in peers])
            self.destinations.append(self.make(self.store, restore))
        coordinator = Coordinator(self.destinations, self.request.phase_timeout, self.reporter)
        coordinator.each("reach its destination", lambda d: d.connect())
        coordinator.each("prepare its restore", lambda d: d.prepare_checkpoint(d.checkpoint))
        coordinator.each("restore", lambda d: d.capture())
        phase("migrate.restored-held")

    def _let_run(self, group) -> None:
        """Every source ended: the decisions, then every member runs at its destination."""
        from ckpt.commands.group import Coordinator

        for member in group.members:
            self.store.migrations.decide(member.checkpoint, socket.gethostname(), member.pid,
                                         self.request.destination(member.pid))
        phase("migrate.decided")
        coordinator = Coordinator(self.destinations, self.request.phase_timeout, self.reporter)
        self.released = coordinator.each("run", lambda d: d.release())
        phase("migrate.running")
        coordinator.each("finish", lambda d: d.commit())
        for member in group.members:
            self.store.migrations.forget(member.checkpoint)

    def _result(self, dumped, rounds: list[dict]) -> MigrateGroupResult:
        group = dumped.group
        first_freeze = min(m.frozen_at for m in group.members)
        last_running = max(r.released_at for r in self.released)
        members = [{"pid": m.pid, "checkpoint": m.checkpoint,
                    "destination": {"host": self.request.destination(m.pid), "pid": r.pid}}
                   for m, r in zip(group.members, self.released, strict=True)]
        return MigrateGroupResult(group.id, members, rounds, round((last_running - first_freeze) * 1000, 1),
                                  round((time.monotonic() - self.started) * 1000, 1))


def _ssh_destinations(settings: Settings, passwords: PasswordSource, request: MigrateGroupRequest,
                      reporter: Reporter) -> DestinationFactory:
    from ckpt.commands.group_remote import RemoteLink, RemoteMember

    def make(store: Store, restore: RestoreRequest) -> Destination:
        link = RemoteLink.for_store(store, settings, passwords, timeout=request.phase_timeout,
                                    hold_limit=request.hold_limit)
        pid = store.load(restore.ref).pid
        host = request.destination(pid)
        destination = RemoteDestination(RemoteMember(host, restore, link, reporter, label=f"{host}:{pid}"))
        destination.checkpoint = restore.ref
        return destination
    return make
