"""A full restore that writes no pages image: the tree's memory copied in by userfaultfd.

A full restore used to write every page into a staged pages image (a copy of the packs into
fresh page cache: on a VM that hands freed memory back to its host, most of an eager restore's
time), which CRIU then read into the tree (a second copy). Here CRIU restores the tree as for a
lazy restore (its private anonymous memory left out and registered with userfaultfd), but the
userfaultfds come to ckpt instead of CRIU's lazy-pages daemon: CRIU hands them over on the
socket it would connect the daemon by (work_dir/lazy-pages.socket), and in CRIU's post-restore
notification, before any process of the tree runs, ckpt copies every page in from the store
(UFFDIO_COPY from the packs' page cache straight into the tree's memory: one copy, on several
threads), each segment checked against its checksum first. Then it closes the userfaultfds: the
tree runs with all of its memory, and nothing is left running beside it. A damaged segment, or
any failure to copy, fails the notification: CRIU then ends what it restored, and no process
has run on memory that is not the checkpoint's.

The wire format CRIU speaks on that socket (criu/uffd.c, send_uffd and
lazy_pages_finish_restore): per process, its PID (a 32-bit int, negative for a zombie), then
one byte carrying its userfaultfd (SCM_RIGHTS), none for a zombie; after the post-restore
notification, LAZY_PAGES_RESTORE_FINISHED (32 bits). CRIU fails the restore if that last send
fails, so the connection stays open until the restore is over.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import itertools
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ckpt.system.arrays import distinct, np

from ckpt.errors import CriuFailed, DamagedCheckpoint
from ckpt.restore.lazyplan import LazyPlan
from ckpt.store import Store
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.blocks.segments import split_location

if TYPE_CHECKING:
    from ckpt.store.blocks.prefetch import Prefetcher

SOCKET_NAME = "lazy-pages.socket"
_RESTORE_FINISHED = 0x52535446  # "RSTF": criu/uffd.c, LAZY_PAGES_RESTORE_FINISHED
# _IOWR(0xAA, 0x03, struct uffdio_copy) and _IOWR(0xAA, 0x04, struct uffdio_zeropage)
_UFFDIO_COPY = 0xC028AA03
_UFFDIO_ZEROPAGE = 0xC020AA04
_UFFD_MSG = struct.Struct("=BBHI24s")  # struct uffd_msg: event, reserved..., arg (a union)
_EVENT_PAGEFAULT, _EVENT_FORK, _EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 0x12, 0x13, 0x14, 0x15, 0x16
HANDOVER_TIMEOUT_S = 30.0
EAGAIN_LIMIT_S = 10.0
# Threads that copy: UFFDIO_COPY allocates the tree's memory as it copies, which costs most
# (faulting memory back from the hypervisor, here) and scales with cores.
MAX_THREADS = 4


class _UffdioCopy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _UffdioZeropage(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL during the call: threads copy at once


@dataclass
class FillStats:
    pages: int = 0  # copied in
    seconds: float = 0.0  # from the post-restore notification until every page was in
    threads: int = 0
    early_faults: int = 0  # pages the restore touched before the notification (served at once)
    bytes_fetched: int = 0  # from a remote store, ahead of the copy
    store_requests: int = 0

    def to_json(self) -> dict:
        return {"pages": self.pages, "bytes": self.pages * PAGE, "seconds": round(self.seconds, 3),
                "threads": self.threads, "early_faults": self.early_faults, "bytes_fetched": self.bytes_fetched,
                "store_requests": self.store_requests}


@dataclass
class _Work:
    """One run of pages to copy: count pages at vaddr of the process behind fd, which are
    pages within.. of segment key."""
    fd: int
    vaddr: int
    key: int
    within: int
    count: int
    repeated: bool = False  # count times the same page (a page of zeros, mostly: a JVM's touched heap)


class UffdFiller:
    """Stands in for CRIU's lazy-pages daemon during one full restore (see the module's doc);
    uffdlazy.LazyFiller, a lazy restore's daemon, builds on it."""

    def __init__(self, store: Store, plan: LazyPlan, work_dir: Path, checked: set[int] | None = None):
        """checked: segments found intact already (shared: a thread may be checking the others)."""
        self.store, self.plan, self.checked = store, plan, checked
        self.spool_dir = work_dir / "spool"  # a remote store's segments fetched ahead (blocks/prefetch.py)
        self._prefetcher: Prefetcher | None = None  # after a fill from a remote store: its spool, to keep
        self.path = work_dir / SOCKET_NAME
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)
        # Bound through the directory's descriptor: the work directory's own path may be longer
        # than a UNIX socket's address can be (108 bytes). CRIU connects by the relative name
        # from within the directory.
        directory = os.open(work_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.listener.bind(f"/proc/self/fd/{directory}/{SOCKET_NAME}")
        finally:
            os.close(directory)
        self.listener.listen(1)
        self.uffds: dict[int, int] = {}  # the restored PID CRIU names -> its userfaultfd
        self.removed: dict[int, list[tuple[int, int]]] = {}  # ranges the tree gave up before the copy
        self.failure: str | None = None
        self.stats = FillStats()
        self._lock = threading.Condition()
        self._finished = False  # CRIU said the restore is finished, or hung up
        self.restore_finished = False  # CRIU said so (the tree runs once it has)
        self._stop_events = threading.Event()
        self._connection: socket.socket | None = None
        self._receiver = threading.Thread(target=self._receive, name="ckpt-uffd-receiver", daemon=True)
        self._events = threading.Thread(target=self._serve_events, name="ckpt-uffd-events", daemon=True)
        self._receiver.start()
        self._events.start()

    # ---- the userfaultfds, from CRIU ----------------------------------------------------

    def _receive(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return  # closed: the restore ended before CRIU connected
        self._connection = connection
        try:
            while True:
                head = connection.recv(4, socket.MSG_WAITALL)
                if len(head) < 4:
                    break
                (pid,) = struct.unpack("=i", head)
                if pid == _RESTORE_FINISHED:
                    self.restore_finished = True
                    break
                if pid < 0:
                    continue  # a zombie: no memory, no userfaultfd
                _, fds, _, _ = socket.recv_fds(connection, 1, 1)
                if not fds:
                    raise OSError(f"CRIU sent no userfaultfd for PID {pid}")
                for extra in fds[1:]:
                    os.close(extra)
                with self._lock:
                    self.uffds[pid] = fds[0]
                    self._lock.notify_all()
        except OSError as exc:
            with self._lock:
                self.failure = f"the userfaultfds could not be received from CRIU: {exc}"
        finally:
            with self._lock:
                self._finished = True
                self._lock.notify_all()

    def _wait_for_uffds(self) -> None:
        wanted = {pid for pid, (_, runs) in self.plan.runs.items() if any(nr for _, nr, _ in runs)}
        deadline = time.monotonic() + HANDOVER_TIMEOUT_S
        with self._lock:
            while not wanted <= self.uffds.keys():
                remaining = deadline - time.monotonic()
                if self.failure or self._finished or remaining <= 0:
                    missing = sorted(wanted - self.uffds.keys())
                    raise CriuFailed(f"CRIU handed over no userfaultfd for PID(s) {missing[:5]}"
                                     + (f" ({self.failure})" if self.failure else ""),
                                     hint="CKPT_UFFD_FILL=0 restores through a pages image instead")
                self._lock.wait(min(remaining, 0.5))

    # ---- events before the copy: the restore itself touching registered memory -----------

    def _serve_events(self) -> None:
        """Until the copy is done: what the kernel reports on the userfaultfds is read (a
        process that unmaps registered memory waits until it is), and a page the restore
        touches is copied in at once (it would wait for ever otherwise)."""
        reader = None
        try:
            while not self._stop_events.is_set():
                with self._lock:
                    fds = {fd: pid for pid, fd in self.uffds.items()}
                if not fds:
                    self._stop_events.wait(0.02)
                    continue
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(20):
                    try:
                        data = os.read(fd, _UFFD_MSG.size * 16)
                    except BlockingIOError:
                        continue
                    for at in range(0, len(data) - _UFFD_MSG.size + 1, _UFFD_MSG.size):
                        event, _, _, _, arg = _UFFD_MSG.unpack_from(data, at)
                        if reader is None:
                            reader = self.store.blocks.page_reader()
                        try:
                            self._event(fds[fd], fd, event, arg, reader)
                        except Exception as exc:  # noqa: BLE001 - fails the notification (fill)
                            # Recorded, and served on: a process left waiting on its fault
                            # would keep CRIU from ever reaching the post-restore notification
                            # (a damaged segment under an early fault hung the restore for good).
                            # The tree never runs: fill() fails the notification for it.
                            with self._lock:
                                self.failure = self.failure or f"serving the restore's own page faults failed: {exc}"
                            _unblock(fd, event, arg)
        except OSError as exc:
            with self._lock:
                self.failure = self.failure or f"serving the restore's own page faults failed: {exc}"
        finally:
            if reader is not None:
                reader.close()

    def _event(self, pid: int, fd: int, event: int, arg: bytes, reader) -> None:
        if event == _EVENT_PAGEFAULT:
            _, address = struct.unpack_from("=QQ", arg)
            self._copy_page(pid, fd, address & ~(PAGE - 1), reader)
            self.stats.early_faults += 1
        elif event in (_EVENT_REMOVE, _EVENT_UNMAP):
            start, end = struct.unpack_from("=QQ", arg)
            with self._lock:
                self.removed.setdefault(pid, []).append((start, end))
        else:  # a fork or a move of memory: nothing of the tree may run yet
            raise ValueError(f"unexpected userfaultfd event {event:#x} of PID {pid} before the tree ran")

    def _copy_page(self, pid: int, fd: int, address: int, reader) -> None:
        image_runs = self.plan.runs.get(pid)
        if image_runs is not None:
            image, runs = image_runs
            for vaddr, nr_pages, first in runs:
                if vaddr <= address < vaddr + nr_pages * PAGE:
                    location = self.plan.locations[image][first + (address - vaddr) // PAGE]
                    key, within = split_location(location)
                    with reader.reader.view(key, within, 1) as page:
                        _copy(fd, address, page, 1)
                    return
        zero = _UffdioZeropage(address, PAGE, 0, 0)  # not in the checkpoint: a page of zeros
        if _libc.ioctl(fd, ctypes.c_ulong(_UFFDIO_ZEROPAGE), ctypes.byref(zero)) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EEXIST, errno.ENOENT, errno.ESRCH):
                raise OSError(code, os.strerror(code))

    # ---- the copy, in the post-restore notification --------------------------------------

    def fill(self, progress: Callable[[int, int], None] | None = None) -> FillStats:
        """Copies every lazy page of the plan into the tree (none of it runs yet); raises
        CriuFailed (the restore is then aborted) if any could not be. progress(pages copied,
        pages in all) is called from this thread a few times a second."""
        started = time.monotonic()
        self._wait_for_uffds()
        work = self._work()
        threads = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(work)))
        # Each segment is read, checked and decoded by one thread: a thread per share of segments.
        shares: list[list[_Work]] = [[] for _ in range(threads)]
        for item in work:
            shares[item.key % threads].append(item)
        errors = self._copy_shares(shares, progress)
        self._stop_events.set()
        self._events.join()
        self.stats.seconds = time.monotonic() - started
        if errors or self.failure:
            first = errors[0] if errors else None
            if isinstance(first, DamagedCheckpoint):
                raise first
            raise CriuFailed(f"the tree's memory could not be copied in: {first or self.failure}",
                             hint="CKPT_UFFD_FILL=0 restores through a pages image instead")
        self._close_uffds()
        return self.stats

    def _copy_shares(self, shares: list[list[_Work]], progress: Callable[[int, int], None] | None
                     ) -> list[BaseException]:
        """Each share copied by a thread of its own; returns what failed."""
        errors: list[BaseException] = []
        copied = [0] * len(shares)
        # Each share's runs by segment: each segment's pages taken once (checked, decoded or
        # mapped) for every run in it. Per run, that bookkeeping cost a 100-process tree's
        # fill (7,200 runs) as much thread time as the copies did.
        by_segment = [[list(runs) for _, runs in itertools.groupby(sorted(share, key=attrgetter("key", "within")),
                                                                     key=attrgetter("key"))]
                      for share in shares]
        readers, prefetcher = self.store.blocks.page_readers(len(shares), _fetch_order(by_segment), self.spool_dir,
                                                             self.checked, _pages_wanted(by_segment))

        given_up = threading.Event()

        def copy_share(k: int) -> None:
            reader = readers[k]
            try:
                for runs in by_segment[k]:
                    if given_up.is_set():
                        return
                    _copy_segment(reader, runs)
                    copied[k] += sum(item.count for item in runs)
            except BaseException as exc:  # noqa: BLE001 - reported by fill(), in the notification
                errors.append(exc)
            finally:
                reader.close()

        runners = [threading.Thread(target=copy_share, args=(k,), name=f"ckpt-uffd-fill-{k}")
                   for k in range(len(shares))]
        for runner in runners:
            runner.start()
        total = sum(item.count for share in shares for item in share)
        try:
            _join(runners, given_up, lambda: progress(sum(copied), total) if progress is not None else None)
        except BaseException:
            if prefetcher is not None:
                prefetcher.close()
            raise
        if prefetcher is not None:
            self.stats.bytes_fetched, self.stats.store_requests = prefetcher.stats.bytes, prefetcher.stats.requests
            if errors or self.failure:
                prefetcher.close()
            else:  # kept whole in the cache in close(), once the tree runs (as a lazy restore's)
                self._prefetcher = prefetcher
        self.stats.pages, self.stats.threads = sum(copied), len(shares)
        return errors

    def _work(self) -> list[_Work]:
        """The plan's lazy pages as runs within one segment and one mapping each (UFFDIO_COPY
        fails for a range across two mappings, and a pagemap entry may cross one), minus what
        the restore gave up."""
        work: list[_Work] = []
        for pid, (image, runs) in self.plan.runs.items():
            fd = self.uffds.get(pid)
            if fd is None or not runs:  # (a tree's root restored from its image sends its uffd too)
                continue
            locations = self.plan.locations[image]
            removed = self.removed.get(pid, [])
            bounds = _mapping_bounds(pid)
            for vaddr, nr_pages, first in runs:
                here = locations[first:first + nr_pages]
                for begin, end, repeated in run_pieces(vaddr, here, bounds):
                    address = vaddr + begin * PAGE
                    if any(start < address + (end - begin) * PAGE and address < stop for start, stop in removed):
                        continue  # unmapped or dropped by the restore: nothing to put back
                    key, within = split_location(int(here[begin]))
                    work.append(_Work(fd, address, key, within, end - begin, repeated))
        return work

    # ---- the end -------------------------------------------------------------------------

    def _close_uffds(self) -> None:
        """Every page is in: the userfaultfds let go (the kernel unregisters the memory)."""
        with self._lock:
            fds, self.uffds = list(self.uffds.values()), {}
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """After the restore (or its failure): nothing of this filler is left."""
        self._stop_events.set()
        # shutdown() first: close() alone would not wake the receiver out of accept() or recv().
        for sock in (self.listener, self._connection):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # never connected, or CRIU hung up already
        try:
            self.listener.close()
        finally:
            if self._connection is not None:
                self._connection.close()
            self._receiver.join(timeout=5)
            self._events.join(timeout=5)
            self._close_uffds()
            self.path.unlink(missing_ok=True)
            prefetcher, self._prefetcher = self._prefetcher, None
            if prefetcher is not None:
                try:
                    prefetcher.keep_in(self.store.backend)
                finally:
                    prefetcher.close()


