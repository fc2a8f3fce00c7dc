"""ckpt's own lazy-pages daemon: a lazy restore's memory copied in while the tree runs.

CRIU's lazy-pages daemon (criu/uffd.c) keeps one request for pages in flight per process,
grows it from 64 KiB to 4 MiB and drops back to 64 KiB at every fault, and copies each answer
out of a socket: its last page came in at 3.7 times raw CRIU's whole restore, however fast the
page server. Here the page server's process is the daemon. It takes the userfaultfds as a full
restore's fill does (uffdfill.UffdFiller: CRIU hands them over on work_dir/lazy-pages.socket),
serves what the restorer itself touches, and once CRIU says the restore is finished (the tree
runs from then on) it copies every page in from the packs with UFFDIO_COPY on several threads,
while one thread serves the tree's page faults first and follows what the tree does to its
memory meanwhile, as the kernel reports it on each userfaultfd:

- FORK: the child's new userfaultfd comes with the event; the child misses what its parent
  missed when it forked, so it gets a copy of the parent's runs still to copy;
- REMAP (mremap): the runs in the moved range move with it;
- UNMAP, REMOVE (munmap, madvise(MADV_DONTNEED)): the runs in that range are dropped (the
  tree must read zeros there, never the checkpoint's bytes); a REMOVE's range is unregistered
  too, as CRIU does, so the tree's next touch there is an ordinary fault.

A page the tree faults on is copied with a few pages around it from its run; a fault where no
run is left (memory never in the checkpoint, or dropped) gets the zero page.

Why each process has a gate: the kernel changes the memory behind such an event only after the
event is read, and makes a copy that starts meanwhile fail with EAGAIN (mmap_changing). A copy
already under way when the event comes could still put the checkpoint's bytes into a range the
tree has just dropped, once the kernel zaps it. So a process's userfaultfd is read only when no
copy into that process is under way (the gate's exclusive side; copies take its shared side),
and a copy looks its run up again under the gate: a run dropped or moved meanwhile is never
copied to where it was. Its bytes are read (fetched, checked, decoded) before the gate: the
process's faults and events never wait for a download of the background fill. A run is
forgotten only once its copy has returned, so a fault read after it finds the page in place
(EEXIST), and one read before finds the run and copies it.

A run that fails with ENOENT crosses two mappings (the tree split one since the restore, with
mprotect): it is halved until each piece lies in one; a single page that still fails has no
registered mapping left (nothing to put back). ESRCH: the process has exited.

The watcher (lazywatch.py) holds a copy of each userfaultfd, as it held CRIU's daemon's: if
this process dies before every page is in, the tree waits in its faults and is killed, never
run on memory that reads as zeros.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import errno
import itertools
import os
import select
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.system.arrays import distinct, np

from ckpt.errors import CriuFailed
from ckpt.restore.lazyplan import LazyPlan, needed_segments, pages_by_segment
from ckpt.restore.uffdfill import (
    _EVENT_FORK,
    _EVENT_PAGEFAULT,
    _EVENT_REMAP,
    _EVENT_REMOVE,
    _EVENT_UNMAP,
    _UFFD_MSG,
    _UFFDIO_ZEROPAGE,
    EAGAIN_LIMIT_S,
    MAX_THREADS,
    UffdFiller,
    copy_once,
    _libc,
    _mapping_bounds,
    _merged_repeats,
    _UffdioZeropage,
)
from ckpt.store import Store
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.blocks.segments import split_location

if TYPE_CHECKING:
    from ckpt.store.blocks.prefetch import Prefetcher

# _IOR(0xAA, 0x01 / 0x02, struct uffdio_range)
_UFFDIO_UNREGISTER = 0x8010AA01
_UFFDIO_WAKE = 0x8010AA02
FAULT_PAGES = 16  # copied around a faulting page at once: the tree waits for these, the rest follows
RESTORE_TIMEOUT_S = 600.0  # CRIU restoring the tree (before its notification that it is done)
_ZEROS = bytes(PAGE)

# A run: (vaddr, pages, segment key, first page within the segment, repeated: one page `pages` times)
Run = tuple[int, int, int, int, bool]


def _piece(run: Run, first: int, count: int) -> Run:
    vaddr, _, key, within, repeated = run
    return vaddr + first * PAGE, count, key, within if repeated else within + first, repeated


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Gate:
    """Copies into one process at once (shared), or its userfaultfd read (exclusive, first)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._copying = 0
        self._reading = False

    def enter_copy(self) -> None:
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._copying += 1

    def leave_copy(self) -> None:
        with self._cond:
            self._copying -= 1
            if not self._copying:
                self._cond.notify_all()

    def enter_read(self) -> None:
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._reading = True
            while self._copying:
                self._cond.wait()

    def leave_read(self) -> None:
        with self._cond:
            self._reading = False
            self._cond.notify_all()


