"""Waiting for a flock(2) with a deadline: the store's lock, a dump's lock of its target and a
schedule's run lock all wait the same way."""

from __future__ import annotations

import fcntl
import time
from typing import Callable

POLL_S = 0.1  # flock has no timeout: poll, a tenth of a second adds little to a wait of seconds


def wait_for_flock(fd: int, mode: int, deadline: float, on_timeout: Callable[[], Exception],
                   on_wait: Callable[[], None] | None = None) -> None:
    """flock(fd, mode) (fcntl.LOCK_EX or LOCK_SH), polling until `deadline` (time.monotonic()).
    on_wait() is called once, when it first has to wait; when the deadline passes, the
    exception on_timeout() makes is raised."""
    told = False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not told and on_wait is not None:
                on_wait()
                told = True
            if time.monotonic() >= deadline:
                raise on_timeout() from None
            time.sleep(POLL_S)
