"""Use case: a group checkpoint, one consistent checkpoint of several process trees, and its
restore (docs/design.md, "Groups": the format, the protocol, why the cut is consistent).

The coordinator drives every member through the phases of ckpt/commands/group_member.py,
never through a member's insides: a member of this host is a DumpSession or RestoreSession
here, one of another host a RemoteMember (ckpt/commands/group_remote.py) that a
member_factory supplies. It fails closed: any failure or timeout of any member before the
group's commit point aborts every member (every dumped tree runs on, thawed; no restored tree
runs), and nothing is visible, since a member checkpoint without its group manifest is
unfinished.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from ckpt.commands.group_member import (Committed, Held, LocalDumpMember, LocalRestoreMember, Member, MemberSpec,
                                        Prepared, Released, member_request, parse_member)
from ckpt.commands.results import JsonResult
from ckpt.errors import CheckpointNotFound, CkptError, GroupFailed, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, PrefixedReporter, Reporter
from ckpt.restore.netlock import ConnectionLock, Pair, locked_connections
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Origin, Store, ids
from ckpt.store.groups import GroupManifest, GroupMember, skew_stats
from ckpt.store.password import PasswordSource

T = TypeVar("T")


class _Driven(Protocol):
    label: str

    def abort(self) -> None:
        ...


Driven = TypeVar("Driven", bound=_Driven)  # a Member, or a migration's Destination
HOLD_MARGIN = 0.8  # --stop: the share of the hold limit a member may have been held before the group commit
COMMIT_SLACK = 10.0  # the commit phase (storing each member's images) has this many phase timeouts
MemberFactory = Callable[[MemberSpec], Member]


@dataclass
class GroupDumpRequest:
    members: list[str]  # "PID" (this host) or "HOST:PID"
    name: str | None = None
    stop: bool = False
    hold_limit: float = 60.0  # seconds a member holds its tree frozen without a release
    phase_timeout: float = 120.0  # seconds every member has for each phase
    origin: Origin = Origin("dump")


@dataclass
class GroupRestoreRequest:
    ref: str  # the group's ID, a unique prefix of one, or its name (the newest)
    tcp_close: bool | None = None  # for connections to outside the group (RestoreRequest.tcp_close)
    lazy: bool | None = None
    output: str | None = None
    hold_limit: float = 60.0
    phase_timeout: float = 120.0
    # --on FROM=TO: the members taken on host FROM restored on host TO ("" = the coordinator's)
    on: dict[str, str] = field(default_factory=dict)


@dataclass
class GroupDumpResult(JsonResult):
    group: GroupManifest
    members: list[dict]  # each member's dump result (DumpResult.to_json())

    def to_json(self) -> dict:
        return {**self.group.to_json(), "member_results": self.members}


@dataclass
class GroupRestoreResult(JsonResult):
    group: GroupManifest
    # per member: label, checkpoint, pid, restore started (frozen_at), held_at, released_at
    members: list[dict]
    stats: dict = field(default_factory=dict)  # release_skew_ms: the first release to the last
    results: list[dict] = field(default_factory=list)  # each member's RestoreResult.to_json()

    def to_json(self) -> dict:
        return {"id": self.group.id, "name": self.group.name, "members": self.members, "stats": self.stats,
                "member_results": self.results}


def local_member_factory(store_root: StoreLocation, reporter: Reporter, *, settings: Settings,
                         passwords: PasswordSource | None, restore: bool = False) -> MemberFactory:
    """Makes the members of this host: a DumpSession (restore: RestoreSession) each. A HOST:PID
    member is refused: members on other hosts need a factory that reaches them."""
    from ckpt.commands.dump import DumpSession
    from ckpt.commands.restore import RestoreRequest, RestoreSession

    def make(spec: MemberSpec) -> Member:
        if spec.host:
            raise UsageError(f"group member {spec.label} is on another host, which this ckpt cannot reach yet",
                             hint="give the PIDs of this host's members only")
        told = PrefixedReporter(reporter, f"[{spec.label}] ")
        request = member_request(spec, restore)
        if isinstance(request, RestoreRequest):
            return LocalRestoreMember(RestoreSession(store_root, request, told, settings=settings,
                                                     passwords=passwords), spec.label, spec.hold_limit)
        return LocalDumpMember(DumpSession(store_root, request, told, settings=settings, passwords=passwords),
                               spec.label, spec.hold_limit)

    return make


# ---- the coordinator ------------------------------------------------------------------------


class Coordinator(Generic[Driven]):
    """Drives members phase by phase, all at once (one thread each), every phase bounded by
    phase_timeout; abort_all() ends the group from any phase. Each member's last report of
    each phase is kept in the object."""

    def __init__(self, members: list[Driven], phase_timeout: float, reporter: Reporter):
        self.members, self.phase_timeout, self.reporter = members, phase_timeout, reporter

    def each(self, what: str, step: Callable[[Driven], T], slack: float = 1.0) -> list[T]:
        """step(member) for every member at once; returns their answers in the members' order.
        The first failure, or a member still working after phase_timeout (times slack),
        raises GroupFailed (after every other member's step has ended or timed out)."""
        answers: dict[int, T] = {}
        failures: dict[int, BaseException] = {}

        def run(index: int, member: Driven) -> None:
            try:
                answers[index] = step(member)
            except BaseException as exc:  # noqa: BLE001 (handed to the coordinator's thread)
                failures[index] = exc

        threads = [threading.Thread(target=run, args=(i, m), name=f"ckpt-member-{m.label}", daemon=True)
                   for i, m in enumerate(self.members)]
        for thread in threads:
            thread.start()
        timeout = self.phase_timeout * slack
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [m.label for m, t in zip(self.members, threads, strict=True) if t.is_alive()]
        if failures:
            index = min(failures)
            raise _member_failed(self.members[index].label, what, failures[index])
        if late:
            raise GroupFailed(f"member {', '.join(late)} did not {what} within {timeout:g} s",
                              hint="the group was aborted: nothing was committed (--timeout gives more time)")
        return [answers[i] for i in range(len(self.members))]

    def abort_all(self) -> None:
        """Every member aborted at once (a held tree thawed, or ended when restored); a member
        whose abort fails is told of, the others are aborted all the same."""
        def abort(member: Driven) -> None:
            member.abort()

        try:
            self.each("abort", abort)
        except GroupFailed as exc:
            self.reporter.warn(f"{exc.message}")


def _member_failed(label: str, what: str, exc: BaseException) -> BaseException:
    if isinstance(exc, CkptError):
        failed = GroupFailed(f"member {label} failed to {what}: {exc.message}",
                             hint=exc.hint, exit_code=int(exc.exit_code))
        failed.__cause__ = exc
        return failed
    return exc  # an interruption, or a bug: as it is


# ---- group dump -----------------------------------------------------------------------------


def read_members_file(path: Path) -> list[str]:
    """A group file: one member a line ("PID" or "HOST:PID"), blank lines and '#' comments
    skipped, so that a group of many members across hosts is written down once."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read the group file {path}: {exc.strerror}",
                         hint="give a file of members, one PID or HOST:PID a line") from None
    members = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    members = [member for member in members if member]
    for number, member in enumerate(members, 1):
        try:
            parse_member(member)
        except UsageError as exc:
            raise UsageError(f"{path}: member {number}: {exc.message}", hint=exc.hint) from None
    if not members:
        raise UsageError(f"the group file {path} names no member", hint="one PID or HOST:PID a line")
    return members


def member_specs(request: GroupDumpRequest, group_id: str) -> list[MemberSpec]:
    """The members as the user named them, each once."""
    if not request.members:
        raise UsageError("a group needs at least one member", hint="give the PIDs of its trees")
    specs, seen = [], set()
    for text in request.members:
        host, pid = parse_member(text)
        if (host, pid) in seen:
            raise UsageError(f"member {text} is named twice")
        seen.add((host, pid))
        specs.append(MemberSpec(label=text, host=host, pid=pid, group={"id": group_id, "name": request.name},
                                stop=request.stop, hold_limit=request.hold_limit, origin=request.origin))
    return specs


@dataclass
class GroupDumpHooks:
    """What a migration does between the phases of a --stop group dump (ckpt/commands/migrate.py):
    before_release(group) once the group is committed and every member still holds its tree
    frozen (restore the members elsewhere, held; raising aborts every member: the trees thaw),
    after_release(group) once every tree is ended (let the restored copies run)."""

    before_release: Callable[[GroupManifest], None] | None = None
    after_release: Callable[[GroupManifest], None] | None = None
    # Around the release and after_release: the migration's deferral of Ctrl-C (ending the
    # sources and recording it are one step for it).
    around_release: Callable[[], AbstractContextManager[object]] = nullcontext


def group_dump(store_root: StoreLocation, request: GroupDumpRequest, reporter: Reporter = NullReporter(), *,
               settings: Settings, passwords: PasswordSource | None = None,
               member_factory: MemberFactory | None = None, hooks: GroupDumpHooks | None = None) -> GroupDumpResult:
    """Takes one consistent checkpoint of every member (docs/design.md, "Groups: the protocol"):
    every member prepared, then every one frozen and dumped and held, then (once every one is
    held) every one let go, then every member's checkpoint committed, then the group manifest,
    last. With --stop each member's checkpoint is committed inside its hold, and the group
    manifest before any member is let go (and ended). Any failure before the group manifest
    aborts every member: the trees run on, and no group or member checkpoint is visible.
    member_factory makes each member (default: this host's; HOST:PID members refused)."""
    if request.name is not None:
        ids.check_name(request.name)
    if not request.hold_limit > 0 or not request.phase_timeout > 0:
        raise UsageError("the hold limit and the phase timeout must be more than 0 seconds")
    group_id = ids.new_id()
    specs = member_specs(request, group_id)
    store = Store.open(store_root, True, settings=settings, passwords=passwords)
    factory = member_factory or local_member_factory(store_root, reporter, settings=settings, passwords=passwords)
    # The shared lock from before the first member commits to after the group manifest: a
    # prune never takes the unfinished members of a group dump in progress for leftovers.
    with store.lock(exclusive=False, on_wait=lambda holders: reporter.info("waiting for the store lock")):
        return _GroupDump(store, request, group_id, specs, factory, reporter, hooks or GroupDumpHooks()).run()


class _GroupDump:
    """One group dump's state, phase by phase (group_dump() says the order)."""

    def __init__(self, store: Store, request: GroupDumpRequest, group_id: str, specs: list[MemberSpec],  # noqa: PLR0913
                 factory: MemberFactory, reporter: Reporter, hooks: GroupDumpHooks):
        self.store, self.request, self.group_id, self.specs = store, request, group_id, specs
        self.factory, self.reporter, self.hooks = factory, reporter, hooks
        self.prepared: list[Prepared] = []
        self.held: list[Held] = []
        self.released: list[Released] = []
        self.committed: list[Committed] = []
        self.group: GroupManifest | None = None
        self.first_held = 0.0  # time.monotonic() when the first member answered held

    def run(self) -> GroupDumpResult:
        members: list[Member] = []
        coordinator = Coordinator(members, self.request.phase_timeout, self.reporter)
        try:
            members.extend(self.factory(spec) for spec in self.specs)
            self._freeze_all(coordinator)
            if self.request.stop:
                self._still_held()
                self._commit_group()  # before any tree is let go: none is ended unless the group exists
                self._before_release(coordinator)
            self.reporter.step(f"letting {len(members)} member(s) go")
            with self.hooks.around_release():
                self.released = coordinator.each("let its tree go", lambda m: m.release())
                phase("group.released")
                if self.hooks.after_release is not None and self.group is not None:
                    self.hooks.after_release(self.group)
            self.reporter.step("committing each member's checkpoint")
            # Storing a large tree's memory takes longer than a freeze; the trees run meanwhile.
            self.committed = coordinator.each("commit", lambda m: m.commit(), slack=COMMIT_SLACK)
            phase("group.members-committed")
            if not self.request.stop:
                self._commit_group()
        except BaseException as exc:
            if self.group is None:
                coordinator.abort_all()
                raise
            if not isinstance(exc, CkptError):
                raise
            raise GroupFailed(f"group checkpoint {self.group.id} is committed, but {exc.message}",
                              hint="the group can be restored; a member whose tree was not ended (--stop) still "
                                   "runs: end it before restoring", exit_code=int(exc.exit_code)) from exc
        return GroupDumpResult(self._final_group(), [c.result or {} for c in self.committed])

    def _before_release(self, coordinator: Coordinator) -> None:
        """The migration's hook: its failure lets every tree go (thawed), the group committed."""
        if self.hooks.before_release is None or self.group is None:
            return
        try:
            self.hooks.before_release(self.group)
            self._still_held()  # the hook took time: a member that let its tree go would run on
        except BaseException:
            coordinator.abort_all()
            raise

    def _freeze_all(self, coordinator: Coordinator) -> None:
        count = len(coordinator.members)
        self.reporter.step(f"preparing {count} member(s)")
        self.prepared = coordinator.each("prepare", lambda m: m.prepare())
        _warn_of_unix_connections(self.specs, self.prepared, self.reporter)
        phase("group.prepared")
        self.reporter.step(f"freezing and dumping {count} member(s)")
        answers = coordinator.each("freeze and dump", lambda m: (m.capture(), time.monotonic()))
        self.held = [held for held, _ in answers]
        self.first_held = min(when for _, when in answers)
        phase("group.held")

    def _still_held(self) -> None:
        """--stop: every member must still hold its tree when the group is committed, or one
        that let its tree go at its hold limit would run on beside a committed group whose
        other members are ended. A member held for most of the limit already fails the group."""
        held_for = time.monotonic() - self.first_held
        if held_for > self.request.hold_limit * HOLD_MARGIN:
            raise GroupFailed(f"a member was held frozen {held_for:.0f} s while the others were dumped, too close to "
                              f"the hold limit ({self.request.hold_limit:g} s) to commit the group",
                              hint="nothing was committed and every tree runs on; --hold-limit gives more time")

    def _commit_group(self) -> None:
        """The group's commit point. With --stop every member is still held (thawed_at: now,
        when the group is committed and the members are let go); otherwise every member ran on
        and committed its checkpoint already."""
        now = time.time()
        checkpoints = ([h.checkpoint for h in self.held] if self.request.stop
                       else [c.checkpoint for c in self.committed])
        members = [self._member(i, checkpoints[i], now) for i in range(len(self.specs))]
        group = GroupManifest(id=self.group_id, created=datetime.now(timezone.utc).isoformat(), members=members,
                              name=self.request.name, origin=self.request.origin, stopped=self.request.stop,
                              stats=skew_stats(members))
        self.store.check_lock("the group manifest is written")
        self.store.groups.commit(group)
        self.group = group
        self.reporter.info(f"group checkpoint {group.id} committed")

    def _member(self, index: int, checkpoint: str, now: float) -> GroupMember:
        spec, prepared, held = self.specs[index], self.prepared[index], self.held[index]
        released = self.released[index].released_at if self.released else now
        freeze_ms = self.committed[index].freeze_ms if self.committed else held.freeze_ms
        return GroupMember(checkpoint=checkpoint, pid=spec.pid, command=prepared.command, host=spec.host,
                           hostname=prepared.hostname, frozen_at=held.frozen_at, dumped_at=held.held_at,
                           thawed_at=released, freeze_ms=freeze_ms)

    def _final_group(self) -> GroupManifest:
        """What the result shows: with --stop, the thaw (end) times as they were, not as recorded."""
        if self.group is None:
            raise RuntimeError("the group was not committed")
        if not self.request.stop:
            return self.group
        members = [replace(m, thawed_at=r.released_at) for m, r in zip(self.group.members, self.released, strict=True)]
        return replace(self.group, members=members, stats=skew_stats(members))


def _warn_of_unix_connections(specs: list[MemberSpec], prepared: list[Prepared], reporter: Reporter) -> None:
    """CRIU cannot dump one end of a UNIX stream connection whose other end is in another dump:
    each member's end is dumped as a connection to outside its tree, and a restore connects
    each end to a file instead (README, "Groups"). Said once for each pair of members."""
    ends = {}
    for spec, report in zip(specs, prepared, strict=True):
        for inode, _ in report.unix_connections:
            ends[(report.hostname, inode)] = spec.label
    told = set()
    for spec, report in zip(specs, prepared, strict=True):
        for _, peer in report.unix_connections:
            other = ends.get((report.hostname, peer))
            if other is not None and other != spec.label and (other, spec.label) not in told:
                told.add((spec.label, other))
                reporter.warn(f"members {spec.label} and {other} are connected by a UNIX stream socket: it is not "
                              "restored (after a restore each end writes into a file); use TCP on 127.0.0.1 "
                              "between members, or make them one tree")


# ---- group restore --------------------------------------------------------------------------


def existing_store(store_root: StoreLocation, *, settings: Settings,
                   passwords: PasswordSource | None = None) -> Store | None:
    """The store at store_root, opened (an encrypted one unlocked), or None where there is
    none: then the command's own opening says so, in its words."""
    from ckpt.errors import StoreNotFound

    try:
        return Store.open(store_root, False, settings=settings, passwords=passwords)
    except StoreNotFound:
        return None


def named_group(store: Store | None, ref: str) -> str | None:
    """The group ref names in the store (its ID, a prefix of one, its name), or None: then ref
    may name a checkpoint. A missing store (None) names no group."""
    return store.resolve_group(ref) if store is not None else None


def group_restore(store_root: StoreLocation, request: GroupRestoreRequest, reporter: Reporter = NullReporter(), *,
                  settings: Settings, passwords: PasswordSource | None = None,
                  member_factory: MemberFactory | None = None) -> GroupRestoreResult:
    """Restores every member of a group: every one prepared, then restored and held (none
    runs), then, once every one is back, every one let run, then finished. Connections between
    members come back established. Any failure before every member runs ends every member
    restored so far: none of them ran."""
    store = Store.open(store_root, False, settings=settings, passwords=passwords)
    with store.lock(exclusive=False, on_wait=lambda holders: reporter.info("waiting for the store lock")):
        group_id = store.resolve_group(request.ref)
        if group_id is None:
            raise CheckpointNotFound(f"no group checkpoint '{request.ref}'", hint="see 'ckpt list'")
        group = store.groups.load(group_id)
        connections = member_connections(store, group)
        hosts = placements(group, request.on)
        specs = restore_specs(group, connections, request, hosts)
        factory = member_factory or local_member_factory(store_root, reporter, settings=settings,
                                                         passwords=passwords, restore=True)
        between = _between_members(group, connections, hosts)
        with locked_connections(group.id, between, reporter) as lock:
            return _restore_members(group, specs, factory, request, reporter, lock)


def placements(group: GroupManifest, on: dict[str, str]) -> list[str]:
    """Where each member is restored: the host it was taken on, or where --on sends it."""
    recorded = {member.host for member in group.members}
    for source in on:
        if source not in recorded:
            raise UsageError(f"--on {source}=...: no member of group {group.id} was taken on {source}",
                             hint="the hosts of its members: " + ", ".join(sorted(h or "(here)" for h in recorded)))
    return [on.get(member.host, member.host) for member in group.members]


def _between_members(group: GroupManifest, connections: list[list[Pair]], hosts: list[str]) -> list[Pair]:
    """The connections of the members restored on this host where they were taken whose peer
    is another member (a connection is recorded by both of its ends: once here). A member
    moved (--on) comes back with its connections closed: nothing of it to lock."""
    local = [pairs for member, pairs, host in zip(group.members, connections, hosts, strict=True)
             if not member.host and not host]
    ends = {pair for pairs in local for pair in pairs}
    return sorted(pair for pair in ends if (pair[1], pair[0]) in ends and pair < (pair[1], pair[0]))


def member_connections(store: Store, group: GroupManifest) -> list[list[Pair]]:
    """Each member's TCP connections, as its dump recorded them (none in older checkpoints)."""
    connections = []
    for member in group.members:
        recorded = store.load(member.checkpoint).criu.get("tcp_connections", [])
        connections.append([((c["local"][0], int(c["local"][1])), (c["remote"][0], int(c["remote"][1])))
                            for c in recorded])
    return connections


def restore_specs(group: GroupManifest, connections: list[list[Pair]], request: GroupRestoreRequest,
                  hosts: list[str]) -> list[MemberSpec]:
    """Each member to restore, where hosts places it, with the TCP connections of the others
    (its intra-group peers). A member moved to another host (--on) comes back with its
    connections closed (its addresses are another machine's), so neither it nor its peers
    count it among the members whose connections come back established."""
    stays = [host == member.host for member, host in zip(group.members, hosts, strict=True)]
    specs = []
    for index, member in enumerate(group.members):
        others = tuple(pair for i, pairs in enumerate(connections) if i != index and stays[i] and stays[index]
                       for pair in pairs)
        specs.append(MemberSpec(label=f"{hosts[index]}:{member.pid}" if hosts[index] else str(member.pid),
                                host=hosts[index], pid=member.pid, checkpoint=member.checkpoint,
                                hold_limit=request.hold_limit, group_peers=others, tcp_close=request.tcp_close,
                                lazy=request.lazy, output=request.output))
    return specs


def _restore_members(group: GroupManifest, specs: list[MemberSpec], factory: MemberFactory,  # noqa: PLR0913
                     request: GroupRestoreRequest, reporter: Reporter, lock: ConnectionLock) -> GroupRestoreResult:
    members: list[Member] = []
    coordinator = Coordinator(members, request.phase_timeout, reporter)
    running = False
    try:
        members.extend(factory(spec) for spec in specs)
        reporter.step(f"preparing {len(members)} member(s) of group {group.id}")
        coordinator.each("prepare", lambda m: m.prepare())
        reporter.step(f"restoring {len(members)} member(s)")
        held = coordinator.each("restore", lambda m: m.capture())
        # Every member's sockets exist again, in repair mode (nothing is sent): the connections
        # between members may flow as soon as CRIU lets the members run.
        lock.lift()
        released = coordinator.each("run", lambda m: m.release())
        running = True
        committed = coordinator.each("finish", lambda m: m.commit())
    except BaseException:
        if not running:
            coordinator.abort_all()
        raise
    rows = [{"label": s.label, "checkpoint": s.checkpoint, "pid": r.pid, "frozen_at": h.frozen_at,
             "held_at": h.held_at, "released_at": r.released_at} for s, h, r in zip(specs, held, released, strict=True)]
    times = [r.released_at for r in released]
    return GroupRestoreResult(group, rows, {"release_skew_ms": round((max(times) - min(times)) * 1000, 1)},
                              [c.result or {} for c in committed])