class _Memory:
    """One process's memory still to copy in: its userfaultfd and its runs (by address), and
    hints of where the copying threads should look (per share of segments, in address order).
    A hint may be stale: the run is looked up again under the gate. Changed under the daemon's
    lock only."""

    def __init__(self, fd: int, pid: int | None, runs: list[Run], shares: int):
        self.fd, self.pid = fd, pid
        self.gate = _Gate()
        self.runs: dict[int, Run] = {run[0]: run for run in runs}
        self.starts = sorted(self.runs)
        self.hints: list[collections.deque[int]] = [collections.deque() for _ in range(shares)]
        for start in self.starts:
            self.hints[self.runs[start][2] % shares].append(start)
        self.closed = False
        self.gone = False  # exited: every copy fails with ESRCH

    @property
    def complete(self) -> bool:
        return not self.runs

    def find(self, address: int) -> Run | None:
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        run = self.runs[self.starts[i]]
        return run if address < run[0] + run[1] * PAGE else None

    def replace(self, run: Run, pieces: list[Run]) -> None:
        """run (as it is now) becomes pieces (within its range): every piece gets a hint."""
        if self.runs.get(run[0]) != run:
            return
        del self.runs[run[0]]
        del self.starts[bisect.bisect_left(self.starts, run[0])]
        for piece in pieces:
            self.add(piece)

    def add(self, run: Run) -> None:
        if run[1] <= 0:
            return
        self.runs[run[0]] = run
        bisect.insort(self.starts, run[0])
        self.hints[run[2] % len(self.hints)].append(run[0])

    def overlapping(self, start: int, end: int) -> list[Run]:
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        found = []
        while i < len(self.starts) and self.starts[i] < end:
            run = self.runs[self.starts[i]]
            if run[0] + run[1] * PAGE > start:
                found.append(run)
            i += 1
        return found

    def cut(self, start: int, end: int) -> list[Run]:
        """Drops [start, end) from the runs; returns what was inside (as pieces)."""
        inside = []
        for run in self.overlapping(start, end):
            vaddr, count = run[0], run[1]
            first = max(0, (start - vaddr) // PAGE)
            stop = min(count, (end - vaddr + PAGE - 1) // PAGE)
            self.replace(run, [_piece(run, 0, first), _piece(run, stop, count - stop)])
            inside.append(_piece(run, first, stop - first))
        return inside

    def move(self, source: int, destination: int, length: int) -> None:
        shift = destination - source
        for piece in self.cut(source, source + length):
            self.add((piece[0] + shift, *piece[1:]))

    def drop_all(self) -> None:
        self.runs.clear()
        self.starts.clear()


class LazyFiller(UffdFiller):
    """The daemon of one lazy restore, in its page server's process (see the module's doc)."""

    def __init__(self, store: Store, plan: LazyPlan, work_dir: Path, spool_dir: Path,
                 threads: int | None = None):
        """Listens on work_dir/lazy-pages.socket from now on; run() then fetches a remote
        store's segments ahead into spool_dir, beside CRIU's restore."""
        self.threads = max(1, threads or min(MAX_THREADS, os.cpu_count() or 1))
        self.memories: list[_Memory] = []
        self.served = 0  # pages copied in (a page the tree dropped or had already is not)
        self.copies = 0  # UFFDIO_COPY and UFFDIO_ZEROPAGE calls
        self.faults = 0
        self.forks = 0
        self.last_page_at: float | None = None  # time.monotonic() once every page was in
        self._state = threading.Condition()  # the memories' runs and hints, and the end
        self._failure: BaseException | None = None
        self._quit = threading.Event()
        self._filling = False
        # One reader for the events thread, one per copying thread; one prefetcher feeds them
        # all (made by prepare).
        self._readers: list = []
        self.prefetcher: Prefetcher | None = None
        self._prepared = threading.Event()
        self._spool_dir = spool_dir
        super().__init__(store, plan, work_dir)  # the receiver and the events thread start

    def prepare(self) -> None:
        """The readers and the prefetcher, before run() and once CRIU may connect: the segments
        the plan needs are looked up while CRIU begins the restore (from S3 they took 0.03-0.1 s
        before the daemon said it listened)."""
        self._readers, self.prefetcher = self.store.blocks.page_readers(
            self.threads + 1, needed_segments(self.plan), self._spool_dir, pages_wanted=pages_by_segment(self.plan))
        self._prepared.set()

    # ---- the run of the daemon -------------------------------------------------------------

    def run(self) -> None:
        """After prepare(): serves the restore and then the tree until every page is in; raises
        on failure (the tree must not run on: the caller tells the watcher)."""
        try:
            self._wait_for_restore()
            self._adopt()
            self._cut_at_mappings()
            fillers = [threading.Thread(target=self._guarded, args=(self._fill, self._readers[k + 1], k),
                                        name=f"ckpt-lazy-fill-{k}") for k in range(self.threads)]
            with self._state:
                self._filling = True
            for filler in fillers:
                filler.start()
            for filler in fillers:
                filler.join()
            self._events.join()
        except BaseException:
            self._quit.set()
            raise
        if self._failure is not None:
            raise self._failure
        self.last_page_at = time.monotonic()
        self._prefetcher = self.prefetcher  # close() keeps the spooled packs in the cache

    def _wait_for_restore(self) -> None:
        """Until CRIU says the restore is finished (every process registered, the tree about to run)."""
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        with self._lock:
            while not self._finished and self._failure is None:
                if time.monotonic() > deadline:
                    raise CriuFailed(f"CRIU did not finish the restore in {RESTORE_TIMEOUT_S:.0f} s")
                self._lock.wait(0.5)
        if self._failure is not None:
            raise self._failure
        if not self.restore_finished:
            raise CriuFailed(self.failure or "CRIU ended the restore before it was finished")

    def _adopt(self) -> None:
        """The userfaultfds CRIU handed over since last time: a memory each, with the plan's runs."""
        with self._lock:
            received, self.uffds = self.uffds, {}
        with self._state:
            for pid, fd in received.items():
                self.memories.append(_Memory(fd, pid, _plan_runs(self.plan, pid), self.threads))

    def _cut_at_mappings(self) -> None:
        """Runs cut where the processes' mappings begin and end (one copy cannot cross two,
        and a pagemap entry may): what ENOENT would otherwise find out run by run."""
        for memory in list(self.memories):
            bounds = _mapping_bounds(memory.pid) if memory.pid is not None else []
            with self._state:
                for bound in bounds:
                    run = memory.find(int(bound))
                    if run is not None and run[0] < bound:
                        first = (int(bound) - run[0]) // PAGE
                        memory.replace(run, [_piece(run, 0, first), _piece(run, first, run[1] - first)])

    def _guarded(self, work, *args) -> None:
        try:
            work(*args)
        except BaseException as exc:  # noqa: BLE001 - any failure ends the daemon; run() raises it
            with self._state:
                self._failure = self._failure or exc
                self._state.notify_all()
            with self._lock:
                self._lock.notify_all()
            self._quit.set()

    # ---- the copying threads ---------------------------------------------------------------

    def _fill(self, reader, share: int) -> None:
        while not self._quit.is_set():
            found = self._next_hint(share)
            if found is None:
                return
            memory, start = found
            # No hint: a run is being copied by another thread. EAGAIN: an event is to be read first.
            if start is None or self._copy_run(memory, start, reader) == errno.EAGAIN:
                time.sleep(0.0005)

    def _next_hint(self, share: int) -> tuple[_Memory, int | None] | None:
        """A process and the start of a run to copy there (own share first, then any), or
        (a process, None) when runs are left but no hint now, or None when all is done."""
        with self._state:
            waiting = None
            for memory in self.memories:
                if memory.complete or memory.gone:
                    continue
                for k in itertools.chain((share,), range(len(memory.hints))):
                    if memory.hints[k]:
                        return memory, memory.hints[k].popleft()
                waiting = memory
            if waiting is None:
                self._state.notify_all()
                return None
            return waiting, None

    def _copy_run(self, memory: _Memory, start: int, reader) -> int:
        with self._state:
            run = None if memory.closed else memory.runs.get(start)
        if run is None:
            return 0
        # The run's bytes are read (fetched from a remote store, checked, decoded) before the
        # gate is entered: the process's faults and events, which wait for the copies under
        # way, never wait for a download or a decode of the background fill.
        with _source(run, reader) as source:
            memory.gate.enter_copy()
            try:
                with self._state:
                    unchanged = not memory.closed and memory.runs.get(start) == run
                # Changed meanwhile (a fault took part of it, an event moved or dropped it):
                # what is left of it was added with a hint of its own.
                return self._put_run(memory, run, source) if unchanged else 0
            finally:
                memory.gate.leave_copy()

    def _put_run(self, memory: _Memory, run: Run, source: tuple[int, bool]) -> int:
        """Copies run in from source (see _source); returns the errno that stopped it (0: all of it is in)."""
        placed, done, code = _place(memory.fd, run[0], source[0], run[1] * PAGE, zeros=source[1])
        with self._state:
            self.served += placed // PAGE
            self.copies += 1
            count = run[1]
            rest = count - done // PAGE
            if code == errno.ENOENT:
                if rest > 1:  # across two mappings (one split since the restore): halved
                    at, half = count - rest, rest // 2
                    memory.replace(run, [_piece(run, at, half), _piece(run, at + half, rest - half)])
                else:  # no registered mapping there any more
                    memory.replace(run, [])
            elif code in (errno.ESRCH, errno.ENOSPC):
                memory.gone = True
                memory.drop_all()
            else:  # EAGAIN: the rest is tried again (no time limit here: the events thread,
                # which lets it go on, may wait for a stalled store; if it dies, all stops)
                memory.replace(run, [_piece(run, count - rest, rest)] if rest else [])
        return code

    # ---- the events thread -----------------------------------------------------------------

    def _serve_events(self) -> None:  # the thread UffdFiller starts
        while not self._prepared.wait(0.05):  # (a fault meanwhile waits for it)
            if self._quit.is_set():
                return
        self._guarded(self._serve, self._readers[0])

    def _serve(self, reader) -> None:
        while not self._quit.is_set():
            self._adopt()
            with self._state:
                open_ = [memory for memory in self.memories if not memory.closed]
                if not open_ and self._filling:
                    return
            if not open_:
                time.sleep(0.005)
                continue
            poller = select.poll()
            by_fd = {}
            for memory in open_:
                poller.register(memory.fd, select.POLLIN)
                by_fd[memory.fd] = memory
            for fd, _ in poller.poll(10):
                self._drain(by_fd[fd], reader)
            if self._filling:  # (before: the runs are not cut at the mappings yet)
                for memory in open_:
                    if memory.complete or memory.gone:
                        self._drain(memory, reader, then_close=True)

    def _drain(self, memory: _Memory, reader, then_close: bool = False) -> None:
        """Reads and serves what the kernel reports on memory's userfaultfd, with no copy into
        that process under way; then_close: and lets it go once nothing is left to copy."""
        memory.gate.enter_read()
        try:
            waiting: list[int] = []  # faults whose copy met EAGAIN: an event is still to read
            deadline = time.monotonic() + EAGAIN_LIMIT_S
            while True:
                if self._read_messages(memory, reader, waiting):
                    deadline = time.monotonic() + EAGAIN_LIMIT_S  # (serving may have waited for the store)
                waiting = [address for address in waiting if not self._serve_fault(memory, address, reader)]
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    raise OSError(errno.EAGAIN, f"a page fault at {waiting[0]:#x} could not be served "
                                                f"for {EAGAIN_LIMIT_S:.0f} s")
                time.sleep(0.0005)
            with self._state:
                if then_close and (memory.complete or memory.gone) and not memory.closed:
                    memory.closed = True
                    os.close(memory.fd)
        finally:
            memory.gate.leave_read()
        with self._state:
            self._state.notify_all()

    def _read_messages(self, memory: _Memory, reader, waiting: list[int]) -> bool:
        """Serves what is to read now (faults met by EAGAIN go to waiting); whether there was any."""
        read = False
        while True:
            try:
                data = os.read(memory.fd, _UFFD_MSG.size * 32)
            except BlockingIOError:
                return read
            if not data:
                return read
            read = True
            for at in range(0, len(data) - _UFFD_MSG.size + 1, _UFFD_MSG.size):
                event, _, _, _, arg = _UFFD_MSG.unpack_from(data, at)
                if event == _EVENT_PAGEFAULT:
                    address = struct.unpack_from("=QQ", arg)[1] & ~(PAGE - 1)
                    self.faults += 1
                    if not self._serve_fault(memory, address, reader):
                        waiting.append(address)
                else:
                    self._follow(memory, event, arg)

    def _follow(self, memory: _Memory, event: int, arg: bytes) -> None:
        """What the tree did to its memory (see the module's doc)."""
        with self._state:
            if event == _EVENT_FORK:
                (child_fd,) = struct.unpack_from("=I", arg)
                child = _Memory(child_fd, None, list(memory.runs.values()), self.threads)
                self.memories.append(child)
                self.forks += 1
            elif event == _EVENT_REMAP:
                source, destination, length = struct.unpack_from("=QQQ", arg)
                memory.move(source, destination, length)
            elif event in (_EVENT_REMOVE, _EVENT_UNMAP):
                start, end = struct.unpack_from("=QQ", arg)
                memory.cut(start, end)
                if event == _EVENT_REMOVE:
                    # The mapping stays: unregistered, its next touch is an ordinary fault (zeros).
                    span = _Range(start, end - start)
                    if _libc.ioctl(memory.fd, ctypes.c_ulong(_UFFDIO_UNREGISTER), ctypes.byref(span)) != 0:
                        if ctypes.get_errno() == errno.ENOMEM:  # the process has exited
                            memory.gone = True
                            memory.drop_all()
            else:
                raise OSError(errno.EINVAL, f"unexpected userfaultfd event {event:#x}")

    def _serve_fault(self, memory: _Memory, address: int, reader) -> bool:
        """The pages around address copied in (the zero page where no run is left); False:
        EAGAIN, to be tried again once the event behind it is read."""
        with self._state:
            run = memory.find(address)
            if run is not None:  # FAULT_PAGES of it, from the faulting page on
                vaddr, count = run[0], run[1]
                first = (address - vaddr) // PAGE
                take = min(FAULT_PAGES, count - first)
                piece = _piece(run, first, take)
                memory.replace(run, [_piece(run, 0, first), piece, _piece(run, first + take, count - first - take)])
                run = memory.runs.get(address)
        if run is None:
            return self._zero_page(memory, address)
        with _source(run, reader) as source:
            code = self._put_run(memory, run, source)
        if code == errno.ENOENT:
            return self._serve_fault(memory, address, reader)  # halved: the faulting page's half again
        return code != errno.EAGAIN

    def _zero_page(self, memory: _Memory, address: int) -> bool:
        zero = _UffdioZeropage(address, PAGE, 0, 0)
        if _libc.ioctl(memory.fd, ctypes.c_ulong(_UFFDIO_ZEROPAGE), ctypes.byref(zero)) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EAGAIN:
            return False
        if code == errno.ENOENT:  # no registered mapping there now: the thread faults again, normally
            span = _Range(address, PAGE)
            _libc.ioctl(memory.fd, ctypes.c_ulong(_UFFDIO_WAKE), ctypes.byref(span))
        elif code not in (errno.EEXIST, errno.ESRCH, errno.ENOSPC):
            raise OSError(code, f"UFFDIO_ZEROPAGE at {address:#x}: {os.strerror(code)}")
        return True

    # ---- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """After run() (or its failure): nothing of this daemon is left but the packs it kept
        in the cache (after a success). The tree is the watcher's to end on a failure."""
        self._quit.set()
        self._events.join(timeout=5)
        for reader in self._readers:
            reader.close()
        with self._state:
            for memory in self.memories:
                if not memory.closed:
                    memory.closed = True
                    os.close(memory.fd)
        try:
            super().close()
        finally:
            if self.prefetcher is not None and self._prefetcher is None:  # failed: nothing kept
                self.prefetcher.close()


def _plan_runs(plan: LazyPlan, pid: int) -> list[Run]:
    """A process's lazy pages in the plan, as runs within one segment each (repeated pages
    merged, as uffdfill's fill does)."""
    image_runs = plan.runs.get(pid)
    if image_runs is None:
        return []
    image, entries = image_runs
    if not entries:  # no lazy page (nor any location) in this process
        return []
    locations = plan.locations[image]
    runs: list[Run] = []
    for vaddr, nr_pages, first in entries:
        if not nr_pages:
            continue
        here = np.asarray(locations[first:first + nr_pages], dtype=np.int64)
        pages = np.arange(nr_pages + 1)
        starts = distinct(np.concatenate(([0], pages[1:-1][np.diff(here) != 1], [nr_pages])))
        for begin, end, repeated in _merged_repeats(starts, here, set()):
            key, within = split_location(int(here[begin]))
            runs.append((vaddr + begin * PAGE, end - begin, key, within, repeated))
    return runs


@contextlib.contextmanager
def _source(run: Run, reader) -> Iterator[tuple[int, bool]]:
    """The run's bytes, read out of the store (checked and decoded): (their address, False), or
    (0, True) for a run of zero pages (UFFDIO_ZEROPAGE); valid within the `with` block."""
    _, count, key, within, repeated = run
    if repeated:
        with reader.reader.view(key, within, 1) as page:
            content = bytes(page)
        if content == _ZEROS:
            yield 0, True
            return
        repeats = np.frombuffer(content * count, dtype=np.uint8)
        yield repeats.ctypes.data, False
        return
    with reader.reader.borrowed(key, within, count) as pages:
        source = np.frombuffer(pages, dtype=np.uint8)
        try:
            yield source.ctypes.data, False
        finally:
            del source  # (a traceback keeping it would keep the pack's mapping exported)


def _place(fd: int, dst: int, src: int, length: int, zeros: bool = False) -> tuple[int, int, int]:
    """Copies length bytes from src to dst (zeros: the zero page); returns (bytes copied, bytes
    done: copied or there already, the errno that stopped it or 0)."""
    placed = done = 0
    while length > 0:
        code, moved = copy_once(fd, dst, src, length, zeros)
        placed, done = placed + moved, done + moved
        if not code:
            return placed, done, 0
        dst, src, length = dst + moved, src + moved, length - moved
        if code == errno.EEXIST and length > 0:  # the tree has this page already: skipped
            done += PAGE
            dst, src, length = dst + PAGE, src + PAGE, length - PAGE
            continue
        if code in (errno.EAGAIN, errno.ENOENT, errno.ESRCH, errno.ENOSPC):
            return placed, done, code
        raise OSError(code, f"UFFDIO_COPY at {dst:#x}: {os.strerror(code)}")
    return placed, done, 0
