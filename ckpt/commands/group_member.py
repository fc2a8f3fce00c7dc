"""What a group coordinator (ckpt/commands/group.py) asks of each member of a group, wherever
the member is: in this process (a dump or restore session of this host) or on another host
(ckpt/commands/group_remote.py: `ckpt _member` at the far end of an ssh channel, which drives
the same local member there). The phases and what each side does on every failure are in
docs/design.md, "Groups: the protocol".

Every report is plain data that goes over the wire as one JSON object (to_json/from_json)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Protocol, TypeVar

from ckpt.store.manifest import Origin

if TYPE_CHECKING:
    from ckpt.commands.dump import DumpRequest, DumpSession
    from ckpt.commands.restore import RestoreRequest, RestoreSession

PROTOCOL_VERSION = 1

Report = TypeVar("Report", bound="_Wire")


class _Wire:
    """A report as one JSON object, and back (unknown keys, from a newer ckpt, are ignored)."""

    def to_json(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[Report], data: dict) -> Report:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Prepared(_Wire):
    """prepare(): checks done, locks taken, staging ready; nothing frozen (dump) or running (restore)."""

    hostname: str  # the member host's own name
    command: str = ""  # the tree's command line (dump) or the checkpoint's (restore)
    # dump: the tree's UNIX stream sockets connected outside it, [inode, peer's inode] each: the
    # coordinator warns of a connection between two members (it is not restored)
    unix_connections: list = field(default_factory=list)


@dataclass
class Held(_Wire):
    """capture(): the tree frozen and dumped (dump: CRIU waits in post-dump; with --stop its
    checkpoint is committed already) or restored and not running yet (restore: CRIU waits in
    post-restore). Times are seconds since the epoch by the member host's clock."""

    frozen_at: float = 0.0  # dump: just before the freeze (CRIU's pre-dump); restore: CRIU started
    held_at: float = 0.0  # when the tree was held
    checkpoint: str = ""  # dump with --stop: the member's checkpoint, committed inside the hold
    freeze_ms: float | None = None  # dump with --stop: the freeze so far, as the checkpoint records it


@dataclass
class Released(_Wire):
    """release(): the tree runs again (dump: thawed; --stop: ended) or runs (restore: pid)."""

    released_at: float = 0.0
    pid: int | None = None  # restore: the restored root, in the host's PID namespace


@dataclass
class Committed(_Wire):
    """commit(): dump: the member's checkpoint committed (its manifest names the group, which
    is not visible until the group manifest is); restore: finished (cleaned up, hook run)."""

    checkpoint: str
    freeze_ms: float | None = None  # dump: CRIU's own measure of the freeze
    result: dict | None = None  # the member's DumpResult/RestoreResult.to_json()


class Member(Protocol):
    """One member, driven phase by phase. After any failure (a typed CkptError, or
    MemberLost when a remote member's channel ends) the member has undone its own work: a
    dumped tree thawed, a restored one ended, staging and locks gone; abort() is still safe."""

    label: str  # how the user named the member: "4242" or "host-a:4242"

    def prepare(self) -> Prepared:
        ...

    def capture(self) -> Held:
        ...

    def release(self) -> Released:
        ...

    def commit(self) -> Committed:
        ...

    def abort(self) -> None:
        ...


# ---- what the coordinator asks of one member, and members of this host ---------------------


@dataclass(frozen=True)
class MemberSpec:
    """One member as the coordinator plans it: where it is and what it is to do. A dump member
    names its tree (pid); a restore member its checkpoint. Plain data: a remote member sends it
    to its agent."""

    label: str  # how the user named it: "4242" or "host-a:4242"
    host: str = ""  # "" = the coordinator's host
    pid: int = 0  # dump: the tree's root; restore: the checkpoint's root PID (for the record)
    group: dict | None = None  # {"id", "name"} of the group, into the member's manifest (dump)
    checkpoint: str = ""  # restore: the member's checkpoint
    stop: bool = False  # dump: --stop
    hold_limit: float = 60.0  # seconds the member holds its tree without a release
    # restore: the other members' TCP connections, [(local, remote), ...] (RestoreRequest.group_peers)
    group_peers: tuple = ()
    # restore: the group restore's options, as RestoreRequest's
    tcp_close: bool | None = None
    lazy: bool | None = None
    output: str | None = None
    # dump: who asks for the group (a schedule, `ckpt run`), into each member's manifest as well
    origin: Origin | None = None


