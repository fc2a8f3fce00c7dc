"""Fetching ahead the segments a lazy restore's page server will serve from a remote store.

The lazy-pages daemon asks for pages one request after another, and each segment it asks for
first cost a round trip to the store: a 1 GiB tree restored from S3 got its last page after
16.6 s while the same bytes came down in 2.3 s in parallel GETs. The page server knows from
the start which segments it will serve and roughly in which order (its LazyPlan), so it
fetches them all at once: adjacent segments of one pack coalesced into ranges of up to
RANGE_BYTES, fetched by THREADS threads in the order the daemon will ask, each range
decrypted (the encrypted backend decrypts in the calling thread) and its segments checked
against their checksums on the fetching thread. The page server reads a range's segments from
the range's buffer, held in memory from the moment it is down until they are read (up to
HELD_BYTES of ranges); each range is also written at its place in a spool file of its pack
(sparse, shaped like the pack), for a segment read again and for the cache copy kept after the
last page (Prefetcher.keep_in), by a thread of its own: a spool slow to write (a page cache
slow to fill) holds up the fetch only once HELD_BYTES waits for it. A request for a segment
not down yet jumps the queue (see FetchQueue.claim). See "Lazy restore" in docs/design.md for
the bounds on memory and disk.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import xxhash

from ckpt.errors import DamagedBlob
from ckpt.store.backends.base import Backend, Lent, RangeReader
from ckpt.store.blocks.segments import Segment, pack_name
from ckpt.system.files import FILE_MODE, fresh_buffer, pwrite_all

# A request's size (up to 1.25 times this: see _range_limit): its latency small next to its
# transfer, THREADS of them in memory.
RANGE_BYTES = 8 << 20
KEEP_GAP_RATIO = 0.5  # a spooled pack is made whole and kept only if at most this share of it is missing
THREADS = 4  # S3Backend's pool keeps connections for these and the page server's own
# Threads making the spooled packs whole after the last page (see Prefetcher.keep_in), each
# fetching up to KEEP_RANGE_BYTES at a time (held twice through the encryption, as received
# and decrypted: 8 x 2 x 2 MiB at most).
KEEP_THREADS = 8
KEEP_RANGE_BYTES = 2 << 20
# Gaps of a pack closer than this are fetched in one request, the fetched bytes between them
# again: a round trip costs more than this much of a transfer.
KEEP_JOIN = 256 << 10
# Fetched ranges held in memory until the page server has read their segments, so that the
# spool can leave the page cache as it is written: a GiB restored from S3 grew the page cache
# by 1044 MiB when the server read the spool back, by 190-420 MiB now (its speed unchanged
# within this machine's spread). Beyond it (the server far behind the fetch), a range is read
# from its spool.
HELD_BYTES = 128 << 20
# The spool's pages leave the page cache every TRIM_BYTES written (see Prefetcher._trim).
TRIM_BYTES = 32 << 20
# The buffers of the pool (see BufferPool): a range's bytes as the store reads them, up to 1.25
# times the range size (see _range_limit) and SLAB_SLACK more (whole chunks of an encrypted pack).
SLAB_SLACK = 1 << 20


@dataclass
class FetchRange:
    """Adjacent segments of one pack, fetched in one request: bytes [start, end) of the pack."""

    pack: str
    start: int
    end: int
    keys: list[int]  # the segments, by offset
    rank: int  # the earliest position in the order of need of any of its segments
    state: str = "pending"  # pending, fetching, done, failed
    error: BaseException | None = None
    # Segments of a range that is done but whose own bytes failed authentication (see
    # Prefetcher._fetch_each): each raises its error, the others are down.
    damaged: dict[int, BaseException] = field(default_factory=dict, repr=False, compare=False)
    event: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    # Once down: its bytes, until the page server has read its segments (see Prefetcher._hold).
    buffer: memoryview | None = field(default=None, repr=False, compare=False)
    unread: set[int] = field(default_factory=set, repr=False, compare=False)
    pages_lent: dict[int, int] = field(default_factory=dict, repr=False, compare=False)  # by segment (see lend)
    spooled: bool = False  # its spool write is over (done or failed): its buffer may go
    slab: memoryview | None = field(default=None, repr=False, compare=False)  # the pool's buffer it is in
    readers: int = 0  # page server threads copying out of its buffer now: the slab goes back after them
    footprint: int = 0  # what its buffer counts in the bytes held: the whole slab, for one of the pool
    spool_failed: bool = False  # the spool has a hole there: read again from the store (_read_again)


def plan_ranges(wanted: Sequence[int], segments: Sequence[Segment], range_bytes: int = RANGE_BYTES,
                stored_span: Callable[[str, int, int], tuple[int, int]] | None = None) -> list[FetchRange]:
    """The ranges to fetch the wanted segments (keys into segments, in the order they will be
    needed) in: within each pack, segments that follow each other with no byte between them
    are coalesced while the bytes the store reads for the range (stored_span(pack, start,
    end), by default the range itself) stay within their block of range_bytes (see
    _range_limit; a segment larger than that is a range of its own); ranges come in the order
    of their first needed segment. Every wanted segment is in exactly one range; no range
    holds a segment not wanted."""
    span = stored_span or (lambda pack, start, end: (start, end))
    rank: dict[int, int] = {}
    for position, key in enumerate(wanted):
        rank.setdefault(key, position)
    by_pack: dict[str, list[int]] = {}
    for key in rank:
        by_pack.setdefault(segments[key].pack, []).append(key)
    ranges: list[FetchRange] = []
    for pack, keys in by_pack.items():
        keys.sort(key=lambda k: segments[k].offset)
        current: FetchRange | None = None
        limit = 0
        for key in keys:
            seg = segments[key]
            end = seg.offset + seg.length
            if current is not None and seg.offset == current.end and span(pack, current.start, end)[1] <= limit:
                current.end = end
                current.keys.append(key)
                current.rank = min(current.rank, rank[key])
                continue
            current = FetchRange(pack, seg.offset, end, [key], rank[key])
            limit = _range_limit(span(pack, seg.offset, end)[0], range_bytes)
            ranges.append(current)
    ranges.sort(key=lambda r: r.rank)
    return ranges


def _range_limit(start: int, range_bytes: int) -> int:
    """Where the stored bytes of a range starting at start (in the store) end at the latest:
    at the next multiple of range_bytes (or the one after, if that is less than a quarter
    away). An S3 server stores a large object in its upload's parts (S3Backend.part_size, 16
    MiB) and reads a range that crosses a part's end from both parts: SeaweedFS took 1.7-2.0 s
    of CPU (1.3-1.45 s of wall time) to serve a GiB of an encrypted pack in the 8 MiB ranges
    the page server asked for, which crossed a part's end by a few bytes half the time, and
    1.45-1.7 s (1.1-1.3 s) in ranges that never crossed one; it shares two cores with the
    page server here."""
    limit = (start // range_bytes + 1) * range_bytes
    if limit - start < range_bytes // 4:
        limit += range_bytes
    return limit


class BufferPool:
    """Buffers for the fetched ranges, used again once a range is let go (see
    Prefetcher._recycle): a new buffer per range, zeroed and then faulted in page by page,
    cost a GiB restored from S3 0.1 CPU-seconds of memset alone, and its last page came
    0.13-0.27 s later (4 pairs, 2.54-2.64 s against 2.37-2.54 s). Buffers of the pool are
    `size` bytes (slabs); a request smaller than `smallest` (or larger than a slab) gets a
    buffer of its own size, never kept: a small range must not pin a slab a large one filled
    before. At most `keep` free slabs are kept, none once closed; thread-safe."""

    def __init__(self, keep: int, size: int, smallest: int):
        self._lock = threading.Lock()
        self._free: list[memoryview] = []
        self._keep, self._size, self._smallest = keep, size, smallest

    def take(self, size: int) -> memoryview:
        if size < self._smallest or size > self._size:
            return fresh_buffer(size)
        with self._lock:
            if self._free:
                return self._free.pop()
        return fresh_buffer(self._size)

    def is_slab(self, buffer: memoryview) -> bool:
        return len(buffer) == self._size

    def give(self, buffer: memoryview) -> None:
        """Back to the pool: nobody reads or writes it any more (dropped unless a slab)."""
        with self._lock:
            if self.is_slab(buffer) and len(self._free) < self._keep:
                self._free.append(buffer)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Every free slab let go, and every one given back from now on: the fetch is over."""
        with self._lock:
            self._keep = 0
            self._free.clear()


