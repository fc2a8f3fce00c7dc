"""The init of a PID namespace made for a restore (ckpt/restore/pidns.py) lives as long as the
restored tree: it must not keep what it inherited from ckpt, the store's lock above all."""

import fcntl
import os
import signal
import subprocess

import pytest

from ckpt.restore.pidns import run_in_new_pidns
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace needs root")


def test_the_namespace_init_does_not_hold_the_store_lock(tmp_path):
    lock = tmp_path / "lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as `ckpt restore` holds the store while it restores

    def restore_inside() -> int:
        # Stands for the restored tree: a child of the namespace's init that keeps running.
        return subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid

    outer, inner = run_in_new_pidns(restore_inside)
    try:
        os.close(fd)  # `ckpt restore` ends
        again = os.open(lock, os.O_RDWR)
        try:
            # prune and rm take the store exclusively: they must not wait for the restored tree
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail("the PID namespace's init still holds the lock ckpt held while restoring")
        finally:
            os.close(again)
    finally:
        os.kill(outer, signal.SIGKILL)  # the sleep we started; its init then ends with it
        wait_until(lambda: gone_or_zombie(outer), timeout=10, what="the stand-in tree to end")


def gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True
