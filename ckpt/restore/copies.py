"""The copies of a clone (docs/design.md, "Clones"): copy k of a checkpoint restored into a PID
namespace of its own, whose init is ckpt's small reaper, in a way CRIU can dump again.

What CRIU 4.2 can dump decides the arrangement (found by trying; the errors are CRIU's):

- CRIU dumps a PID namespace only from its init ("Can't dump a pid namespace without the
  process init"), so a copy's init is part of its checkpoint: it is a tiny program (Python
  without site, a wait loop: ~10 MB of images) named `ckpt-init`, not a fork of ckpt.
- The init leads its own session inside the namespace ("A session leader of X(1) is outside
  of its pid namespace" otherwise).
- The init stays in the host's mount namespace: only the process that runs CRIU unshares one,
  to mount the namespace's /proc, and CRIU is told to restore the tree into the init's
  (`join_ns mnt:/proc/1/ns/mnt`): a private mount namespace would be one more thing to dump.
- CRIU's restore puts the restored root into a new time namespace of its own whenever the
  kernel has them (criu/cr-restore.c: `prepare_timens(0)`, to restore the monotonic clocks);
  the init is not in it, and the dump of the init's tree then fails ("Can't dump nested time
  namespace"). Joining the init's (the host's) time namespace (`join_ns time:/proc/1/ns/time`,
  which CRIU does after prepare_timens) avoids it: the copy sees the host's clocks.
- A copy's own network namespace is dumped as external (`net[<inode>]:ckpt-copy-net`) and given
  back on restore as a descriptor of a fresh one (`inherit_fd`), as runc and Podman do.

Layout of the processes: ckpt forks a helper that joins the copy's network namespace, unshares
a PID namespace and forks the init (PID 1), then exits. The init forks the CRIU runner and
execs the reaper; the runner (in the new PID namespace, a mount namespace of its own) runs
CRIU, whose restored root is reparented to the init when CRIU exits. The identity file is
written by the runner in CRIU's post-restore notification, before the copy's tree runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ckpt.errors import CkptError, ProcessNotFound, UsageError, from_record, to_record
from ckpt.restore.pidns import CLONE_NEWNS, CLONE_NEWPID, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_REC, _check
from ckpt.system import procfs
from ckpt.system.detach import detach_stdio
from ckpt.system.files import atomic_write_bytes, make_readable_dir

CLONE_NEWNET = 0x40000000
NETWORKS = ("own", "host")
INIT_COMM = "ckpt-init"
IDENTITY_FORMAT = 2  # docs/design.md, "Clones"; read by ckpt/agent/identity.py
# The key of a copy's network namespace when it is dumped as external, and restored from a
# descriptor of a fresh one.
NET_KEY = "ckpt-copy-net"
# Seen from the CRIU runner, /proc/1 is the copy's init, which lives in the host's mount and
# time namespaces: the restored tree joins them (see above).
JOIN_HOST_NAMESPACES = [("mnt", "/proc/1/ns/mnt"), ("time", "/proc/1/ns/time")]
# The init, once CRIU has restored its children: reaps until none is left (the namespace
# ends with it). Its comm tells `ckpt dump` a copy's init from another namespace's.
REAPER = ("import os\n"
          f"open('/proc/self/comm', 'w').write({INIT_COMM!r})\n"
          "while True:\n"
          "    try:\n"
          "        os.wait()\n"
          "    except ChildProcessError:\n"
          "        break\n"
          "    except InterruptedError:\n"
          "        pass\n")

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class CopyPlacement:
    """Copy `index` (1..count) of clone `clone_id`; network "own" (a network namespace of its
    own, restore/copynet.py) or "host"."""

    clone_id: str
    index: int
    count: int
    network: str = "own"

    def check(self) -> None:
        if not 1 <= self.index <= self.count:
            raise UsageError(f"copy {self.index} of {self.count} is not a copy number from 1 to {self.count}")
        if self.network not in NETWORKS:
            raise UsageError(f"unknown network {self.network!r} for a copy", hint="use own or host")
        if len(self.clone_id) < 6:
            raise UsageError(f"clone id {self.clone_id!r} is too short", hint="use a checkpoint-style id (ids.new_id)")

    @property
    def tag(self) -> str:
        """The clone's short name in the copy's network names (its id's random end)."""
        return self.clone_id[-6:]


@dataclass
class CopyInfo:
    """Where a copy runs: its init and root (host PIDs), the root's PID inside, the PID
    namespace's inode (its identity file's name), its network namespace and address (None:
    the host's)."""

    index: int
    init_pid: int
    pid: int
    pid_in_namespace: int
    pidns_inode: int
    netns: str | None = None
    address: str | None = None

    def to_json(self) -> dict:
        return {"index": self.index, "init_pid": self.init_pid, "pid": self.pid,
                "pid_in_namespace": self.pid_in_namespace, "pidns_inode": self.pidns_inode,
                "netns": self.netns, "address": self.address}


def identity_path(copies_dir: Path, pidns_inode: int) -> Path:
    return copies_dir / f"pidns-{pidns_inode}.json"


def write_identity(copies_dir: Path, placement: CopyPlacement, checkpoint: str, name: str | None,  # noqa: PLR0913
                   init: tuple[int, int], frozen_at: float | None = None) -> int:
    """Writes the identity file of the copy whose PID namespace the caller is in (the CRIU
    runner, in CRIU's post-restore notification: before the copy's tree runs); returns the
    namespace's inode. init: the copy's init as (host PID, start ticks), which readers check
    (ckpt/agent/identity.py): the file is no longer true once that init is gone. World-readable
    in a directory everyone reads: a copy running as another user reads it, and it holds no
    secret (the clone, the copy's number, the checkpoint's id and name)."""
    inode = os.stat("/proc/self/ns/pid").st_ino
    data = {"format": IDENTITY_FORMAT, "clone": placement.clone_id, "copy": placement.index,
            "copies": placement.count, "checkpoint": checkpoint, "name": name,
            "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "init": list(init),
            "frozen_at": frozen_at}
    make_readable_dir(copies_dir)
    atomic_write_bytes(identity_path(copies_dir, inode), json.dumps(data).encode(), mode=0o644, durable=False)
    return inode


def remove_stale_identities(copies_dir: Path) -> list[str]:
    """Removes the identity files whose init is gone (or that name none: an older format's,
    which no reader takes any more); returns their names. ckpt clone, a restore
    of a copy and the clone's watcher call it."""
    removed = []
    for path in copies_dir.glob("pidns-*.json"):
        try:
            with open(path, "rb") as file:
                inode = os.fstat(file.fileno()).st_ino
                data = json.loads(file.read(65536))
            init = data.get("init") if isinstance(data, dict) else None
            if isinstance(init, list) and len(init) == 2 and procfs.is_running(int(init[0]), int(init[1])):
                continue
            # Only the file read: a new copy whose namespace took the inode may have replaced it.
            if os.stat(path).st_ino == inode:
                path.unlink()
                removed.append(path.name)
        except (OSError, ValueError, TypeError):
            continue
    return removed


@dataclass
class CopyStarted:
    init_pid: int  # host PIDs
    pid: int
    pid_in_namespace: int
    pidns_inode: int


InsideRestore = Callable[[tuple[int, int]], int]


def run_copy(restore_inside: InsideRestore, netns: Path | None,
             on_init: Callable[[int, int], None] | None = None) -> CopyStarted:
    """Runs restore_inside(init) (CRIU's restore, returning the root's PID as CRIU sees it; init:
    the copy's init as (host PID, start ticks), for its identity file) in the CRIU runner of a
    new PID namespace, in the network namespace at `netns` (None: the host's).
    Re-raises the CkptError restore_inside raised (same class, message, hint, exit code)."""
    read_end, write_end = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(read_end)
        _helper(write_end, restore_inside, netns)
    os.close(write_end)
    os.waitpid(helper, 0)
    result: dict = {}
    with os.fdopen(read_end) as reader:  # EOF once the init has exec'd the reaper and the runner exited
        for line in reader:
            if line.strip():
                message = json.loads(line)
                result.update(message)
                if "init" in message and on_init is not None:
                    # told at once (the helper's line comes first): an abort while CRIU still
                    # restores ends the copy by its init, which leads a session of its own
                    on_init(int(message["init"]), int(message.get("init_start") or 0))
    if "error_type" in result:
        raise from_record(result)
    if "error" in result:
        raise CkptError(result["error"])
    if not {"init", "pid", "pidns"} <= result.keys():
        raise CkptError("the restore of a copy ended without a result")
    inode = int(result["pidns"])
    _wait_for_reaper(result["init"])
    return CopyStarted(result["init"], host_pid(inode, result["pid"]), result["pid"], inode)


def _wait_for_reaper(init: int, timeout: float = 5.0) -> None:
    """Until the init runs the reaper (its name set: what `ckpt dump` knows a copy's init by),
    which it started while CRIU worked: almost always at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{init}/comm").read_text().strip() == INIT_COMM:
                return
        except OSError:
            raise ProcessNotFound(f"the copy's init (PID {init}) ended") from None
        time.sleep(0.01)


def _report(write_end: int, record: dict) -> None:
    os.write(write_end, json.dumps(record).encode() + b"\n")


def _helper(write_end: int, restore_inside: InsideRestore, netns: Path | None) -> None:
    """Leaves ckpt's session, joins the network namespace, makes the PID namespace whose first
    child, the init, it forks; never returns."""
    try:
        os.setsid()
        if netns is not None:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
            finally:
                os.close(fd)
        _check(_libc.unshare(CLONE_NEWPID), "unshare")
        # The init knows itself as PID 1 only, and the runner's /proc is the new namespace's:
        # its host PID and start time are told from here.
        told, tell = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(tell)
            _as_init(write_end, restore_inside, told)
        os.close(told)
        start = procfs.start_ticks(init)
        os.write(tell, f"{init} {start}".encode())
        os.close(tell)
        _report(write_end, {"init": init, "init_start": start})
    except BaseException as exc:  # reported to the parent, never raised in a forked child
        _report(write_end, {"error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)


def _as_init(write_end: int, restore_inside: InsideRestore, told: int) -> None:
    """PID 1: leads its own session (CRIU dumps no namespace whose init's session leader is
    outside it), forks the CRIU runner and becomes the reaper at once (its name is set by the
    time CRIU is done, and it reaps the runner too). told: where the helper writes the init's
    host PID and start time (read to its end: the helper closes it at once, or exits)."""
    try:
        os.setsid()
        with os.fdopen(told, "rb") as reader:
            pid, start = (int(v) for v in reader.read(64).split())
        if os.fork() == 0:
            _as_runner(write_end, lambda: restore_inside((pid, start)))
    except BaseException as exc:
        _report(write_end, {"error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)
    # The reaper lives as long as the copy: it keeps none of ckpt's descriptors (the store
    # lock's would block prune and rm), and its end of the pipe closes here.
    detach_stdio()
    try:
        os.execv(sys.executable, [sys.executable, "-S", "-I", "-c", REAPER])
    finally:
        os._exit(1)


def _as_runner(write_end: int, restore_inside: Callable[[], int]) -> None:
    """In a mount namespace of its own (the init stays in the host's): this PID namespace's
    /proc, which CRIU needs to see the tree it restores by its PIDs."""
    try:
        _check(_libc.unshare(CLONE_NEWNS), "unshare")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        _check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        pid = restore_inside()
        _report(write_end, {"pid": pid, "pidns": os.stat("/proc/self/ns/pid").st_ino})
    except CkptError as exc:
        _report(write_end, to_record(exc))
        os._exit(1)
    except BaseException as exc:
        _report(write_end, {"error": f"{type(exc).__name__}: {exc}"})
        os._exit(1)
    os._exit(0)


# ---- finding a copy from the host ---------------------------------------------------------

def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def pidns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def pid_in_namespace(pid: int) -> int:
    """PID's own number in its PID namespace (the last of its NSpid)."""
    return int(_status(pid)["NSpid"].split()[-1])


def host_pid(inode: int, inner: int) -> int:
    """The host PID of the process that is `inner` in the PID namespace `inode`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if _status(int(entry.name))["NSpid"].split()[-1] == str(inner) and pidns_inode(int(entry.name)) == inode:
                return int(entry.name)
        except (OSError, KeyError, IndexError):
            continue
    raise ProcessNotFound(f"no process is PID {inner} of PID namespace {inode}: the copy ended already")


@dataclass
class CopyTarget:
    """A process tree in a copy: its init (host PID), its PID namespace, its identity (None
    for a copy restored from a copy's checkpoint), its network namespace's inode when it is
    not ckpt's own (None: the host's)."""

    init_pid: int
    pidns_inode: int
    identity: dict | None
    netns_inode: int | None


def find_copy(pid: int, copies_dir: Path) -> CopyTarget | None:
    """The copy PID runs in (PID may be its init), or None when PID is in ckpt's own PID
    namespace or in one that is not a copy's (no identity file, an init of another name)."""
    try:
        inode = pidns_inode(pid)
        if inode == pidns_inode(os.getpid()):
            return None
        init = _init_of(pid, inode)
    except (OSError, KeyError, ValueError, IndexError):
        return None
    identity = None
    try:
        identity = json.loads(identity_path(copies_dir, inode).read_text())
        recorded = identity.get("init")
        # A file left by a copy that ended names a namespace whose inode another may have now.
        if not (isinstance(recorded, list) and recorded[0] == init and procfs.is_running(*recorded)):
            identity = None
    except (OSError, ValueError, AttributeError, TypeError, IndexError):
        identity = None
    if init is None or (identity is None and Path(f"/proc/{init}/comm").read_text().strip() != INIT_COMM):
        return None
    netns = os.stat(f"/proc/{init}/ns/net").st_ino
    return CopyTarget(init, inode, identity, None if netns == os.stat("/proc/self/ns/net").st_ino else netns)


def root_of(copy: CopyTarget, pid: int, limit: int = 64) -> int | None:
    """The copy's root (the init's child PID is under, or its only child when PID is the
    init) by its PID inside, or None when it cannot be told."""
    if pid == copy.init_pid:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return pid_in_namespace(int(children[0])) if len(children) == 1 else None
    for _ in range(limit):
        parent = int(_status(pid)["PPid"])
        if parent == copy.init_pid:
            return pid_in_namespace(pid)
        pid = parent
    return None


def _init_of(pid: int, inode: int, limit: int = 64) -> int | None:
    """Walks up the parents of PID to the init (PID 1) of its namespace."""
    for _ in range(limit):
        status = _status(pid)
        if status["NSpid"].split()[-1] == "1":
            return pid
        parent = int(status["PPid"])
        if parent <= 0 or pidns_inode(parent) != inode:
            return None
        pid = parent
    return None


def end_copy(init_pid: int, start: int | None = None) -> None:
    """Ends a copy: SIGKILL to its init ends every process of its namespace. start: the init's
    start ticks, when known: a PID that another process took since is left alone (the init is
    reaped by the host's init, not by ckpt: its PID may be free, or reused, by now)."""
    if start and not procfs.is_running(init_pid, start):
        return
    try:
        os.kill(init_pid, 9)
    except ProcessLookupError:
        pass