def _unblock(fd: int, event: int, arg: bytes) -> None:
    """After an event could not be served (the restore fails): what lets the process go on
    to CRIU's post-restore notification, where the restore is failed: a zero page where it
    faulted (never seen by the tree, which CRIU then ends); a forked child's descriptor closed."""
    if event == _EVENT_PAGEFAULT:
        _, address = struct.unpack_from("=QQ", arg)
        zero = _UffdioZeropage(address & ~(PAGE - 1), PAGE, 0, 0)
        _libc.ioctl(fd, ctypes.c_ulong(_UFFDIO_ZEROPAGE), ctypes.byref(zero))  # EEXIST etc.: nothing waits
    elif event == _EVENT_FORK:
        (child,) = struct.unpack_from("=I", arg)
        try:
            os.close(child)
        except OSError:
            pass


def _join(runners: list[threading.Thread], given_up: threading.Event, progress: Callable[[], None]) -> None:
    """Waits for the copying threads, telling progress a few times a second. Interrupted
    (Ctrl-C), it has them stop first: the prefetcher's spool and the userfaultfds are not
    closed under them (a descriptor's number, reused, could name another file by then)."""
    try:
        for runner in runners:
            while runner.is_alive():
                runner.join(0.2)
                progress()
    except BaseException:
        given_up.set()
        for runner in runners:
            runner.join()
        raise


