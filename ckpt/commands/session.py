"""What a dump session and a restore session share (ckpt/commands/dump.py, restore.py): the
collaborators a coordinator or a test hands them, and the rule that a session a `with` block
leaves unfinished is aborted."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Callable, Generic, Protocol, Self, TypeVar

from ckpt.reporting import NullReporter, Reporter
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Store
from ckpt.store.password import PasswordSource

if TYPE_CHECKING:
    from ckpt.criu.binary import CriuBinary
    from ckpt.criu.client import CriuOptions, NotifyHandler

Request = TypeVar("Request")


class Criu(Protocol):
    """What a session asks of CRIU (ckpt.criu.client.CriuClient; a fake in the tests)."""

    @property
    def binary(self) -> CriuBinary:
        ...

    def dump(self, options: CriuOptions, on_notify: NotifyHandler | None = None,
             on_started: Callable[[], None] | None = None) -> None:
        ...

    def restore(self, options: CriuOptions, on_notify: NotifyHandler | None = None) -> int:
        ...


def host_criu(settings: Settings) -> Criu:
    """The CRIU of this host (CKPT_CRIU or the PATH's), driven as root: a session's default."""
    from ckpt.criu.binary import find_criu
    from ckpt.criu.client import CriuClient
    from ckpt.system import procs

    procs.require_root()
    return CriuClient(find_criu(settings))


class Session(Generic[Request]):
    """One dump or restore, driven phase by phase. Used as a context manager, a session is
    aborted when the block ends by an exception or before the session finished: abort is safe
    from any phase and idempotent (each session says what it undoes)."""

    def __init__(self, store_root: StoreLocation, request: Request, settings: Settings,  # noqa: PLR0913
                 reporter: Reporter = NullReporter(), passwords: PasswordSource | None = None,
                 store: Store | None = None, criu: Callable[[Settings], Criu] = host_criu,
                 clock: Callable[[], float] = time.monotonic):
        self.store_root, self.request, self.reporter = store_root, request, reporter
        self.settings = settings  # passed down from the edge (the CLI), never looked up
        self.passwords = passwords if passwords is not None else PasswordSource.from_settings(settings)
        self.store = store  # opened by prepare unless given
        self.new_criu, self.clock = criu, clock  # new_criu(settings) when CRIU is first needed
        self.started = clock()
        self._held = ExitStack()  # what the session holds to its end (locks): released last
        self._finished = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or not self._finished:
            self.abort()

    def abort(self) -> None:
        raise NotImplementedError

    def _open_store(self, create: bool) -> Store:
        if self.store is None:
            self.store = Store.open(self.store_root, create, settings=self.settings, passwords=self.passwords)
        return self.store

    def _hold_store_lock(self) -> None:
        """The shared lock, to the session's end: no command deletes what it reads or adds."""
        self._held.enter_context(self._store().lock(
            exclusive=False, timeout=self.settings.lock_timeout,
            on_wait=lambda holders: self.reporter.info("waiting for the store lock")))

    def _store(self) -> Store:
        if self.store is None:
            raise RuntimeError("the store is opened by prepare")  # a coordinator's bug, not the user's
        return self.store
