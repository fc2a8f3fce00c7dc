"""One dump of a process at a time, host-wide.

Two dumps of one tree at once made the later CRIU fail with "Unable to detach from PID: No such
process" (the first CRIU holds the tree by ptrace), whatever stores they wrote to. A dump holds
the flock of /run/ckpt/dumping/<pid>.lock from before its pre-flight checks to its end; another
dump of the same PID waits for it (CKPT_LOCK_TIMEOUT at most) and says whom it waits for.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ckpt.errors import StoreBusy
from ckpt.store.fsutil import check_trusted_dir
from ckpt.system.files import make_private_dir
from ckpt.system.locks import wait_for_flock

LOCK_DIR = Path("/run/ckpt/dumping")


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


@contextmanager
def dumping(pid: int, timeout: float, on_wait: Callable[[str], None] | None = None,
            lock_dir: Path = LOCK_DIR) -> Iterator[None]:
    """Holds the dump lock of a PID for the duration of the block."""
    make_private_dir(lock_dir)
    check_trusted_dir(lock_dir, "the lock directory")
    path = lock_dir / f"{pid}.lock"
    deadline = time.monotonic() + timeout
    told: list[bool] = []  # said once, however many times the lock file is replaced under us

    def tell() -> None:
        if on_wait is not None and not told:
            on_wait(_holder(path))
            told.append(True)

    def busy() -> StoreBusy:
        return StoreBusy(f"another dump of PID {pid} is in progress (ckpt PID {_holder(path)})",
                         hint=f"waited {timeout:.0f} s; wait for it to finish or raise CKPT_LOCK_TIMEOUT")

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            wait_for_flock(fd, fcntl.LOCK_EX, deadline, busy, tell)
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:
            os.close(fd)  # its last holder removed it between our open and our flock: take the new one
            continue
        break
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        # Removed while still held, so that whoever opens the name next makes a new one (and a
        # waiter holding the old inode sees that it changed, above).
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
