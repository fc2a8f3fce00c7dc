"""What a dump session and a restore session share (ckpt/commands/dump.py, restore.py): the
collaborators a coordinator or a test hands them, and the rule that a session a `with` block
leaves unfinished is aborted."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Callable, Generic, Protocol, Self, TypeVar

from ckpt.errors import SessionAborted
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
        self.passwords = PasswordSource.passed_or_settings(passwords, settings)
        self.store = store  # opened by prepare unless given
        self.new_criu, self.clock = criu, clock  # new_criu(settings) when CRIU is first needed
        self.started = clock()
        self._held = ExitStack()  # what the session holds to its end (locks): released last
        self._hold: Hold | None = None  # a coordinator's hold on the tree (see _run_held)
        # Set by abort() first: a coordinator aborts from its own thread while CRIU's may still
        # be on its way to the notification, which must then refuse whatever comes late.
        self._aborted = False
        self._finished = False
        # Asked when a hold reaches its limit: True lets the tree go on as a release would (a
        # migration's destination whose move was recorded); None or False refuses it.
        self.on_hold_expiry: Callable[[], bool] | None = None

    @property
    def released_on_expiry(self) -> bool:
        """The tree held went on at its hold limit (on_hold_expiry said so)."""
        return self._hold is not None and self._hold.released_on_expiry

    @property
    def aborted(self) -> bool:
        """abort() was called: nothing more of this session is to be done."""
        return self._aborted

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or not self._finished:
            self.abort()

    def abort(self) -> None:
        raise NotImplementedError

    # ---- a coordinator's hold on the tree ---------------------------------------------------

    def _run_held(self, step: Callable[[], object], what: str, hold_limit: float) -> None:
        """Runs step (CRIU's dump or restore) in a thread and returns once CRIU waits in the
        session's notification where it calls _held_here(): the tree frozen and dumped, or
        restored and not yet running. release() lets CRIU go on; abort() refuses the
        notification (CRIU then thaws, or ends, the tree and fails)."""
        if self._aborted:
            raise SessionAborted(f"{what}: the session was aborted before CRIU started")
        hold = self._hold = Hold(what, hold_limit, self.on_hold_expiry)
        hold.start(step)
        try:
            hold.wait_until_held()
        except BaseException:
            # CRIU failed, or the coordinator was interrupted while CRIU works: CRIU's thread is
            # ended before anything (the staging, the locks) is let go, and a notification that
            # comes later is refused (CRIU thaws, or ends, the tree).
            hold.end(release=False)
            self._hold = None
            raise

    def _held_here(self) -> None:
        """In CRIU's notification: waits for the coordinator's decision (no hold: goes on; an
        aborted session: refused)."""
        hold = self._hold
        if hold is not None:
            hold.wait_for_release()
        elif self._aborted:
            raise SessionAborted("the session was aborted while CRIU worked")

    def _not_given_up(self) -> None:
        """In CRIU's notification, before the session commits anything there (--stop): a hold
        the coordinator already gave up (or an aborted session) is refused at once."""
        hold = self._hold
        if self._aborted and hold is None:
            raise SessionAborted("the session was aborted while CRIU worked")
        if hold is not None and hold.decided.is_set() and not hold.released:
            hold.wait_for_release()  # raises SessionAborted

    def release(self) -> None:
        """Lets the tree the coordinator holds go on; raises what CRIU's step raised after."""
        hold, self._hold = self._hold, None
        if hold is None:
            raise RuntimeError("release without a hold")  # a coordinator's bug, not the user's
        hold.end(release=True)
        if hold.error is not None:
            raise hold.error

    def _drop_hold(self) -> None:
        """abort()'s first step: a held tree is refused (CRIU undoes what it did) and waited for.
        The hold is ended before it is let go: a notification that comes meanwhile (CRIU's
        thread may be on its way to it) finds it refused, never missing (with --stop a missing
        hold would let the member commit and CRIU end the tree)."""
        self._aborted = True
        hold = self._hold
        if hold is not None:
            hold.end(release=False)  # its SessionAborted is this abort's own doing
        self._hold = None

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


class Hold:
    """The handshake between a coordinator and CRIU's thread: the notification where the
    session holds the tree waits in wait_for_release() for the coordinator's decision (or for
    `limit` seconds at most: a coordinator that died must not leave a tree frozen); refused,
    CRIU undoes what it did (thaws a dumped tree, ends a restored one)."""

    def __init__(self, what: str, limit: float, on_expiry: Callable[[], bool] | None = None):
        self.what, self.limit, self.on_expiry = what, limit, on_expiry
        self.held = threading.Event()  # CRIU waits in the notification: the tree is held
        self.decided = threading.Event()
        self.released = False
        self.released_on_expiry = False  # on_expiry let it go on
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what the step raised in the thread

    def start(self, step: Callable[[], object]) -> None:
        self.thread = threading.Thread(target=self._run, args=(step,), name="ckpt-criu", daemon=True)
        self.thread.start()

    def _run(self, step: Callable[[], object]) -> None:
        try:
            step()
        except BaseException as exc:  # handed to release() or wait_until_held() (dropped by abort)
            self.error = exc

    def wait_until_held(self) -> None:
        """Returns once the tree is held; raises the step's error when it ended first."""
        thread = self.thread
        while thread is not None and not self.held.wait(0.05):
            if not thread.is_alive():  # CRIU ended before the notification
                thread.join()
                raise self.error if self.error is not None else RuntimeError("CRIU ended without holding the tree")

    def wait_for_release(self) -> None:
        self.held.set()
        if not self.decided.wait(self.limit):
            if self.on_expiry is not None and self.on_expiry():
                self.released_on_expiry = True
                return
            raise SessionAborted(f"{self.what} for {self.limit:g} s without being released",
                                 hint="the coordinator did not go on; nothing was committed")
        if not self.released:
            raise SessionAborted(f"{self.what} and the coordinator aborted")

    def end(self, release: bool) -> None:
        self.released = release
        self.decided.set()
        if self.thread is not None:
            self.thread.join()
