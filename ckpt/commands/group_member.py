"""What a group coordinator (ckpt/commands/group.py) asks of each member of a group, wherever
the member is: in this process (a dump or restore session of this host) or on another host
(ckpt/commands/group_remote.py: `ckpt _member` at the far end of an ssh channel, which drives
the same local member there). The phases and what each side does on every failure are in
docs/design.md, "Groups: the protocol".

Every report is plain data that goes over the wire as one JSON object (to_json/from_json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Protocol, TypeVar

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


@dataclass
class Held(_Wire):
    """capture(): the tree frozen and dumped (dump: CRIU waits in post-dump; with --stop its
    checkpoint is committed already) or restored and not running yet (restore: CRIU waits in
    post-restore). Times are seconds since the epoch by the member host's clock."""

    frozen_at: float = 0.0  # dump: just before the freeze (CRIU's pre-dump); restore: CRIU started
    held_at: float = 0.0  # when the tree was held


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