class FetchQueue:
    """The ranges still to fetch, in order, and who fetches what: each segment is fetched
    once. Threads take ranges from the front (take); the page server, asking for a segment
    (claim), waits for its range if it is being fetched, else cuts the segment out of its
    range and fetches it at once itself (the rest of the range stays in its place)."""

    def __init__(self, ranges: list[FetchRange]):
        self._lock = threading.Lock()
        self._pending = list(ranges)  # in order; ranges leave it when taken
        self._of_key = {key: r for r in ranges for key in r.keys}
        self.stopped = False

    def covers(self, key: int) -> bool:
        return key in self._of_key

    def take(self) -> FetchRange | None:
        """The next range for a fetching thread (now being fetched), or None: nothing left."""
        with self._lock:
            if self.stopped or not self._pending:
                return None
            taken = self._pending.pop(0)
            taken.state = "fetching"
            return taken

    def claim(self, key: int, segments: Sequence[Segment]) -> tuple[str, FetchRange]:
        """For a segment the page server needs now: ("ready", its range) if it is down (or
        failed: the range holds the error), ("wait", range) if a thread fetches it, else
        ("fetch", a range of that segment alone), which the caller fetches and then finishes."""
        with self._lock:
            found = self._of_key[key]
            if found.state in ("done", "failed"):
                return "ready", found
            if found.state == "fetching":
                return "wait", found
            at = self._pending.index(found)
            seg = segments[key]
            i = found.keys.index(key)
            pieces = []
            if i > 0:
                pieces.append(FetchRange(found.pack, found.start, seg.offset, found.keys[:i], found.rank))
            if i + 1 < len(found.keys):
                pieces.append(FetchRange(found.pack, seg.offset + seg.length, found.end, found.keys[i + 1:],
                                         found.rank))
            self._pending[at:at + 1] = pieces
            for piece in pieces:
                for k in piece.keys:
                    self._of_key[k] = piece
            alone = FetchRange(found.pack, seg.offset, seg.offset + seg.length, [key], -1, state="fetching")
            self._of_key[key] = alone
            return "fetch", alone

    def finish(self, fetched: FetchRange, error: BaseException | None = None) -> None:
        with self._lock:
            fetched.state = "failed" if error is not None else "done"
            fetched.error = error
        fetched.event.set()

    def stop(self) -> None:
        with self._lock:
            self.stopped = True

    @property
    def left(self) -> int:
        with self._lock:
            return len(self._pending)


