"""Steps that must not be cut in two by Ctrl-C: a migration ends its source tree and then
records that its destination's tree is the only copy; interrupted in between, neither copy
would run. Inside deferred_interrupts() SIGINT, SIGTERM and SIGHUP are only noted; the first one
is delivered again, with the disposition it had, when the block ends."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Python runs signal handlers in the main thread only, so elsewhere this does nothing (a
    thread cannot be interrupted by them anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {number: signal.signal(number, lambda number, _frame: noted.append(number)) for number in DEFERRED}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if noted:
            signal.raise_signal(noted[0])