def member_request(spec: MemberSpec, restore: bool) -> DumpRequest | RestoreRequest:
    """What a member does, on this host or by its agent on another: one of the group's dumps
    (named as the group, of the group's origin) or restores."""
    from ckpt.commands.dump import DumpRequest
    from ckpt.commands.restore import RestoreRequest

    if restore:
        return RestoreRequest(ref=spec.checkpoint, group_peers=[[list(local), list(remote)]
                                                                for local, remote in spec.group_peers],
                              tcp_close=spec.tcp_close, lazy=spec.lazy, output=spec.output)
    return DumpRequest(pid=spec.pid, stop=spec.stop, group=spec.group, name=(spec.group or {}).get("name"),
                       origin=spec.origin or Origin("dump"))


def parse_member(text: str) -> tuple[str, int]:
    """"PID" or "HOST:PID" -> (host, pid); host "" is the coordinator's host."""
    from ckpt.errors import UsageError

    host, _, pid_text = text.rpartition(":")
    if not pid_text.isdigit() or int(pid_text) <= 0 or (":" in text and not host):
        raise UsageError(f"'{text}' is not a group member", hint="give PID (on this host) or HOST:PID")
    return host, int(pid_text)


def _hostname() -> str:
    import socket

    return socket.gethostname()


class LocalDumpMember:
    """A dump member of this host: a DumpSession, held frozen between capture and release."""

    def __init__(self, session: DumpSession, label: str, hold_limit: float):
        self.session, self.label, self.hold_limit = session, label, hold_limit

    def prepare(self) -> Prepared:
        self.session.prepare()
        facts = self.session.facts
        return Prepared(hostname=_hostname(), command=facts.command,
                        unix_connections=[[s["inode"], s["peer_inode"]] for s in facts.external_sockets])

    def capture(self) -> Held:
        self.session.capture_frozen(self.hold_limit)
        marks = self.session.wall_marks
        # CRIU tells of the freeze just before it (pre-dump); post-dump: dumped, held
        held_at = marks.get("post-dump", time.time())
        manifest = self.session.manifest  # committed already with --stop
        return Held(frozen_at=marks.get("pre-dump", held_at), held_at=held_at,
                    checkpoint=manifest.id if manifest else "",
                    freeze_ms=manifest.stats.get("freeze_ms") if manifest else None)

    def release(self) -> Released:
        self.session.release()  # returns once CRIU has thawed (--stop: ended) the tree and exited
        return Released(released_at=time.time())

    def commit(self) -> Committed:
        manifest = self.session.commit()
        result = self.session.finish()  # the member's own clean-up: its checkpoint is committed
        return Committed(checkpoint=manifest.id, freeze_ms=manifest.stats.get("freeze_ms"), result=result.to_json())

    def abort(self) -> None:
        self.session.abort()


class LocalRestoreMember:
    """A restore member of this host: a RestoreSession, held before it runs until release."""

    def __init__(self, session: RestoreSession, label: str, hold_limit: float):
        self.session, self.label, self.hold_limit = session, label, hold_limit

    def prepare(self) -> Prepared:
        self.session.prepare()
        return Prepared(hostname=_hostname(), command=self.session.manifest.command)

    def capture(self) -> Held:
        started = time.time()
        self.session.restore_held(self.hold_limit)
        return Held(frozen_at=started, held_at=time.time())

    def release(self) -> Released:
        self.session.release()
        return Released(released_at=time.time(), pid=self.session.pid)

    def commit(self) -> Committed:
        result = self.session.finish()
        return Committed(checkpoint=result.manifest.id, result=result.to_json())

    def abort(self) -> None:
        self.session.abort()