@dataclass
class FetchStats:
    requests: int = 0
    bytes: int = 0
    fetches: list[tuple[str, int, int, int]] = field(default_factory=list)  # (pack, offset, length, segments)
    all_down_at: float | None = None  # time.monotonic() when the last range came down


class Prefetcher:
    """Fetches the wanted segments (keys into segments, in the order of need) from source (the
    store past its cache: their bytes as stored, decrypted) into spool files in spool_dir, in
    `threads` threads from start(); segment(key) gives a segment's stored bytes, checked,
    once down. A failed fetch (the store unreachable past its budget) fails the segments of
    its range: whoever asks for one gets the error."""

    def __init__(self, source: Backend, segments: Sequence[Segment], wanted: Sequence[int], spool_dir: Path,  # noqa: PLR0913
                 threads: int = THREADS, range_bytes: int = RANGE_BYTES, pages_wanted: dict[int, int] | None = None):
        """pages_wanted: how many pages of each segment its readers will read at least (the
        lent ones: see lend); a segment not named is read whole."""
        self.source, self.segments = source, segments
        self.pages_wanted = pages_wanted or {}
        names = {pack: pack_name(pack) for pack in {segments[key].pack for key in wanted}}
        self.ranges = plan_ranges(wanted, segments, range_bytes,
                                  lambda pack, start, end: source.stored_span(names[pack], start, end - start))
        self.queue = FetchQueue(self.ranges)
        self.spool_dir = spool_dir
        self.threads_wanted = threads
        self.stats = FetchStats()
        self.checked: set[int] = set()  # segments whose checksum a fetching thread found right
        self._stats_lock = threading.Lock()
        self._fds: dict[str, int] = {}
        slab = range_bytes * 5 // 4 + SLAB_SLACK
        # Held slabs count whole in HELD_BYTES (see _hold): its worth, and one per fetching thread.
        self.pool = BufferPool(keep=HELD_BYTES // slab + threads + 1, size=slab, smallest=range_bytes // 8)
        self._threads: list[threading.Thread] = []
        self._keys_left = sum(len(r.keys) for r in self.ranges)
        self._held_lock = threading.Lock()
        self._held_bytes = 0
        self._spans_written: list[tuple[int, int, int]] = []  # (fd, offset, length) since the last trim
        self._spans_flushing: list[tuple[int, int, int]] = []  # written before them: written back by now
        self._bytes_written = 0
        self._unspooled: set[str] = set()  # packs with a range the spool could not take: never kept
        self._spool_queue: queue.SimpleQueue[FetchRange | None] = queue.SimpleQueue()
        self._spool_thread: threading.Thread | None = None
        self._closing = False

    def covers(self, key: int) -> bool:
        return self.queue.covers(key)

    @property
    def held_bytes(self) -> int:
        """Bytes of fetched ranges held in memory for the page server (at most about HELD_BYTES)."""
        with self._held_lock:
            return self._held_bytes

    def start(self) -> None:
        self.spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for pack in {r.pack for r in self.ranges}:
            self._fds[pack] = os.open(self.spool_dir / pack, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        self._spool_thread = threading.Thread(target=self._spool_work, name="ckpt-prefetch-spool", daemon=True)
        self._spool_thread.start()
        for number in range(min(self.threads_wanted, len(self.ranges))):
            thread = threading.Thread(target=self._work, name=f"ckpt-prefetch-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while (taken := self.queue.take()) is not None:
            self._fetch(taken)

    def _fetch(self, taken: FetchRange) -> None:
        slabs: list[memoryview] = []

        def allocate(size: int) -> memoryview:
            slabs.append(self.pool.take(size))
            return slabs[-1]

        try:
            view = self.source.get_view(pack_name(taken.pack), taken.start, taken.end - taken.start,
                                        allocate=allocate)
            got = len(view)
            for key in taken.keys:
                seg = self.segments[key]
                at = seg.offset - taken.start
                # Checked here, on this thread; a segment that fails (or came short) is
                # left for the page server's own check, which records the damage.
                piece = view[at:at + seg.length]
                if len(piece) == seg.length and xxhash.xxh3_128_digest(piece) == seg.checksum:
                    self.checked.add(key)
        except DamagedBlob as exc:
            self._give_back(slabs)
            if len(taken.keys) > 1:
                # One chunk of an encrypted pack failed authentication: the range's other
                # segments are intact, and must be neither refused nor recorded as damaged.
                self._fetch_each(taken)
                return
            self.queue.finish(taken, exc)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to whoever needs the segments
            self._give_back(slabs)
            self.queue.finish(taken, exc)
            return
        # (a buffer of its own size, for a small range, goes with its range: not the pool's)
        taken.slab = slabs[-1] if slabs and self.pool.is_slab(slabs[-1]) else None
        self._hold(taken, view)
        self._fetched(taken, [(taken.start, got, len(taken.keys))], len(taken.keys))
        self.queue.finish(taken)  # the page server may read it from memory now
        self._hand_to_spool(taken, view)  # (settle waits for the spool: every range is in it then)

    def _hand_to_spool(self, taken: FetchRange, view: memoryview) -> None:
        """To the spool thread (right after a GiB tree was ended here, filling the page cache
        took 7-13 s a GiB, and written on the fetching threads the spool made the last page
        of a GiB from S3 come 1-1.5 s later); on this thread instead once more than HELD_BYTES
        is held (the page server or the spool far behind: a buffer goes only once spooled,
        and that bounds the memory) or once the spool thread has stopped (settle)."""
        with self._held_lock:
            queued = self._held_bytes <= HELD_BYTES and self._spool_thread is not None
            if queued:
                self._spool_queue.put(taken)  # under the lock: _stop_spool's end comes after it
        if not queued:
            self._spool(taken, view)

    def _spool_work(self) -> None:
        while (taken := self._spool_queue.get()) is not None:
            try:
                self._spool_one(taken)
            except Exception:  # noqa: BLE001 - as a range the spool could not take: its pack never kept
                with self._held_lock:
                    self._let_go_unspooled(taken)

    def _spool_one(self, taken: FetchRange) -> None:
        with self._held_lock:
            view = taken.buffer
            if taken.spooled:
                return
            if view is None or self._closing:  # (closing: its file is removed next)
                self._let_go_unspooled(taken)
                return
        self._spool(taken, view)

    def _let_go_unspooled(self, taken: FetchRange) -> None:
        """Called with _held_lock held: the range is let go unwritten, a hole in the spool (a
        segment of it read again comes from the store) and its pack never kept."""
        self._unspooled.add(taken.pack)
        taken.spooled = taken.spool_failed = True
        self._release(taken)

    def _hold(self, taken: FetchRange, view: memoryview) -> None:
        with self._held_lock:
            taken.buffer, taken.unread = view, set(taken.keys)
            # A slab counts whole: pages a larger range wrote into it before stay in memory.
            taken.footprint = len(taken.slab) if taken.slab is not None else len(view)
            self._held_bytes += taken.footprint

    def _spool(self, taken: FetchRange, view: memoryview) -> None:
        """The range into its spool file; then its buffer goes if its segments were read (or
        too much is held). A range that cannot be written (the disk full) is let go by the
        same rule: its pack is never kept in the cache, and a segment of it read again is
        fetched again (see _read_again)."""
        fd = self._fds[taken.pack]
        try:
            pwrite_all(fd, view, taken.start)
        except OSError:
            with self._held_lock:
                taken.spool_failed = True
                self._unspooled.add(taken.pack)
        with self._held_lock:
            taken.spooled = True
            if not taken.unread or self._held_bytes > HELD_BYTES:
                self._release(taken)
        if not taken.spool_failed:
            self._trim(fd, taken.start, len(view))

    def _release(self, taken: FetchRange) -> None:
        """Called with _held_lock held."""
        if taken.buffer is not None:
            self._held_bytes -= taken.footprint
            taken.buffer = None
        self._recycle(taken)

    def _recycle(self, taken: FetchRange) -> None:
        """Called with _held_lock held: a let-go range's buffer back to the pool, once no page
        server thread copies out of it any more (see segment): it is written over next."""
        if taken.buffer is None and not taken.readers and taken.slab is not None:
            self.pool.give(taken.slab)
            taken.slab = None

    def _give_back(self, slabs: list[memoryview]) -> None:
        for slab in slabs:  # (a failed fetch: nobody else saw them)
            self.pool.give(slab)

    def _trim(self, fd: int, offset: int, length: int) -> None:
        """The spool's pages leave the page cache as it is written (they stay on disk, for a
        segment read again and the cache copy): a GiB restored otherwise holds a GiB of page
        cache beside the tree's own memory, each page new to this host (1.3-2.1 s of system
        time a GiB here, 0.5 s dropped as it goes). POSIX_FADV_DONTNEED starts the writeback
        of dirty pages and drops only clean ones: each span is advised twice, when written
        (its writeback starts) and a batch later (written back by then: dropped)."""
        with self._held_lock:
            self._spans_written.append((fd, offset, length))
            self._bytes_written += length
            if self._bytes_written < TRIM_BYTES:
                return
            spans = self._spans_flushing + self._spans_written
            self._spans_flushing, self._spans_written, self._bytes_written = self._spans_written, [], 0
        # Not under the lock (a fault's read waits for it; writeback may block here): the
        # files are closed only once the fetching threads have ended (keep_in, close).
        for span_fd, span_offset, span_length in spans:
            try:
                os.posix_fadvise(span_fd, span_offset, span_length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # advice only

    def _fetch_each(self, taken: FetchRange) -> None:
        """The segments of a range one request each: those whose bytes fail are the range's
        `damaged`, the others are down."""
        fetches = []
        try:
            for key in taken.keys:
                seg = self.segments[key]
                try:
                    with self.source.get_view(pack_name(taken.pack), seg.offset, seg.length) as view:
                        if len(view) == seg.length and xxhash.xxh3_128_digest(view) == seg.checksum:
                            self.checked.add(key)
                        pwrite_all(self._fds[taken.pack], view, seg.offset)
                        fetches.append((seg.offset, len(view), 1))
                except DamagedBlob as exc:
                    taken.damaged[key] = exc
        except BaseException as exc:  # noqa: BLE001 - handed to whoever needs the segments
            self.queue.finish(taken, exc)
            return
        self._fetched(taken, fetches, len(taken.keys) - len(taken.damaged))
        self.queue.finish(taken)

    def _fetched(self, taken: FetchRange, fetches: list[tuple[int, int, int]], keys_down: int) -> None:
        with self._stats_lock:
            for offset, length, count in fetches:
                self.stats.requests += 1
                self.stats.bytes += length
                self.stats.fetches.append((taken.pack, offset, length, count))
            self._keys_left -= keys_down  # a damaged segment is never down: the packs are not kept
            if self._keys_left == 0:
                self.stats.all_down_at = time.monotonic()
                self.pool.close()  # nothing more to fetch: buffers go as their ranges are let go

    def _down(self, key: int) -> FetchRange:
        """The range holding the segment, once it is down (fetched here at once if nobody
        fetches it yet); raises what its fetch raised."""
        while True:
            action, found = self.queue.claim(key, self.segments)
            if action == "fetch":
                self._fetch(found)
            elif action == "wait":
                found.event.wait()
            if found.state == "failed":
                assert found.error is not None
                raise found.error
            if found.state == "done":
                if key in found.damaged:
                    raise found.damaged[key]
                return found

    def lend(self, key: int, pages: int) -> Lent | None:
        """The segment's stored bytes in place, in its range's buffer (no copy), and the
        function to call once done with them: until then the buffer stays out of the pool.
        Release the view before calling it, and keep nothing made from it (a numpy array of
        it outlives the view's release unnoticed). pages: how many of its pages the caller
        reads; the segment counts as read (see segment) once as many as it is read for (see
        `pages_wanted`) were lent. None, for the caller to read it the usual way (a copy, its
        check, its damage recorded): its range's buffer went, a fetching thread did not find
        it right, or its fetch failed. Copying each segment out cost a GiB from S3 0.15-0.2
        s of the page server's CPU, on a path that is CPU-bound on this host."""
        try:
            found = self._down(key)
        except Exception:  # noqa: BLE001 - raised again, and recorded as damage, by the usual read
            return None
        seg = self.segments[key]
        with self._held_lock:
            buffer = found.buffer
            if buffer is None or key not in self.checked:
                return None
            found.readers += 1
            found.pages_lent[key] = lent = found.pages_lent.get(key, 0) + pages
            if lent >= self.pages_wanted.get(key, seg.pages):
                self._read_out(found, key)
        at = seg.offset - found.start
        given = False

        def give_back() -> None:
            nonlocal given
            with self._held_lock:
                if given:
                    return  # (twice would drop another reader's hold)
                given = True
                found.readers -= 1
                self._recycle(found)

        return buffer[at:at + seg.length], give_back

    def _read_out(self, found: FetchRange, key: int) -> None:
        """Called with _held_lock held: segment key of range found has been read; the range's
        buffer goes once each of its segments was and its spool write is over (its slab back to
        the pool only once no reader copies out of it, see _recycle)."""
        found.unread.discard(key)
        if not found.unread and found.spooled:
            self._release(found)

    def segment(self, key: int) -> memoryview:
        """The segment's stored bytes, once fetched (from the range's buffer while it is held,
        else from the spool); raises what its fetch raised."""
        found = self._down(key)
        seg = self.segments[key]
        with self._held_lock:
            buffer = found.buffer
            if buffer is not None:
                found.readers += 1  # its buffer stays out of the pool until the copy below is made
            self._read_out(found, key)
            unspooled = found.spool_failed
        if buffer is not None:
            at = seg.offset - found.start
            try:
                # A copy, as a read of the spool was: the buffer goes back to the pool, and a
                # slice would keep the whole range alive in the readers' held segments.
                return memoryview(bytes(buffer[at:at + seg.length]))
            finally:
                with self._held_lock:
                    found.readers -= 1
                    self._recycle(found)
        if not unspooled:
            stored = os.pread(self._fds[seg.pack], seg.length, seg.offset)
            # Hashed again: the spool is out of the page cache, and a lost writeback (EIO)
            # would read as zeros that nobody checks (the segment is in `checked`).
            if xxhash.xxh3_128_digest(stored) == seg.checksum:
                return memoryview(stored)
            with self._held_lock:
                self._unspooled.add(seg.pack)  # a wrong spool is no copy for the cache
        return self._read_again(key, seg)

    def _read_again(self, key: int, seg: Segment) -> memoryview:
        """A segment whose spooled copy is missing (the spool could not take it) or wrong: from
        the store again, hashed here (the server's readers trust a segment they checked once).
        Bytes of the store that fail raise DamagedBlob: the store's damage, recorded as such."""
        with self.source.get_view(pack_name(seg.pack), seg.offset, seg.length) as view:
            stored = bytes(view)
        self._fetched(FetchRange(seg.pack, seg.offset, seg.offset + seg.length, [key], -1),
                      [(seg.offset, len(stored), 1)], 0)
        if len(stored) != seg.length or xxhash.xxh3_128_digest(stored) != seg.checksum:
            self.checked.discard(key)
            raise DamagedBlob(f"pack {seg.pack} is damaged at offset {seg.offset}", name=pack_name(seg.pack))
        return memoryview(stored)

    def settle(self) -> None:
        """Waits for the fetching threads, then the spool thread, to end: once every range is
        down, each of them is in the spool when this returns."""
        for thread in self._threads:
            thread.join()
        self._stop_spool()

    def _stop_spool(self) -> None:
        with self._held_lock:
            thread, self._spool_thread = self._spool_thread, None  # from now on, spooled where fetched
            if thread is not None:
                self._spool_queue.put(None)
        if thread is not None:
            thread.join()
        while True:  # what a spool thread that ended early left (none otherwise)
            try:
                taken = self._spool_queue.get_nowait()
            except queue.Empty:
                return
            if taken is not None:
                self._spool_one(taken)

    def keep_in(self, cache: Backend) -> None:
        """Once every range is down, makes each spooled pack whole (its bytes not fetched: other
        pages, eager or of other checkpoints) and hands it to the cache, if it fits its cap: a
        next restore on this host downloads nothing. After the last page: the tree never waits
        for it. The gaps of all packs are fetched by up to KEEP_THREADS threads (between a
        tree's eager pages and those its processes share are a hundred gaps, each a round trip
        away). Best effort: a failure leaves the pack uncached."""
        with self._stats_lock:
            if self._keys_left:  # a fetch failed (or the server stopped early)
                return
        self.settle()
        spooled = [(pack, fd) for pack, fd in self._fds.items() if pack not in self._unspooled]
        if not spooled:
            return
        try:
            room = cache.copy_room()
            threads = max(1, min(KEEP_THREADS, self.source.requests_in_flight()))
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-keep") as pool:
                gaps = dict(zip(spooled, pool.map(lambda item: self._gaps(item[0], room), spooled), strict=True))
                wanted = [(pack, fd, gap) for (pack, fd), found in gaps.items() if found is not None
                          for gap in found[1]]
                filled = list(pool.map(lambda item: self._fill_gap(*item), wanted))
            failed = {pack for (pack, *_), ok in zip(wanted, filled, strict=True) if not ok}
            for (pack, fd), found in gaps.items():
                if found is not None and pack not in failed:
                    self._keep(cache, pack, fd, found[0])
        except Exception:  # noqa: BLE001 - the tree runs already: the cache is an optimisation
            return

    def _keep(self, cache: Backend, pack: str, fd: int, size: int) -> None:
        """A spooled pack made whole handed to the cache (then its spool file is the cache's)."""
        try:
            os.ftruncate(fd, size)
        except OSError:
            return
        if cache.keep_copy(pack_name(pack), self.spool_dir / pack):
            os.close(fd)
            del self._fds[pack]

    def _gaps(self, pack: str, room: int) -> tuple[int, list[tuple[int, int]]] | None:
        """The size of pack and the ranges of it not fetched (adjacent gaps less than
        KEEP_JOIN apart fetched as one, up to KEEP_RANGE_BYTES); None if it is not worth keeping
        (larger than room, or mostly bytes the restore did not fetch) or its size is unknown."""
        try:
            size = self.source.stat(pack_name(pack)).size
        except Exception:  # noqa: BLE001 - the cache is an optimisation: any failure only leaves it out
            return None
        with self._stats_lock:
            spans = sorted((f[1], f[1] + f[2]) for f in self.stats.fetches if f[0] == pack)
        # A pack mostly of other checkpoints' pages (an old pack a new checkpoint dedups
        # against) is not made whole: that would download more than the restore itself did,
        # after it, and evict copies that are used.
        if size > room or size - sum(end - start for start, end in spans) > KEEP_GAP_RATIO * size:
            return None
        ranges: list[tuple[int, int]] = []
        at = 0
        for start, end in [*spans, (size, size)]:
            while at < start:
                stop = min(start, at + KEEP_RANGE_BYTES)
                if ranges and at - ranges[-1][1] < KEEP_JOIN and stop - ranges[-1][0] <= KEEP_RANGE_BYTES:
                    ranges[-1] = (ranges[-1][0], stop)  # (the few bytes between fetched again)
                else:
                    ranges.append((at, stop))
                at = stop
            at = max(at, end)
        return size, ranges

    def _fill_gap(self, pack: str, fd: int, gap: tuple[int, int]) -> bool:
        """Bytes gap of pack written at their place in its spool file; False if a read failed."""
        name = pack_name(pack)
        at, end = gap
        try:
            while at < end:
                with self.source.get_view(name, at, end - at) as view:
                    if not len(view):
                        raise OSError(f"{name} ends at {at}, before {end}")
                    pwrite_all(fd, view, at)
                    at += len(view)
        except Exception:  # noqa: BLE001 - the cache is an optimisation: any failure only leaves it out
            return False
        return True

    def close(self) -> None:
        """Stops the threads (a range being fetched is let finish) and removes the spool files."""
        self.queue.stop()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._closing = True  # the spool thread lets go what it has not written
        self._stop_spool()
        with self._held_lock:
            for taken in self.ranges:
                self._release(taken)
            self.pool.close()
            for pack, fd in self._fds.items():
                os.close(fd)
                (self.spool_dir / pack).unlink(missing_ok=True)
            self._fds.clear()
        try:
            self.spool_dir.rmdir()
        except OSError:
            pass


class PrefetchedRanges(RangeReader):
    """A reading session whose reads of the prefetched segments come from the Prefetcher (the
    rest from the session it wraps): what the page server's _SegmentReader reads through."""

    def __init__(self, inner: RangeReader, prefetcher: Prefetcher, backend: Backend, owns_prefetcher: bool = True):
        super().__init__(backend)
        self._inner, self._prefetcher, self._owns = inner, prefetcher, owns_prefetcher
        self._at = {(pack_name(prefetcher.segments[k].pack), prefetcher.segments[k].offset): k
                    for r in prefetcher.ranges for k in r.keys}
        self._packs = {name for name, _ in self._at}

    def size(self, name: str) -> int:
        # A prefetched pack's size from the store (asked once), not through the wrapped
        # session: a cache would download a small pack whole to answer.
        return super().size(name) if name in self._packs else self._inner.size(name)

    def read(self, name: str, offset: int, length: int) -> memoryview:
        key = self._at.get((name, offset))
        if key is None or self._prefetcher.segments[key].length != length:
            return self._inner.read(name, offset, length)
        return self._prefetcher.segment(key)

    def checked(self, name: str, offset: int, checksum: bytes) -> bool:
        key = self._at.get((name, offset))
        return (key is not None and key in self._prefetcher.checked
                and self._prefetcher.segments[key].checksum == checksum)

    def lend(self, name: str, offset: int, length: int, checksum: bytes, pages: int) -> Lent | None:
        key = self._at.get((name, offset))
        if key is None or self._prefetcher.segments[key].length != length \
                or self._prefetcher.segments[key].checksum != checksum:
            return None
        return self._prefetcher.lend(key, pages)  # (waits for its range: a thread checks it once down)

    def mapped(self, name: str) -> bool:
        return False if name in self._packs else self._inner.mapped(name)

    def read_again(self, name: str) -> bool:
        # A prefetched pack's bytes came from the store itself, not from a copy.
        return False if name in self._packs else self._inner.read_again(name)

    def read_again_intact(self, name: str) -> None:
        self._inner.read_again_intact(name)

    def copy_to(self, name: str, offset: int, length: int, fd: int) -> int:
        if name in self._packs:
            return super().copy_to(name, offset, length, fd)
        return self._inner.copy_to(name, offset, length, fd)

    def close(self) -> None:
        if self._owns:  # else several sessions read through it, and its owner closes it
            self._prefetcher.close()
        self._inner.close()
        super().close()
