"""What a forked child that outlives ckpt does first (the lazy restore's page server and
watcher, a restore's PID namespace init)."""

from __future__ import annotations

import os
from collections.abc import Set


def detach_stdio(keep: Set[int] = frozenset()) -> None:
    """Points stdin, stdout and stderr at /dev/null and closes every other inherited descriptor
    but `keep`: a caller reading ckpt's output must see its end when ckpt exits, and a
    descriptor of ckpt's store lock held by a child would keep the store locked (for prune, rm)
    for as long as the child lives."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor listdir itself used, closed by now