# Up to this many pages, a run is cut in pieces page by page in Python: numpy's calls cost
# more for the short runs a forked worker's own pages come in (the pages of its parent's heap
# that it dirtied: 100 workers, tens of thousands of runs).
SHORT_RUN = 32


def run_pieces(vaddr: int, here: list[int], bounds: list[int]) -> list[tuple[int, int, bool]]:
    """A run of pages at vaddr whose locations are here, cut into the pieces [begin, end) one
    UFFDIO_COPY each can take: pages at consecutive locations within one mapping (bounds: the
    mappings' sorted starts and ends); single pages of one location that follow each other
    merged into one repeated piece (see _merged_repeats)."""
    nr_pages = len(here)
    if not nr_pages:
        return []
    inside = bounds[bisect.bisect_right(bounds, vaddr):bisect.bisect_left(bounds, vaddr + nr_pages * PAGE)]
    at_bound = {(bound - vaddr) // PAGE for bound in inside}  # positions in the run where a mapping begins
    if nr_pages <= SHORT_RUN:
        return _short_run_pieces(here, at_bound)
    located = np.asarray(here, dtype=np.int64)
    pages = np.arange(nr_pages + 1)
    starts = distinct(np.concatenate(([0], pages[1:-1][np.diff(located) != 1],
                                       np.fromiter(at_bound, dtype=np.int64), [nr_pages])))
    return _merged_repeats(starts, located, at_bound)


def _short_run_pieces(here: list[int], at_bound: set[int]) -> list[tuple[int, int, bool]]:
    """run_pieces of a short run, page by page (the same pieces)."""
    pieces: list[tuple[int, int, bool]] = []
    begin = 0
    for page in range(1, len(here) + 1):
        if page < len(here) and page not in at_bound and here[page] == here[page - 1] + 1:
            continue
        if pieces and page - begin == 1 and begin not in at_bound:
            last_begin, last_end, repeated = pieces[-1]
            if (last_end - last_begin == 1 or repeated) and here[begin] == here[last_begin]:
                pieces[-1] = (last_begin, page, True)
                begin = page
                continue
        pieces.append((begin, page, False))
        begin = page
    return pieces


def _merged_repeats(starts: np.ndarray, here: np.ndarray, bounds: set[int]) -> list[tuple[int, int, bool]]:
    """The pieces [begin, end) of a run cut at starts, with the single pages of one location
    that follow each other (a page of zeros repeated: each one a piece of its own) merged into
    one piece (repeated=True), never across a mapping's bound (a position in bounds)."""
    pieces: list[tuple[int, int, bool]] = []
    for begin, end in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        if pieces and end - begin == 1 and begin not in bounds:
            last_begin, last_end, _ = pieces[-1]
            if last_end == begin and (last_end - last_begin == 1 or pieces[-1][2]) and here[begin] == here[last_begin]:
                pieces[-1] = (last_begin, end, True)
                continue
        pieces.append((begin, end, False))
    return pieces


def _mapping_bounds(pid: int) -> list[int]:
    """Where the restored process's mappings begin and end (the kernel's, as they are now), sorted."""
    bounds: list[int] = []
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            for line in maps:
                start, _, end = line.split(b" ", 1)[0].partition(b"-")
                if int(end, 16) < 1 << 63:  # not [vsyscall], which is no memory of the tree's
                    bounds += (int(start, 16), int(end, 16))
    except OSError:
        pass  # exited already (a lazy restore's tree runs): nothing to cut, nothing to copy
    return sorted(set(bounds))


def _fetch_order(by_segment: list[list[list[_Work]]]) -> list[int]:
    """A remote store's segments come down ahead, in large parallel requests, in the order the
    threads will copy them (round the shares); a local store's are read in place."""
    return [runs[0].key for round_ in itertools.zip_longest(*by_segment) for runs in round_ if runs is not None]


def _pages_wanted(by_segment: list[list[list[_Work]]]) -> dict[int, int]:
    """The pages each segment is read for (Prefetcher.lend): each share reads a segment's
    pages once, from its first run's to its last's, for all its runs there (_copy_segment)."""
    wanted: dict[int, int] = collections.Counter()
    for runs in itertools.chain.from_iterable(by_segment):
        wanted[runs[0].key] += _span(runs)[1] - runs[0].within
    return wanted


def _span(runs: list[_Work]) -> tuple[int, int]:
    """The pages [first, end) of their segment that runs (in order, all in one segment) take."""
    return runs[0].within, max(item.within + (1 if item.repeated else item.count) for item in runs)


def _copy_segment(reader, runs: list[_Work]) -> None:
    """Copies runs (all within one segment, in order) into the tree: the segment's pages read
    once, each run copied from its place among them."""
    first, end = _span(runs)
    with reader.reader.borrowed(runs[0].key, first, end - first) as pages:
        source = np.frombuffer(pages, dtype=np.uint8)
        try:
            base = source.ctypes.data
            for item in runs:
                offset = (item.within - first) * PAGE
                if item.repeated:
                    with pages[offset:offset + PAGE] as page:
                        _copy_repeated(item.fd, item.vaddr, page, item.count)
                else:
                    _copy_from(item.fd, item.vaddr, base + offset, item.count * PAGE)
        finally:
            del source  # (see _copy: the mapping must not stay exported)


def _copy(fd: int, dst: int, pages: memoryview, count: int) -> None:
    """UFFDIO_COPY of count pages to dst: a page the tree has already (the restore touched it
    and it was served) is skipped, a process gone gets nothing; any other failure raises."""
    source = np.frombuffer(pages, dtype=np.uint8)
    try:
        _copy_from(fd, dst, source.ctypes.data, count * PAGE)
    finally:
        # An exception's traceback keeps this frame: the array would keep the mapping exported,
        # and neither the view nor the pack's mapping could be released.
        del source


_ZEROS = bytes(PAGE)


def _copy_repeated(fd: int, dst: int, page: memoryview, count: int) -> None:
    """count copies of one page to dst: pages of zeros as the zero page (UFFDIO_ZEROPAGE, one
    call, no memory taken until the tree writes there), any other page copied count times."""
    content = bytes(page)
    if content == _ZEROS:
        _copy_from(fd, dst, 0, count * PAGE, zeros=True)
        return
    with memoryview(content * count) as pages:
        _copy(fd, dst, pages, count)


def _copy_from(fd: int, dst: int, src: int, length: int, zeros: bool = False) -> None:
    stalled_since = None
    while length > 0:
        code, done = copy_once(fd, dst, src, length, zeros)
        if not code:
            return
        if code == errno.EEXIST and done == 0:
            done = PAGE  # this page is there already
        elif code == errno.ESRCH:
            return  # the process is gone
        elif code == errno.EAGAIN and done == 0:
            # The memory's layout is changing: an event waits to be read (by _serve_events).
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > EAGAIN_LIMIT_S:
                raise OSError(code, f"UFFDIO_COPY at {dst:#x} could not go on for {EAGAIN_LIMIT_S:.0f} s")
            time.sleep(0.001)
            continue
        elif code not in (errno.EAGAIN, errno.EEXIST):
            raise OSError(code, f"UFFDIO_COPY at {dst:#x}: {os.strerror(code)}")
        stalled_since = None
        dst, src, length = dst + done, src + done, length - done


def copy_once(fd: int, dst: int, src: int, length: int, zeros: bool = False) -> tuple[int, int]:
    """One UFFDIO_COPY of length bytes from src to dst (zeros: UFFDIO_ZEROPAGE, no src) into
    the process behind fd; returns (0, length) or (the errno that stopped it, bytes done before)."""
    if zeros:
        zero = _UffdioZeropage(dst, length, 0, 0)
        failed = _libc.ioctl(fd, ctypes.c_ulong(_UFFDIO_ZEROPAGE), ctypes.byref(zero)) != 0
        result = zero.zeropage
    else:
        request = _UffdioCopy(dst, src, length, 0, 0)
        failed = _libc.ioctl(fd, ctypes.c_ulong(_UFFDIO_COPY), ctypes.byref(request)) != 0
        result = request.copy
    return (ctypes.get_errno(), max(int(result), 0)) if failed else (0, length)
