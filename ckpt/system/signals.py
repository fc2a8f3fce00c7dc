"""Steps that must not be cut in two by Ctrl-C: a migration ends its source tree and then
records that its destination's tree is the only copy; interrupted in between, neither copy
would run. Inside deferred_interrupts() SIGINT, SIGTERM and SIGHUP are only noted; the first one
is delivered again, with the disposition it had, when the block ends (or at Deferral.end())."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Deferral:
    """The interrupts noted so far; end() restores the handlers and delivers the first."""

    def __init__(self) -> None:
        self.noted: list[int] = []
        self.previous: dict[int, object] = {}

    def begin(self) -> None:
        for number in DEFERRED:
            handler = signal.getsignal(number)
            if handler is None or handler == signal.SIG_IGN:  # installed outside Python, or ignored: left alone
                continue
            self.previous[number] = handler
            signal.signal(number, lambda number, _frame: self.noted.append(number))

    def end(self) -> None:
        previous, self.previous = self.previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        if previous and self.noted:
            signal.raise_signal(self.noted[0])


@contextmanager
def deferred_interrupts() -> Iterator[Deferral | None]:
    """Python runs signal handlers in the main thread only, so elsewhere this defers nothing
    (and yields None): a thread cannot be interrupted by them anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    deferral = Deferral()
    deferral.begin()
    try:
        yield deferral
    finally:
        deferral.end()


@contextmanager
def terminations_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (`timeout`, a closed terminal) raise KeyboardInterrupt in the block,
    as Ctrl-C does, where their default action would end ckpt at once: a command that starts
    processes of its own (the copies of a clone) then ends them before it exits. Handlers that
    are not the default are left alone; nothing changes outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_number: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = {}
    for number in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(number) == signal.SIG_DFL:
            previous[number] = signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
