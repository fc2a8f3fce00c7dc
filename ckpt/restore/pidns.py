"""Running a restore inside a new PID namespace, so a tree whose PIDs are taken on the host
can still get its own PIDs back (the approach of CRIU's criu-ns).

ckpt forks; the child leaves ckpt's session and unshares PID and mount namespaces; its child
is PID 1 of the new namespace: it mounts a private /proc, runs the restore there, reports the
result through a pipe, and then stays as the namespace's init, reaping, until the restored tree
has exited (the namespace ends with its init).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from pathlib import Path
from typing import Callable

from ckpt.errors import CkptError, from_record, to_record
from ckpt.system.detach import detach_stdio

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _init_loop() -> None:
    """PID 1 of the namespace: reap until no child is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _outer_pid(init_outer: int, inner: int) -> int:
    """Finds, in the host's /proc, the process that is `inner` inside init_outer's namespace."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspid = fields.get("NSpid", "").split()
        if len(nspid) >= 2 and int(nspid[-1]) == inner and entry.name != str(init_outer):
            # Walk up to make sure it belongs to our namespace's init.
            ppid = int(fields.get("PPid", "0").strip())
            if ppid == init_outer or inner == 1:
                return int(entry.name)
            try:
                parent_ns = (Path(f"/proc/{init_outer}/ns/pid")).readlink()
                if (entry / "ns" / "pid").readlink() == parent_ns:
                    return int(entry.name)
            except OSError:
                continue
    return inner


def run_in_new_pidns(restore_inside: Callable[[], int]) -> tuple[int, int]:
    """Runs restore_inside() as PID 1 of a new PID namespace.

    Returns (root PID as seen on the host, root PID inside the namespace). Re-raises the
    CkptError restore_inside raised: same class, message, hint and exit code.
    """
    read_end, write_end = os.pipe()
    first = os.fork()
    if first == 0:  # intermediate: new session, new namespaces, forks the init
        try:
            os.close(read_end)
            os.setsid()
            _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
            init = os.fork()
            if init == 0:
                _as_init(write_end, restore_inside)
            os.write(write_end, json.dumps({"init": init}).encode() + b"\n")
        except BaseException as exc:  # reported to the parent, never raised in a forked child
            os.write(write_end, json.dumps({"error": str(exc)}).encode() + b"\n")
        os._exit(0)
    os.close(write_end)
    os.waitpid(first, 0)
    with os.fdopen(read_end) as reader:
        messages = [json.loads(line) for line in reader if line.strip()]
    result = {k: v for m in messages for k, v in m.items()}
    if "error_type" in result:
        raise from_record(result)
    if "error" in result:
        raise CkptError(result["error"])
    if "pid" not in result or "init" not in result:
        raise CkptError("the restore in a new PID namespace ended without a result")
    return _outer_pid(result["init"], result["pid"]), result["pid"]


def _as_init(write_end: int, restore_inside: Callable[[], int]) -> None:
    try:
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        _check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        pid = restore_inside()
        # This process lives as long as the restored tree: it must not keep ckpt's descriptors
        # (with the store lock's, prune and rm waited, then failed, while such a tree ran).
        # Closed before the result goes back, so that they are closed when `ckpt restore` returns.
        detach_stdio(keep={write_end})
        os.write(write_end, json.dumps({"pid": pid}).encode() + b"\n")
    except CkptError as exc:
        os.write(write_end, json.dumps(to_record(exc)).encode() + b"\n")
        os._exit(1)
    except BaseException as exc:
        os.write(write_end, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        os._exit(1)
    os.close(write_end)
    # Shown by ps as the namespace's init rather than as a copy of the ckpt command line.
    _libc.prctl(15, b"ckpt-pidns-init", 0, 0, 0)  # PR_SET_NAME
    _init_loop()
    os._exit(0)
