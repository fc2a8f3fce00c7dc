"""Page data, content-addressed in blocks of one page, packed into pack files.

CRIU's pages-*.img holds the contents of the pages its pagemap-*.img lists, page after page, in
the order of the pagemap's virtual addresses. ckpt cuts it at every page (so block boundaries
are the pagemap's page boundaries, whatever mappings come and go), names each page by its
keyed XXH3-128 hash, and stores only the pages the store does not hold yet. Runs of new pages
form segments, each encoded with one codec and written into one pack file per dump; index
files say which segment of which pack holds each page. A checkpoint keeps, for each pages
image, its page list: the ids of its pages in order. See docs/design.md.
"""

from __future__ import annotations

import array
import collections
import contextlib
import mmap
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import blake3
import xxhash
import zstandard

from ckpt.errors import CkptError, DamagedBlob, DamagedCheckpoint
from ckpt.phases import phase
from ckpt.store.backends import Backend, BlobExists, BlobNotFound, BlobWriter, RangeReader
from ckpt.store.blocks.segments import (CODECS, ID_LEN, INDEX_PREFIX, PAGE, Segment, pack_name, segment_key,
                                        WITHIN_BITS, split_location)
from ckpt.system.files import FILE_MODE, punch_out, start_writeback, write_all

if TYPE_CHECKING:
    from ckpt.system.arrays import np

    from ckpt.store.blocks.index import BlockIndex
    from ckpt.store.blocks.prefetch import Prefetcher

SEGMENT_PAGES = 256  # 1 MiB of pages per segment at most
MERGE_ABOVE = 32  # index files; then the MERGE_COUNT with the fewest entries become one
MERGE_COUNT = 16
ZSTD_LEVEL = 1
KEY = "key"
DAMAGED_PREFIX = "damaged/"


def _blockindex() -> ModuleType:
    """The block index (ckpt/store/blocks/index.py), imported where it is first needed: it needs
    numpy, whose import (0.1-1 s) commands that read no page (`ckpt list`) do without."""
    from ckpt.store.blocks import index as blockindex

    return blockindex


def _encode(codec: str, data: bytes | memoryview) -> bytes:
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    if codec == "lz4":
        import lz4.block

        return lz4.block.compress(data, store_size=True)
    return bytes(data)


def _decode(codec: int, data: bytes) -> bytes:
    if codec == 1:
        return zstandard.ZstdDecompressor().decompress(data)
    if codec == 2:
        import lz4.block

        return lz4.block.decompress(data)
    return data


class PageSource(Protocol):
    """What BlockStore.ingest needs of a pages image: a pages image CRIU wrote (PagesImage)
    and one it streamed to ckpt (StreamedPages) are its two kinds. Asked once per image, never
    per page: the pages themselves are hashed, searched and encoded in bulk either way."""

    @property
    def name(self) -> str:
        """The pages image's name (pages-<id>.img)."""
        ...

    @property
    def path(self) -> Path:
        """The file whose pages are stored: mapped, and adopted as a pack as it is."""
        ...

    @property
    def size(self) -> int:
        """The size of the pages image it stands for (a whole number of pages)."""
        ...

    def known_page_list(self) -> bytes | None:
        """The page list when every page of it is known to be stored already (nothing to
        read), else None."""
        ...

    def ids(self, mapped: mmap.mmap, seed: int) -> bytes:
        """The image's page list, given its file mapped."""
        ...

    def candidates(self, index: BlockIndex, page_list: bytes, earlier: tuple | None) -> Sequence[int]:
        """The rows of the page list that may be new to the store (BlockIndex.missing)."""
        ...

    def file_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Where runs of rows lie in the file, as [start, end) pages."""
        ...


@dataclass
class PagesImage:
    """A pages image CRIU wrote: every page of it in the file, in the order of its pagemap."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def known_page_list(self) -> bytes | None:
        return None

    def ids(self, mapped: mmap.mmap, seed: int) -> bytes:
        return page_ids(mapped, seed)

    def candidates(self, index: BlockIndex, page_list: bytes, earlier: tuple | None) -> Sequence[int]:
        return index.missing(page_list, earlier)

    def file_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return runs


@dataclass
class StreamedPages:
    """A pages image CRIU streamed to ckpt instead of writing it (ckpt/dump/pagestream.py):
    the id of each of its pages, and only some of the pages themselves, those of `rows`
    (ascending), one after another in the file at `path`. The others are known to be in the
    store: their id is the one their address had in a committed checkpoint of the target."""

    name: str
    path: Path
    page_list: bytes
    rows: np.ndarray

    @property
    def size(self) -> int:
        """The size of the pages image it stands for."""
        return len(self.page_list) // ID_LEN * PAGE

    def known_page_list(self) -> bytes | None:
        return None if len(self.rows) else self.page_list  # nothing kept: the stream knew every page

    def ids(self, mapped: mmap.mmap, seed: int) -> bytes:
        return self.page_list  # named as they came

    def candidates(self, index: BlockIndex, page_list: bytes, earlier: tuple | None) -> Sequence[int]:
        """Only the kept pages can be new (the others were known)."""
        from ckpt.system.arrays import np

        kept = np.frombuffer(page_list, dtype="V16")[self.rows].tobytes()
        return self.rows[index.missing(kept)].tolist()

    def file_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The runs are made of kept rows only (candidates looks up no other), so consecutive
        rows lie one after the other in the file of kept pages too."""
        from ckpt.system.arrays import np

        starts = np.searchsorted(self.rows, [start for start, _ in runs]).tolist()
        return [(at, at + end - start) for at, (start, end) in zip(starts, runs, strict=True)]


def page_source(image: Path | PageSource) -> PageSource:
    """A path names a pages image CRIU wrote (the store's tests and older callers pass paths)."""
    return PagesImage(image) if isinstance(image, Path) else image


@dataclass
class IngestStats:
    pages: int = 0
    new_pages: int = 0
    bytes_new: int = 0  # stored bytes of new segments
    bytes_dedup: int = 0  # raw bytes of pages the store already held
    pages_from_parent: int = 0  # pages a dirty-tracking dump took from its parent checkpoint

    def add(self, other: IngestStats) -> None:
        self.pages += other.pages
        self.new_pages += other.new_pages
        self.bytes_new += other.bytes_new
        self.bytes_dedup += other.bytes_dedup


try:
    from ckpt._pagehash import page_ids as _page_ids_in_c
except ImportError:  # not built: `make setup` builds it (a C compiler, Python's headers, xxhash.h)
    _page_ids_in_c = None

HASH_THREADS = max(1, min(len(os.sched_getaffinity(0)), 8))


def page_ids(buffer, seed: int, in_c: bool = True) -> bytes:
    """The ids of the pages of a buffer (a whole number of pages), one after the other.

    In C where it is built (ckpt/_pagehash.c) and in_c is left True: without the GIL, one
    thread per core, each mapping in and hashing its share, about 0.25 s for 2 GiB here (bound
    by memory). The fallback, one xxhash call per page from Python, costs 0.35-0.45 s of one
    core per GiB."""
    if in_c and _page_ids_in_c is not None:
        return _page_ids_in_c(buffer, seed, HASH_THREADS)
    view = memoryview(buffer)
    try:
        digest = xxhash.xxh3_128_digest
        return b"".join([digest(view[i:i + PAGE], seed) for i in range(0, len(view), PAGE)])
    finally:
        view.release()


class _Told:
    """Progress of an ingest, in bytes of the images: told every PROGRESS_STEP at most (a 1%
    dump makes thousands of one-page segments; a call each would cost more than it tells)."""

    STEP = 16 << 20

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total = progress, total
        self.before = 0  # bytes of the images done
        self.last = 0

    def at(self, within: int, final: bool = False) -> None:
        done = self.total if final else self.before + within
        if self.progress is not None and (final or done - self.last >= self.STEP):
            self.last = done
            self.progress(done, self.total)

    def image_done(self, size: int) -> None:
        self.before += size
        self.at(0)


class _Encoders:
    """One zstd compressor per thread (a compressor is not thread-safe; making one costs as
    much as compressing a page)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        """The two threads that compress segments, the same for every image of one ingest: a
        pool started for each image cost a 100-process dump 0.2-0.5 s (threads started, and
        a compressor made in each)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-encode")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def encode(self, codec: str, data) -> bytes:
        if codec != "zstd":
            return _encode(codec, data)
        compressor = getattr(self._local, "zstd", None)
        if compressor is None:
            compressor = self._local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return compressor.compress(data)


BATCH_PAGES = 64  # a thread is handed segments by the batch: handing it one cost 30-40 us,
# more than compressing the page or two of a next dump's typical segment
IN_FLIGHT = 4  # batches compressed ahead of the writer (at most 1 MiB of pages each)


def _encoded_segments(view: memoryview, runs: list[tuple[int, int]], codec: str, encoders: _Encoders,
                      as_they_are: frozenset[tuple[int, int]] = frozenset()):
    """(stored bytes, codec used, checksum) of each run of pages, in order. A segment that does
    not shrink is stored as it is, as is every run of as_they_are (found incompressible by
    its probe: not compressed only to find it does not shrink). zstd and lz4 release the GIL:
    from two batches of segments on, two threads compress them while the caller writes the
    ones before, which nearly halves a first dump's compression time and takes a next dump's
    off the writer's path."""
    def encode(run: tuple[int, int]) -> tuple[bytes, str, bytes]:
        raw = view[run[0] * PAGE:run[1] * PAGE]
        used = "none" if run in as_they_are else codec
        try:
            stored = encoders.encode(used, raw)
            if used != "none" and len(stored) >= len(raw):
                stored, used = bytes(raw), "none"
        finally:
            raw.release()  # no view of the mapped image outlives its segment
        return stored, used, xxhash.xxh3_128_digest(stored)

    def encode_batch(batch: list[tuple[int, int]]) -> list[tuple[bytes, str, bytes]]:
        return [encode(run) for run in batch]

    batches = _batches(runs, BATCH_PAGES)
    if codec == "none" or len(batches) < 2:
        for run in runs:
            yield encode(run)
        return
    pool = encoders.pool()
    pending: collections.deque = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(encode_batch, batch))
            if len(pending) >= IN_FLIGHT:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        # Closing this generator (the writer failed) waits for the batches in flight: their
        # views must be released before the image's mapping is closed.
        for future in pending:
            future.cancel()
        wait(pending)


PROBE = 16 << 10  # of a segment, compressed to tell whether the rest would compress
PROBE_SLICES = 16
# Segments a reader holds decoded (at most 1 MiB each; a stored-as-is segment of a local pack
# is a view of its mapping, no memory of its own): see _SegmentReader.
HELD_SEGMENTS = 16
SHARED_DECODED_BYTES = 64 << 20  # decoded segments a layout's readers share (DecodedSegments)
ENCODED_AT_MOST = 0.9  # of its size, for an encoding to be worth keeping (else stored as it is)
ADOPT_AT_LEAST = 0.75  # of a file's bytes in segments stored as they are, for it to become a pack
ADOPTED_AT_ONCE = 4  # adopted files made durable at once (PackWriter.commit)
# A full restore from a remote store downloads a pack whole first (see
# BlockStore.packs_worth_keeping_whole) when it reads at least WHOLE_SHARE of it and its
# layout at least WHOLE_MIN_SEGMENTS of its segments; WHOLE_PACKS_AT_ONCE packs at a time,
# each in the backend's parallel parts (memory: each thread of a download, the 2 callers and
# the S3 backend's 4, holds a part as received and its plaintext, 2 x 16 MiB: 192 MiB at most).
WHOLE_SHARE = 0.5
WHOLE_MIN_SEGMENTS = 32
WHOLE_PACKS_AT_ONCE = 2
ADOPT_SPARSE_AT_LEAST = 1 << 20  # bytes stored as they are, for a file to become a pack with holes


def _incompressible(view: memoryview, runs: list[tuple[int, int]]) -> list[bool]:
    """For each run of pages, whether a probe of it (16 KiB, in PROBE_SLICES slices spread
    over it) does not shrink by 10%: stored as it is, it costs no compression now and none at
    restore. Per segment, not per image: an interpreter's heap compresses, the random data
    beside it does not. Slices, not the run's first 16 KiB: a worker's 1 MiB run of random
    data behind a few pages of its heap passed as compressible (its first 16 KiB shrank by
    a fifth, the whole of it by 0.3%), and was compressed for nothing."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    found = []
    for start, end in runs:
        first, length = start * PAGE, (end - start) * PAGE
        if length <= PROBE:
            probe = bytes(view[first:first + length])
        else:
            piece = PROBE // PROBE_SLICES
            probe = b"".join(view[at:at + piece] for at in
                             (first + (length - piece) * k // (PROBE_SLICES - 1) for k in range(PROBE_SLICES)))
        found.append(not _shrank(compressor.compress(probe), len(probe)))
    return found


def _first_seen(rows, page_list: bytes, seen: list) -> list[int]:
    """The rows whose id no earlier row has, of this image or of the images before it in
    this dump (`seen`: their stored ids, a few pairs of arrays of their first and second
    uint64 halves, each pair sorted by the first; these are added): a page repeated in one
    dump is stored once. Sorted searches, not a set of half a million ids (1.7 s for a first
    dump of 2 GiB)."""
    from ckpt.system.arrays import np

    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return []
    halves = np.frombuffer(page_list, dtype=np.uint64).reshape(-1, 2)[rows]
    # Sorted by the first half of the ids (one uint64 key: a tenth of the time of sorting by
    # whole ids); only rows sharing a first half, repeated pages mostly, are sorted by both.
    order = np.argsort(halves[:, 0], kind="stable")
    first = halves[order, 0]
    shared = np.zeros(len(rows), dtype=bool)
    shared[1:] = first[1:] == first[:-1]
    shared[:-1] |= shared[1:]
    drop = np.zeros(len(rows), dtype=bool)
    if shared.any():
        group = order[shared]  # rows (positions in `rows`) whose first half another row has
        by_id = group[np.lexsort((halves[group, 1], halves[group, 0]))]  # stable: row order kept
        repeat = (halves[by_id[1:], 0] == halves[by_id[:-1], 0]) & (halves[by_id[1:], 1] == halves[by_id[:-1], 1])
        drop[by_id[1:][repeat]] = True
    # From here in the order of their first halves (the sort above, less the repeats): sorted
    # keys search several times faster, and each array of `seen` is kept so.
    order = order[~drop[order]]
    rows, firsts, seconds = rows[order], halves[order, 0], halves[order, 1]
    search_ids = _blockindex().search_ids
    for earlier_firsts, earlier_seconds in seen:
        new = np.ones(len(rows), dtype=bool)
        new[search_ids(earlier_firsts, earlier_seconds, firsts, seconds)[1]] = False
        rows, firsts, seconds = rows[new], firsts[new], seconds[new]
    _add_seen(seen, (firsts, seconds))
    return np.sort(rows).tolist()


def _add_seen(seen: list, new: tuple) -> None:
    """Adds sorted ids (first halves, second halves) to seen, merged with the last pairs
    while they are no larger (as a binary counter carries): each id is copied a logarithm
    of times, and a few pairs are searched. One array merged again with every image copied
    every id seen so far each time: 0.13-0.26 s for a tree of 100 processes."""
    from ckpt.system.arrays import np

    while seen and len(seen[-1][0]) <= len(new[0]):
        firsts, seconds = seen.pop()
        firsts, seconds = np.concatenate([firsts, new[0]]), np.concatenate([seconds, new[1]])
        order = np.argsort(firsts, kind="stable")  # two sorted runs: merged in one pass
        new = (firsts[order], seconds[order])
    seen.append(new)


def _batches(runs: list[tuple[int, int]], pages: int) -> list[list[tuple[int, int]]]:
    """Consecutive runs grouped until a group holds at least `pages` pages."""
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    held = 0
    for run in runs:
        current.append(run)
        held += run[1] - run[0]
        if held >= pages:
            batches.append(current)
            current, held = [], 0
    if current:
        batches.append(current)
    return batches


def _segments_under(locations: list[int], holes: Sequence[tuple[int, int]]) -> list[int]:
    """The segments holding the pages of the holes, each once (sorted searches: a set built
    page by page cost a lazy restore of 2 GiB 0.6 s before the tree ran)."""
    from ckpt.system.arrays import distinct, np

    located = np.asarray(locations, dtype=np.int64)
    return distinct(np.concatenate([segment_key(located[first:first + count]) for first, count in holes])).tolist()


def _runs(positions: list[int], longest: int) -> list[tuple[int, int]]:
    """Sorted positions as [start, end) runs of consecutive ones, each at most `longest` long."""
    from ckpt.system.arrays import np

    if not len(positions):
        return []
    p = np.asarray(positions, dtype=np.int64)
    breaks = (np.flatnonzero(np.diff(p) != 1) + 1).tolist()
    runs: list[tuple[int, int]] = []
    for begin, end in zip([0, *breaks], [*breaks, len(p)], strict=True):
        first, count = int(p[begin]), end - begin
        runs.extend((first + k, first + min(k + longest, count)) for k in range(0, count, longest))
    return runs


LOOK_AHEAD = 4  # images looked up ahead of the one being stored (add_all)


@dataclass
class _LookedUp:
    """One pages image as PagesIngest.look_up found it: its page list, and the rows of it
    the store may lack (None: the image is empty, or every page is known to be stored), and
    the codec its new segments are stored with."""

    source: PageSource
    size: int
    page_list: bytes
    rows: Sequence[int] | None
    codec: str


class PagesIngest:
    """One ingest of pages images into one new pack (BlockStore.start_ingest): images are
    added one at a time, as they become whole (a dump that ends its tree adds each pages
    image while CRIU still dumps the next processes: ckpt/dump/early_ingest.py), then
    finish() commits the pack and its index file, or abort() drops what was written.
    A page repeated in one ingest is stored once, whichever images hold it."""

    def __init__(self, blocks: BlockStore, codec_for: Callable[[Path], str], earlier: dict[str, tuple] | None = None):
        self.blocks, self.codec_for, self.earlier = blocks, codec_for, earlier or {}
        self.pack = PackWriter(blocks.backend)
        self.told = _Told(None, 0)
        self.index = blocks.index()
        self.stats = IngestStats()
        self.page_lists: dict[str, bytes] = {}
        self.seen: list = []  # the ids stored by this ingest so far (_first_seen)
        self.encoders = _Encoders()
        self._looker: ThreadPoolExecutor | None = None  # add_all's look-ups

    def tell(self, progress: Callable[[int, int], None] | None, total: int) -> None:
        """From now on, progress(done, total) hears how far the ingest got, in bytes of the
        images (total: the sizes of those added so far and those still to come)."""
        done = self.told.before
        self.told = _Told(progress, total)
        self.told.before = done

    @property
    def bytes_added(self) -> int:
        """The sizes of the images added so far."""
        return self.told.before

    def add(self, source: PageSource | Path | _LookedUp) -> None:
        """Stores the pages of one image the store lacks (source: the image, or what
        look_up found of it)."""
        looked = source if isinstance(source, _LookedUp) else self.look_up(source)
        name, n = looked.source.name, looked.size // PAGE
        self.page_lists[name] = looked.page_list
        if looked.rows is None:  # empty, or every page known to be stored
            if n:
                self.stats.add(IngestStats(pages=n, bytes_dedup=n * PAGE))
                self.told.image_done(looked.size)
            return
        # Mapped, not read: the pages are hashed where they lie in the page cache.
        with open(looked.source.path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED,
                                                            prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)  # slices of a view copy nothing
            try:
                image_stats = self._store_new_pages(looked, view)
            finally:
                view.release()
        image_stats.pages = n
        image_stats.bytes_dedup = (n - image_stats.new_pages) * PAGE
        self.stats.add(image_stats)
        self.told.image_done(looked.size)

    def add_all(self, sources: Sequence[PageSource | Path]) -> None:
        """add() of each source in turn, while a thread looks up the next ones (look_up):
        the pages of a 100-process tree's dump were hashed and looked up by the thread that
        stored them, one image after the other, and after CRIU ended that thread alone held
        one core for 1.6 s while the other idled. Not in a store with recorded damage: there
        a look-up may record more (check_suspect), which add() must see in order."""
        if len(sources) < 2 or self.index.has_damage:
            for source in sources:
                self.add(source)
            return
        if self._looker is None:
            self._looker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-look-up")
        ahead: collections.deque = collections.deque()
        try:
            for source in sources:
                ahead.append(self._looker.submit(self.look_up, source))
                if len(ahead) > LOOK_AHEAD:
                    self.add(ahead.popleft().result())
            while ahead:
                self.add(ahead.popleft().result())
        finally:
            for future in ahead:
                future.cancel()
            wait(ahead)

    def look_up(self, source: PageSource | Path) -> _LookedUp:
        """What add() finds out before it stores anything: the image's page list and the rows
        the store may lack. Reads only what add() does not change (the index as loaded, and
        the store's damage, which add_all leaves to add() to record in order)."""
        source = page_source(source)
        size = source.size
        if size % PAGE:
            raise DamagedCheckpoint(f"{source.name} is not a whole number of pages")
        if size == 0:
            return _LookedUp(source, 0, b"", None, "none")
        known = source.known_page_list()
        if known is not None:
            return _LookedUp(source, size, known, None, "none")
        with open(source.path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED,
                                                     prot=mmap.PROT_READ) as mm:
            page_list = source.ids(mm, self.blocks.seed)
        self.blocks.check_suspect(page_list)  # nothing to do in a store without damage
        rows = source.candidates(self.index, page_list, self.earlier.get(source.name))
        # Asked only of an image with pages to store: its sample read and compressed a 32nd
        # of every image, a quarter of the CPU of a dump whose pages were all stored already
        # (101 images of a tree of processes: 0.065 of 0.26 s).
        codec = self.codec_for(source.path) if rows is not None and len(rows) else "none"
        return _LookedUp(source, size, page_list, rows, codec)

    def finish(self) -> tuple[dict[str, bytes], IngestStats, list[str]]:
        """Commits the pack and its index file (durable when this returns); returns each
        image's page list (ids in order), the figures and the names of the blobs written.
        On any error what was written is dropped."""
        try:
            written = self.pack.commit()
            self.told.at(0, final=True)
            if written:
                self.blocks.forget_index()
        except BaseException:
            self.pack.abort()
            raise
        finally:
            self._close_threads()
        return self.page_lists, self.stats, written

    def abort(self) -> None:
        """Drops what was written of the pack (nothing is left that a checkpoint could name)."""
        self._close_threads()
        self.pack.abort()

    def _close_threads(self) -> None:
        self.encoders.close()
        if self._looker is not None:
            self._looker.shutdown(wait=True)
            self._looker = None

    def _store_new_pages(self, looked: _LookedUp, view: memoryview) -> IngestStats:
        """Stores the pages the store lacks (found by look_up) and no earlier image of this
        ingest holds, as runs of consecutive pages, each one segment."""
        source, page_list, codec = looked.source, looked.page_list, looked.codec
        fresh = _first_seen(looked.rows, page_list, self.seen)
        runs = _runs(fresh, SEGMENT_PAGES)
        at = source.file_runs(runs)  # where each run lies in the file
        # (in a local store, the file keeps only what its segments name: see PackWriter.commit)
        sparse = self.pack.backend.keeps_holes(source.path)
        flat, as_is = _stored_as_is(view, at, codec, sparse)
        adopted = self.pack.adopt(source.path, sparse) if any(as_is) else None
        # Incompressible segments of a file that is not adopted are copied into the pack as
        # they are, not compressed only to find they do not shrink: the new pages of a tree of
        # 100 processes, 2 MiB of random data each, cost its dump 0.5 s of compression that way.
        encoded = _encoded_segments(view, [r for r, keep in zip(at, as_is, strict=True) if not keep],
                                    codec, self.encoders,
                                    frozenset(r for r, f, keep in zip(at, flat, as_is, strict=True) if f and not keep))
        image_stats = IngestStats()
        kept: list[tuple[int, int]] = []  # (offset, length) in the adopted file
        try:
            for (run_start, end), (file_start, file_end), keep in zip(runs, at, as_is, strict=True):
                ids = page_list[run_start * ID_LEN:end * ID_LEN]
                segment = None if keep and adopted else next(encoded)  # (adopted whenever a run is kept)
                if adopted and (segment is None or not _shrank(segment[0], (end - run_start) * PAGE)):
                    # Where it lies in the adopted file, not copied into the pack: a segment
                    # its probe found compressible may not be (the first pages of a worker's
                    # own heap compress, the rest barely: 100 workers, 110 MiB written into
                    # the pack for 8% less).
                    raw = view[file_start * PAGE:file_end * PAGE]
                    self.pack.add_adopted(adopted, file_start * PAGE, ids, xxhash.xxh3_128_digest(raw))
                    kept.append((file_start * PAGE, (file_end - file_start) * PAGE))
                    raw.release()
                    stored = (end - run_start) * PAGE
                else:
                    assert segment is not None
                    self.pack.add(ids, *segment)
                    stored = len(segment[0])
                self.told.at(end * PAGE)
                phase("dump.ingest")
                image_stats.new_pages += end - run_start
                image_stats.bytes_new += stored
        finally:
            # The mmap cannot close while a view of it exists, even on the way out of an
            # error (a full disk): the encoders release theirs first.
            encoded.close()
        if adopted and sparse:
            # What stays of the file goes to disk now, while CRIU dumps the next process:
            # the commit's fsyncs of 100 adopted images waited 0.2 s for it after CRIU.
            start_writeback(source.path, kept)
        return image_stats


def _shrank(stored: bytes, size: int) -> bool:
    """Whether a segment's encoding saved 10% of its size (the probe's measure)."""
    return len(stored) < ENCODED_AT_MOST * size


def _stored_as_is(view: memoryview, at: list[tuple[int, int]], codec: str,
                  sparse: bool) -> tuple[list[bool], list[bool]]:
    """For each run of pages (where it lies in the file): whether it does not compress (its
    probe), and whether it is stored as it is where it lies: segments that do not compress
    stay where they lie in the file (CRIU's pages image, or a streamed image's kept pages),
    which becomes a pack itself (renamed into a local store: the pages are not copied again).
    Where the rest of the file is punched out once the pack is committed (sparse: a local
    store), any file with 1 MiB of such segments: copied instead, the new pages of a
    100-process tree (2 MiB of random data in each process, a quarter of its pages image)
    cost its dump 1-3 s of writing into memory the host had taken back. Elsewhere only a file
    mostly made of such segments: the rest of it would be dead bytes in the store until a
    prune repacked it (a quarter)."""
    if not at:
        return [], []
    flat = [True] * len(at) if codec == "none" else _incompressible(view, at)
    named = sum(end - start for (start, end), keep in zip(at, flat, strict=True) if keep)
    if named * PAGE < (ADOPT_SPARSE_AT_LEAST if sparse else ADOPT_AT_LEAST * len(view)):
        return flat, [False] * len(at)
    return flat, flat


class PackWriter:
    """One new pack and its index file (docs/design.md, "Write order"): segments are appended
    in order; commit() makes the pack durable under its name, then writes the index file
    naming its segments. Until that index file exists nobody can name a page of the pack, so
    abort() (on the way out of any error, a full disk) deletes what was written of it."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.pack = secrets.token_hex(16)
        self.segments: list[Segment] = []
        # The index file's entries, as columns: ids, segment numbers, positions within.
        self._ids: list[bytes] = []
        self._numbers = array.array("I")
        self._positions = array.array("H")
        self._out: BlobWriter | None = None
        self.offset = 0  # stored bytes written so far
        self._committed = False
        self.written: list[str] = []
        self.index_data = b""  # the index file, once committed
        # Files that become packs as they are (adopt): (pack, file), and those stored so far.
        self._adopted: list[tuple[str, Path, bool]] = []  # (pack, file, whether sparse)
        self._adopted_stored: list[str] = []

    def add(self, ids: bytes, stored: bytes, codec: str, checksum: bytes) -> None:
        """Appends one segment: stored (its bytes, encoded with codec), holding the pages of ids."""
        if self._out is None:
            self._out = self.backend.writer(pack_name(self.pack))
        self._out.write(stored)
        self._segment(Segment(self.pack, self.offset, len(stored), len(ids) // ID_LEN, CODECS[codec], checksum), ids)
        self.offset += len(stored)

    def adopt(self, path: Path, sparse: bool) -> str:
        """A file that becomes a pack as it is, at commit (the local backend renames it: its
        bytes are not copied); returns the pack's id, for add_adopted. sparse: the backend
        takes it in holes and all (Backend.keeps_holes), so that every byte no segment names
        is punched out of it first."""
        pack = secrets.token_hex(16)
        self._adopted.append((pack, path, sparse))
        return pack

    def add_adopted(self, pack: str, offset: int, ids: bytes, checksum: bytes) -> None:
        """One segment of an adopted file: the pages of ids, stored as they are from offset."""
        self._segment(Segment(pack, offset, len(ids) // ID_LEN * PAGE, len(ids) // ID_LEN, CODECS["none"], checksum),
                      ids)

    def _segment(self, segment: Segment, ids: bytes) -> None:
        number = len(self.segments)
        self.segments.append(segment)
        self._ids.append(ids)
        self._numbers.extend([number] * segment.pages)
        self._positions.extend(range(segment.pages))

    def commit(self) -> list[str]:
        """Packs, then index file, each durable when written; returns their blob names (none if
        no segment was added)."""
        if not self.segments:
            self.abort()  # adopted files whose pages were all known: nothing to keep
            return []
        packs = []
        if self._out is not None:
            self._out.commit()
            self._committed = True
            packs.append(pack_name(self.pack))
        self._store_adopted()
        packs += self._adopted_stored
        data = _blockindex().render_index(self.segments, b"".join(self._ids), self._numbers, self._positions)
        name = INDEX_PREFIX + blake3.blake3(data).hexdigest()
        self.backend.put(name, data)
        self.written = [*packs, name]
        self.index_data = data
        return self.written

    def _store_adopted(self) -> None:
        """Each adopted file that holds a segment into the store, a few at once: each is made
        durable on its own (an fsync apiece: the files of a 100-process tree one after the
        other took 0.2 s of its dump after CRIU had ended)."""
        named: dict[str, list[tuple[int, int]]] = {}  # by pack, what its segments name
        for segment in self.segments:
            named.setdefault(segment.pack, []).append((segment.offset, segment.length))

        lock = threading.Lock()

        def store(pack: str, path: Path, sparse: bool) -> None:
            if sparse:
                # Only the segments stay: the pages the store had, and those stored
                # compressed in the dump's own pack, are freed before the file is made
                # durable (nor written to disk). Where the filesystem cannot, they stay as
                # dead bytes, for a prune to repack.
                punch_out(path, sorted(named[pack]))
            self.backend.put_file(pack_name(pack), path)
            with lock:  # at once: abort() drops what was stored, however the commit ends
                self._adopted_stored.append(pack_name(pack))

        adopted = [entry for entry in self._adopted if entry[0] in named]
        if len(adopted) < 2:  # no threads for one file (or none)
            for entry in adopted:
                store(*entry)
            return
        pool = ThreadPoolExecutor(max_workers=ADOPTED_AT_ONCE, thread_name_prefix="ckpt-adopted")
        try:
            futures = [pool.submit(store, *entry) for entry in adopted]
            wait(futures)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        for future in futures:
            future.result()  # the first failure, if any

    def abort(self) -> None:
        """Drops the packs unless their index file was written (then they are the store's: a
        concurrent dump may already name their pages, and prune reclaims what nobody names)."""
        if self.written:
            return
        drop = list(self._adopted_stored)
        if self._out is not None:
            if not self._committed:
                self._out.abort()
            else:
                drop.append(pack_name(self.pack))
        if drop:
            try:
                self.backend.delete(drop)
            except OSError:
                pass  # the next prune reclaims them


class BlockStore:
    def __init__(self, backend: Backend):
        self.backend = backend
        try:  # (read at once, not asked whether it exists first: from S3 that was a request more)
            key = backend.get(KEY)
        except BlobNotFound:
            try:
                # Never replaced: two first dumps racing would otherwise hash with different seeds.
                backend.put_if_absent(KEY, secrets.token_bytes(8))
            except BlobExists:
                pass
            key = backend.get(KEY)
        # Page ids are keyed: a process cannot craft pages that collide with another's.
        self.seed = int.from_bytes(key[:8], "little")
        self._index: BlockIndex | None = None
        self._preload: threading.Thread | None = None
        self._index_lock = threading.Lock()
        self._checked: set[tuple[str, int]] = set()  # suspect segments found intact (check_suspect)

    def preload_index(self) -> None:
        """Starts loading the index in a thread; `index` waits for it. A dump calls this while
        CRIU works (the index is read from the store only, never from the target), which takes
        its 0.1-0.2 s off the time from the target's resumption to the commit."""
        def load() -> None:
            try:
                self._load_index()
            except Exception:  # noqa: BLE001 - index() loads it again and reports the error
                pass

        with self._index_lock:  # once: asked again (Store.read_index_ahead, then the caller), nothing more
            if self._preload is not None or self._index is not None:
                return
            self._preload = threading.Thread(target=load, name="ckpt-index-preload")
            self._preload.start()

    def index(self) -> BlockIndex:
        with self._index_lock:  # (a restore's threads may ask at once: loaded once)
            preload, self._preload = self._preload, None
            if preload is not None:
                preload.join()
            return self._load_index()

    def forget_index(self) -> None:
        """Drops the loaded index: the next index() reads the index files again (after a
        prune or a merge changed them)."""
        self._index = None

    def _load_index(self) -> BlockIndex:
        if self._index is None:
            index = _blockindex().BlockIndex()
            names = self.index_file_names()
            # From a remote store, the index files as many at once as its requests in flight
            # (one after the other, a store's 14 took a 101-process tree's restore from S3 1.2 s,
            # behind its other reads), and the damage markers' listing beside them (after them,
            # a round trip more before a restore could read its first segment).
            workers = min(len(names) + 1, self.backend.requests_in_flight())
            if workers < 2:
                self._add_index_files(index, map(self._index_file, names))
                markers = set(self.damage_markers())
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-index") as pool:
                    markers_coming = pool.submit(self.damage_markers)
                    self._add_index_files(index, pool.map(self._index_file, names))
                    markers = set(markers_coming.result())
            if markers:
                index.mark_damaged(key for key, seg in enumerate(index.segment_list)
                                   if (seg.pack, seg.offset) in markers)
            self._index = index
        return self._index

    def _index_file(self, name: str) -> tuple[str, bytes | None]:
        """An index file's name and bytes (None: damaged or gone)."""
        try:
            return name, self.backend.get(INDEX_PREFIX + name)
        except (DamagedCheckpoint, BlobNotFound):
            return name, None

    @staticmethod
    def _add_index_files(index: BlockIndex, files: Iterator[tuple[str, bytes | None]]) -> None:
        """Every index file (name, bytes) into index, in order (those damaged or gone named as such)."""
        for name, data in files:
            try:
                if data is None:
                    raise BlobNotFound(name)
                index.add_file(name, data)
            except (DamagedCheckpoint, BlobNotFound):
                # Not fatal: dumps store the pages it named again (healing the checkpoints
                # that name them); reads name it; prune refuses to run (see prune.py).
                index.damaged_files.append(name)

    # ---- damage markers (see "Damage and healing" in docs/design.md) -------------------------

    def damage_markers(self) -> list[tuple[str, int]]:
        """(pack, offset) of every segment recorded as damaged."""
        markers = []
        for info in self.backend.list(DAMAGED_PREFIX):
            pack, _, offset = info.name[len(DAMAGED_PREFIX):].partition("-")
            if offset.isdigit():
                markers.append((pack, int(offset)))
        return markers

    def record_damage(self, segment: Segment) -> None:
        """Records a damaged segment so that no later dump reuses its pages. Best effort: a
        store that cannot be written still reports the damage to the caller."""
        try:
            self.backend.put(f"{DAMAGED_PREFIX}{segment.pack}-{segment.offset}", b"")
        except OSError:
            pass
        if self._index is not None:
            self._index.mark_damaged(key for key, seg in enumerate(self._index.segment_list)
                                     if (seg.pack, seg.offset) == (segment.pack, segment.offset))

    def check_suspect(self, page_list: bytes) -> None:
        """Checks, before a new checkpoint names them, the segments holding pages of a page
        list that lie in a pack with recorded damage but are not recorded as damaged
        themselves (docs/design.md, "Damage and healing"): a pack cut short fails at once
        (its size), the others are read against their checksums. Any found damaged is
        recorded, so `held` no longer counts its pages and the dump stores them again. A
        segment is checked once per command; nothing is read in a store without damage."""
        from ckpt.system.arrays import distinct

        index = self.index()
        if not index.damaged:
            return
        found = index.find(page_list)
        suspect, damaged = index.suspect, index.damaged
        segments = index.segment_list
        keys = [key for key in distinct(segment_key(found[found >= 0])).tolist() if key in suspect
                and key not in damaged and (segments[key].pack, segments[key].offset) not in self._checked]
        if not keys:
            return
        reader = _SegmentReader(self, index)
        try:
            for key in keys:
                try:
                    reader.check(key, 0, 1)  # records the damage it finds
                except DamagedCheckpoint:
                    continue
                self._checked.add((segments[key].pack, segments[key].offset))
        finally:
            reader.close()

    def drop_stale_markers(self, indexed: set[tuple[str, int]]) -> None:
        """Deletes the markers of segments no index names any more (after a prune)."""
        self.backend.delete([f"{DAMAGED_PREFIX}{pack}-{offset}" for pack, offset in self.damage_markers()
                             if (pack, offset) not in indexed])

    def merge_index_files(self) -> list[str]:
        """Merges the MERGE_COUNT index files with the fewest entries into one when the store
        has more than MERGE_ABOVE (docs/design.md, "Merging index files"); returns the names
        of the files merged (none: nothing to do). The caller holds the exclusive lock."""
        from ckpt.system.arrays import np

        self._index = None
        index = self.index()
        if len(index.files) <= MERGE_ABOVE or index.damaged_files or index.damaged:
            return []
        segments_of: dict[str, list[Segment]] = collections.defaultdict(list)
        for segment, name in zip(index.segment_list, index.segment_file, strict=True):
            segments_of[name].append(segment)
        columns_of = dict(zip(index.files, index.columns, strict=True))
        chosen = sorted(index.files, key=lambda name: (columns_of[name].count, name))[:MERGE_COUNT]
        segments: list[Segment] = []
        ids, numbers, positions = [], [], []
        for name in chosen:
            columns = columns_of[name]
            ids.append(columns.id_bytes())
            numbers.append(columns.segs.astype(np.uint32) + len(segments))  # numbered in the new file
            positions.append(columns.within)
            segments += segments_of[name]
        # An id two of the files name (two dumps stored it) is written once (in_id_order).
        data = _blockindex().render_index(segments, b"".join(ids), np.concatenate(numbers),
                                          np.concatenate(positions))
        merged = blake3.blake3(data).hexdigest()
        self.backend.put(INDEX_PREFIX + merged, data)
        self.backend.delete([INDEX_PREFIX + name for name in chosen if name != merged])
        self._index = None
        return chosen

    def index_file_names(self) -> list[str]:
        return [info.name[len(INDEX_PREFIX):] for info in self.backend.list(INDEX_PREFIX)]

    # ---- writing --------------------------------------------------------------------------

    def ingest(self, images: Sequence[Path | PageSource], codec_for, earlier: dict[str, tuple] | None = None,
               progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, bytes], IngestStats, list[str]]:
        """Stores the new pages of each pages image in one new pack and an index file.

        images: pages images CRIU wrote (paths, or PagesImage) or streamed (StreamedPages).
        earlier: by image name, the page list of a committed checkpoint of the same target and
        where the image's pages sat in it, by address (ckpt/dump/unchanged.py);
        only a shortcut (BlockIndex.missing), the pages stored are the same without it.

        Returns each image's page list (ids in order), the figures, and the names of the blobs
        written (pack, index file), durable when this returns. progress(done, total) hears, in
        bytes of the images, how far it got (every 16 MiB or so: a store in S3 takes a while).
        """
        sources = [page_source(image) for image in images]
        run = self.start_ingest(codec_for, earlier)
        try:
            run.tell(progress, sum(s.size for s in sources))
            run.add_all(sources)
        except BaseException:
            run.abort()
            raise
        return run.finish()

    def start_ingest(self, codec_for: Callable[[Path], str], earlier: dict[str, tuple] | None = None) -> PagesIngest:
        """An ingest that takes its pages images one at a time (see PagesIngest): ingest() in
        steps, for images that become whole one after the other."""
        return PagesIngest(self, codec_for, earlier)

    def add_pages(self, pack: PackWriter, pages, ids: bytes, codec: str, encoders: _Encoders | None = None) -> int:
        """Appends pages (a buffer of whole pages) with their ids to a new pack, as runs of at
        most SEGMENT_PAGES pages, each one segment encoded with codec, by ingest's path.
        Returns the stored bytes added. (`ckpt copy` writes the pages a destination lacks.)"""
        view = memoryview(pages)
        n = len(view) // PAGE
        runs = [(start, min(start + SEGMENT_PAGES, n)) for start in range(0, n, SEGMENT_PAGES)]
        own = encoders is None
        encoders = encoders or _Encoders()
        encoded = _encoded_segments(view, runs, codec, encoders)
        added = 0
        try:
            for (start, end), segment in zip(runs, encoded, strict=True):
                pack.add(ids[start * ID_LEN:end * ID_LEN], *segment)
                added += len(segment[0])
        finally:
            encoded.close()
            view.release()
            if own:
                encoders.close()
        return added

    # ---- reading --------------------------------------------------------------------------

    def locate(self, image_name: str, page_list: bytes) -> list[int]:
        """The location of each page of a pages image, in order (see BlockIndex.pages)."""
        index = self.index()
        locations = index.locate(page_list)
        if min(locations, default=0) < 0:
            missing = locations.index(-1)
            cause = f" (index file {', '.join(index.damaged_files)} is damaged)" if index.damaged_files else ""
            raise DamagedCheckpoint(f"image {image_name}: page {missing} is missing from the store{cause}")
        return locations

    def locate_images(self, page_lists: dict[str, bytes]) -> dict[str, list[int]]:
        """locate() for many pages images at once, by name: one search of the index for all
        their ids (a 101-process tree's images searched one by one cost 1.3 s of CPU in four
        threads, which mostly waited for each other; one search, 0.05-0.07 s)."""
        found = self.index().find(b"".join(page_lists.values()))
        located, at = {}, 0
        for name, page_list in page_lists.items():
            count = len(page_list) // ID_LEN
            located[name] = found[at:at + count].tolist()
            at += count
            if count and min(located[name]) < 0:
                located[name] = self.locate(name, page_list)  # raises, saying which page is missing
        return located

    def packs_worth_keeping_whole(self, located: Sequence[Sequence[int] | np.ndarray],
                                  written: Sequence[Sequence[int] | np.ndarray]) -> dict[str, int]:
        """For a full restore from a remote store about to read the pages at located, of which
        its layout writes those at written into pages images (the rest it copies into the
        tree from ranges fetched ahead in large requests): the packs (blob name: bytes) that
        are mostly pages it reads (WHOLE_SHARE of their bytes at least) and of which the
        layout itself reads WHOLE_MIN_SEGMENTS segments or more (each a request of its own),
        not held locally, whose copy the cache in front of the store can take. Read range by
        range, a 101-process tree's one pack took 600 requests (its pages images, the copy
        into the tree, then the gaps to keep it); whole, 22. A 1 GiB tree's pack, copied in
        from ranges fetched ahead while the copy goes on, is not downloaded whole first."""
        from ckpt.system.arrays import distinct, np

        def segment_keys(locations: Sequence[Sequence[int] | np.ndarray]) -> list[int]:
            keys = [np.asarray(found, dtype=np.int64) >> WITHIN_BITS for found in locations if len(found)]
            return distinct(np.concatenate(keys)).tolist() if keys else []

        segments = self.index().segment_list
        layout_reads: dict[str, int] = collections.Counter(segments[key].pack for key in segment_keys(written))
        needed: dict[str, int] = collections.defaultdict(int)
        for key in segment_keys(located):
            if layout_reads[segments[key].pack] >= WHOLE_MIN_SEGMENTS:
                needed[segments[key].pack] += segments[key].length
        extent = dict.fromkeys(needed, 0)
        for seg in segments:  # (every segment of those packs, this checkpoint's or not)
            if seg.pack in extent:
                extent[seg.pack] = max(extent[seg.pack], seg.offset + seg.length)
        # Most read first, while they fit together: a copy installed beyond the cap would evict
        # the ones installed just before it (read by nobody yet), and be read range by range.
        # (Those held already take their room: one a restore kept moments ago must not be
        # evicted by the next it keeps, read by nobody yet.)
        held = {pack for pack in needed if self.backend.held_locally(pack_name(pack))}
        room, wanted = self.backend.copy_room() - sum(extent[pack] for pack in held), {}
        for pack, count in sorted(needed.items(), key=lambda item: -item[1]):
            if pack not in held and count >= WHOLE_SHARE * extent[pack] and extent[pack] <= room:
                wanted[pack_name(pack)] = extent[pack]
                room -= extent[pack]
        return wanted

    def keep_packs_whole(self, names: Sequence[str]) -> int:
        """The packs downloaded whole into the cache in front of the store (Backend.keep_whole),
        WHOLE_PACKS_AT_ONCE at a time, each in the backend's parallel parts, so that their
        pages are then read locally. Best effort: a pack not kept (no room, a failed download)
        is read range by range, as it would have been, and a damaged one is reported there,
        segment by segment. Returns the bytes downloaded."""

        def kept(name: str) -> int:
            try:
                return self.backend.keep_whole(name)
            except (CkptError, OSError):  # read range by range, as without this
                return 0

        with ThreadPoolExecutor(max_workers=WHOLE_PACKS_AT_ONCE, thread_name_prefix="ckpt-whole-pack") as pool:
            return sum(pool.map(kept, names))

    def write_image(self, image_name: str, page_list: bytes, dest: Path | None, check_ids: bool = False,  # noqa: PLR0913
                    holes: Sequence[tuple[int, int]] = (), check_holes: bool = True,
                    spool_dir: Path | None = None, checked: set[int] | None = None,
                    locations: list[int] | None = None, decoded: DecodedSegments | None = None) -> list[int]:
        """Rebuilds a pages image from its page list into dest (or only checks it, dest=None).
        Returns the location of each page (BlockIndex.pages).

        Segments are checked against their checksums; with check_ids every page is also
        rehashed against its id (`ckpt verify`). Pages are read through the backend's ranged
        reads (locally: checked through a mapping of the pack and copied by the kernel with
        sendfile, so the bytes never pass through a Python buffer). holes are (first page,
        count) ranges that are checked but left as holes of the file: a lazy restore serves
        those pages from the packs (ckpt/restore/lazy.py) and CRIU never reads them from the image.
        check_holes=False (a store in S3): reading every segment up front would download the
        whole image before the tree runs; the page server checks each segment as it first
        serves it, and damage met there ends the tree (a failed lazy restore).
        spool_dir (`ckpt verify` of a remote store): the segments of packs the backend does not
        hold locally are fetched ahead there, in large parallel requests (blocks/prefetch.py).
        checked: the segments (keys of the loaded index) found intact, shared by the images of
        one layout (ckpt/store/materialize.py): the processes of a tree share most of their
        pages (a worker pool forked from one parent), and each image of a 100-process pool
        checked the same segments again. locations: the page list's, if located already
        (locate_images). decoded: segments decoded by the other images of the layout.
        """
        index = self.index()
        if locations is None:
            locations = self.locate(image_name, page_list)
        holes = sorted(holes)
        ahead = self._ranges_ahead(locations, spool_dir) if spool_dir is not None and not holes else None
        rebuild = _ImageRebuild(self, index, image_name, page_list, locations, check_ids, dest, ahead, checked,
                                decoded)
        try:
            # Under the holes, each segment is checked once (no run needs working out: most of a
            # large tree's memory is there).
            if holes and check_holes:
                rebuild.check_segments(_segments_under(locations, holes))
            for begin, end in _between_holes(holes, len(locations)):
                rebuild.write(begin, end, seek=bool(holes))
            rebuild.raise_damage()
            if holes:
                rebuild.truncate()  # a hole at the end leaves the file short
        except DamagedCheckpoint as exc:
            if image_name in exc.message:
                raise
            raise DamagedCheckpoint(f"image {image_name}: {exc.message}") from None
        finally:
            rebuild.close()
        return locations

    def page_reader(self, ahead: Sequence[int] = (), spool_dir: Path | None = None,
                    checked: set[int] | None = None) -> PageReader:
        """Reads pages by location, each segment checked against its checksum (`ckpt copy`).
        ahead: locations it will read, in about that order: from a remote store their segments
        are fetched ahead into spool_dir, in large parallel requests (blocks/prefetch.py).
        checked: segments found intact, shared with other readers (each adds what it checks)."""
        ranges = self._ranges_ahead(list(ahead), spool_dir) if ahead and spool_dir is not None else None
        return PageReader(_SegmentReader(self, self.index(), ranges, checked))

    def page_readers(self, count: int, wanted: Sequence[int] = (), spool_dir: Path | None = None,
                     checked: set[int] | None = None, pages_wanted: dict[int, int] | None = None
                     ) -> tuple[list[PageReader], Prefetcher | None]:
        """count readers of pages by location, for as many threads (a full restore copying the
        tree's memory in, ckpt/restore/uffdfill.py); wanted: the segments they will read, in
        about that order: those of packs the backend does not hold locally are fetched ahead
        into spool_dir by one Prefetcher that every reader reads through (see page_sender);
        pages_wanted: how many pages of each they will read at least (Prefetcher's). The
        caller closes the readers, then the prefetcher."""
        index = self.index()
        fetched = self._not_held(wanted, index.segment_list) if spool_dir is not None else []
        prefetcher = None
        if fetched and spool_dir is not None:
            from ckpt.store.blocks.prefetch import Prefetcher

            prefetcher = Prefetcher(self.backend.without_copies(), index.segment_list, fetched, spool_dir,
                                    pages_wanted=pages_wanted)
            try:
                prefetcher.start()
            except OSError:  # no room for the spool: every segment read when first asked for
                prefetcher.close()
                prefetcher = None
        if prefetcher is None:
            return [PageReader(_SegmentReader(self, index, None, checked)) for _ in range(count)], None
        from ckpt.store.blocks.prefetch import PrefetchedRanges

        return [PageReader(_SegmentReader(self, index, PrefetchedRanges(
            self.backend.reader(), prefetcher, self.backend.without_copies(), owns_prefetcher=False), checked))
            for _ in range(count)], prefetcher

    def _ranges_ahead(self, locations: list[int], spool_dir: Path) -> RangeReader | None:
        """A reading session that fetches the segments of these locations (in their order) ahead
        from a remote store, or None (all held locally, or no room for the spool)."""
        if not locations:
            return None
        keys = [location >> WITHIN_BITS for location in locations]
        index = self.index()
        fetched = self._not_held(list(dict.fromkeys(keys)), index.segment_list)
        if not fetched:
            return None
        from ckpt.store.blocks.prefetch import PrefetchedRanges, Prefetcher

        prefetcher = Prefetcher(self.backend.without_copies(), index.segment_list, fetched, spool_dir)
        try:
            prefetcher.start()
        except OSError:
            prefetcher.close()
            return None
        return PrefetchedRanges(self.backend.reader(), prefetcher, self.backend.without_copies())

    def _not_held(self, wanted: Sequence[int], segments: Sequence[Segment]) -> list[int]:
        """The wanted segments of packs the backend does not hold locally."""
        remote: dict[str, bool] = {}  # per pack (a GiB's 1024 segments asked the cache 1024 times: 0.06 s)
        for key in wanted:
            pack = segments[key].pack
            if pack not in remote:
                remote[pack] = not self.backend.held_locally(pack_name(pack))
        return [key for key in wanted if remote[segments[key].pack]]

    def page_sender(self, wanted: Sequence[int] = (), spool_dir: Path | None = None) -> PageSender:
        """A sender of pages by location (a lazy restore's page server). wanted: the segments
        it will send, in the order it will likely send them; those of packs the backend does
        not hold locally (a store in S3, not cached) are fetched ahead, in parallel, into
        spool files in spool_dir (ckpt/store/blocks/prefetch.py)."""
        index = self.index()
        segments = index.segment_list
        fetched = self._not_held(wanted, segments)
        if not fetched or spool_dir is None:
            return PageSender(_SegmentReader(self, index))
        from ckpt.store.blocks.prefetch import PrefetchedRanges, Prefetcher

        prefetcher = Prefetcher(self.backend.without_copies(), segments, fetched, spool_dir)
        try:
            prefetcher.start()
        except OSError:  # no room for the spool: every segment read when first asked for, as before
            prefetcher.close()
            return PageSender(_SegmentReader(self, index))
        ranges = PrefetchedRanges(self.backend.reader(), prefetcher, self.backend.without_copies())
        return PageSender(_SegmentReader(self, index, ranges), prefetcher)


def pages_between_holes(locations: Sequence[int], holes: Sequence[tuple[int, int]]) -> list[int]:
    """The locations of an image's pages but those in its holes ((first, count) ranges, in any
    order): the pages write_image writes into the file."""
    return [location for begin, end in _between_holes(sorted(holes), len(locations))
            for location in locations[begin:end]]


def _between_holes(holes: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The [begin, end) ranges of an image of n pages between its holes (sorted (first, count))."""
    written, at = [], 0
    for first, count in holes:
        if first > at:
            written.append((at, first))
        at = max(at, first + count)
    if at < n:
        written.append((at, n))
    return written


class _ImageRebuild:
    """One BlockStore.write_image: an image's pages out of the packs into its file (or only
    checked, without a file), run by run."""

    def __init__(self, blocks: BlockStore, index: BlockIndex, image_name: str, page_list: bytes,  # noqa: PLR0913
                 locations: list[int], check_ids: bool, dest: Path | None, ranges: RangeReader | None = None,
                 checked: set[int] | None = None, decoded: DecodedSegments | None = None):
        self.blocks, self.index, self.image_name = blocks, index, image_name
        self.page_list, self.locations, self.check_ids = page_list, locations, check_ids
        self.out_fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE) if dest is not None else None
        self.reader = _SegmentReader(blocks, index, ranges, checked, decoded)
        # Only checking (verify): every damaged segment is met and recorded, not just the
        # first, so that no later dump names a page of any of them.
        self.damaged: dict[int, DamagedCheckpoint] = {}

    def check_segments(self, keys: list[int]) -> None:
        for key in keys:
            self.reader.check(key, 0, 1)

    def write(self, begin: int, end: int, seek: bool) -> None:
        """Pages [begin, end): runs of pages that follow each other within one segment
        (location + 1 is the next page), each read (and copied) at once."""
        out_fd, locations, reader = self.out_fd, self.locations, self.reader
        if out_fd is not None and seek:
            os.lseek(out_fd, begin * PAGE, os.SEEK_SET)
        starts = [begin] + [i for i in range(begin + 1, end) if locations[i] != locations[i - 1] + 1]
        for k, first in enumerate(starts):
            stop = starts[k + 1] if k + 1 < len(starts) else end
            key, within = split_location(locations[first])
            if key in self.damaged:
                continue
            try:
                if self.check_ids:
                    self._rehash(key, within, first, stop)
                elif out_fd is None:
                    reader.view(key, within, stop - first).release()  # checks (and decodes) the segment
                else:
                    reader.copy(key, within, stop - first, out_fd)
            except DamagedCheckpoint as exc:
                if out_fd is not None:
                    raise  # a restore stops at the first
                self.damaged[key] = exc

    def _rehash(self, key: int, within: int, first: int, stop: int) -> None:
        """Pages [first, stop), one run within segment key, checked against their ids (and written)."""
        count, expected = stop - first, self.page_list[first * ID_LEN:stop * ID_LEN]
        with self.reader.view(key, within, count) as chunk:
            got = page_ids(chunk, self.blocks.seed)
            if got != expected:
                j = next(j for j in range(count) if got[j * ID_LEN:(j + 1) * ID_LEN]
                         != expected[j * ID_LEN:(j + 1) * ID_LEN])
                self.blocks.record_damage(self.index.segment_list[key])
                raise DamagedCheckpoint(f"image {self.image_name}: page {first + j} does not match its id")
            if self.out_fd is not None:
                write_all(self.out_fd, chunk)

    def raise_damage(self) -> None:
        if self.damaged:
            first_error = next(iter(self.damaged.values()))
            more = f" (and {len(self.damaged) - 1} more damaged segments)" if len(self.damaged) > 1 else ""
            raise DamagedCheckpoint(first_error.message + more)

    def truncate(self) -> None:
        if self.out_fd is not None:
            os.ftruncate(self.out_fd, len(self.locations) * PAGE)

    def close(self) -> None:
        self.reader.close()
        if self.out_fd is not None:
            os.close(self.out_fd)
            self.out_fd = None


class PageReader:
    """Reads pages, given their locations (BlockStore.locate), out of the packs."""

    def __init__(self, reader: _SegmentReader):
        self.reader = reader

    def stored(self, key: int) -> bytes:
        """Segment key's bytes as stored, checked (see _SegmentReader.stored)."""
        return self.reader.stored(key)

    def read(self, locations: Sequence[int]) -> bytes:
        """The pages at these locations, one after the other (runs within a segment are read at once)."""
        parts = []
        first, end = 0, len(locations)
        while first < end:
            run = first + 1
            while run < end and locations[run] == locations[run - 1] + 1:
                run += 1
            parts.append(self.reader.pages(*split_location(locations[first]), run - first))
            first = run
        return b"".join(parts)

    def close(self) -> None:
        self.reader.close()


class PageSender:
    """Writes pages, given their locations, to a descriptor (a lazy restore's page server)."""

    def __init__(self, reader: _SegmentReader, prefetcher: Prefetcher | None = None):
        self.reader = reader
        self.prefetcher = prefetcher  # None: every segment read when first asked for

    def send(self, locations: list[int], first: int, count: int, out_fd: int) -> None:
        end = first + count
        while first < end:
            run = first + 1
            while run < end and locations[run] == locations[run - 1] + 1:
                run += 1
            location = locations[first]
            self.reader.copy(*split_location(location), run - first, out_fd)
            first = run

    def close(self) -> None:
        self.reader.close()


class DecodedSegments:
    """Segments decoded (checked first) by one reader, kept for the other readers of the same
    layout: each pages image is rebuilt by a reader of its own, and the images of a tree's
    processes draw their few eager pages (stacks, pages beside them) from the same
    compressed segments. A 100-process tree's layout decoded 1 MiB segments over and over
    for a page or two each: 0.2 s of its threads' time. At most limit bytes are kept (the
    least recently used let go); thread-safe."""

    def __init__(self, limit: int = SHARED_DECODED_BYTES):
        self.limit = limit
        self._lock = threading.Lock()
        self._segments: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._bytes = 0

    def get(self, key: int) -> bytes | None:
        with self._lock:
            data = self._segments.get(key)
            if data is not None:
                self._segments.move_to_end(key)
            return data

    def put(self, key: int, data: bytes) -> None:
        with self._lock:
            if key in self._segments or len(data) > self.limit:
                return
            self._segments[key] = data
            self._bytes += len(data)
            while self._bytes > self.limit:
                self._bytes -= len(self._segments.popitem(last=False)[1])


class _SegmentReader:
    """Reads pages out of packs, checking each segment's checksum once.

    The last HELD_SEGMENTS segments read are held, decoded (a stored-as-is segment: its stored
    bytes, a view of the mapped pack when local), because the readers of pages ask for a few
    pages at a time: a lazy restore's page server serves one faulting page, then growing runs
    of the same segment. Reading the whole segment for each (to check it, then the pages
    again) cost a remote store two requests and a 1 MiB transfer per 4 KiB page: 1.3 ms a
    page, a 192 MiB tree restored from S3 was still faulting its memory in 20 s later."""

    def __init__(self, blocks: BlockStore, index: BlockIndex, ranges: RangeReader | None = None,
                 checked: set[int] | None = None, decoded: DecodedSegments | None = None):
        self.blocks = blocks
        self.index = index
        self.ranges: RangeReader = ranges if ranges is not None else blocks.backend.reader()
        self.checked: set[int] = set() if checked is None else checked  # keys found intact
        self.decoded = decoded  # segments checked and decoded by the other readers of a layout
        self.held: collections.OrderedDict[int, memoryview] = collections.OrderedDict()

    def _damaged(self, seg: Segment, message: str) -> DamagedCheckpoint:
        self.blocks.record_damage(seg)
        return DamagedCheckpoint(message)

    def _stored(self, seg: Segment) -> memoryview:
        """The segment's stored bytes (locally, a view of the mapped pack: no copy); raises
        DamagedCheckpoint, not recorded yet (see _checked_stored)."""
        try:
            size = self.ranges.size(pack_name(seg.pack))
        except BlobNotFound:
            raise DamagedCheckpoint(f"pack {seg.pack} is missing from the store") from None
        if size == 0:
            raise DamagedCheckpoint(f"pack {seg.pack} is empty")
        if seg.offset + seg.length > size:
            raise DamagedCheckpoint(f"pack {seg.pack} is damaged at offset {seg.offset} (truncated)")
        try:
            return self.ranges.read(pack_name(seg.pack), seg.offset, seg.length)
        except DamagedBlob as exc:  # an encrypted store: the chunk holding it fails authentication
            raise DamagedCheckpoint(f"pack {seg.pack} is damaged at offset {seg.offset} ({exc.message})") from None

    def _checked_stored(self, key: int, seg: Segment) -> memoryview:
        """The segment's stored bytes, checked against its checksum (once per session). Bytes
        that fail and came from a local copy of the pack (the cache of a remote store, whose
        disk may rot) are read again from the store itself within the same command: only
        damage in the store is recorded (a marker every host sees) and raised."""
        try:
            return self._stored_and_checked(key, seg)
        except DamagedCheckpoint:
            if not self.ranges.read_again(pack_name(seg.pack)):
                self.blocks.record_damage(seg)
                raise
        try:
            stored = self._stored_and_checked(key, seg)
        except DamagedCheckpoint:
            self.blocks.record_damage(seg)
            raise
        self.ranges.read_again_intact(pack_name(seg.pack))
        return stored

    def _stored_and_checked(self, key: int, seg: Segment) -> memoryview:
        # Asked before the bytes are read: `checked` may be shared by the threads of a layout,
        # and another thread finding the segment intact in the store (after its local copy
        # failed) says nothing of the bytes this one read from that copy meanwhile.
        known = key in self.checked
        stored = self._stored(seg)
        if not known and self.ranges.checked(pack_name(seg.pack), seg.offset, seg.checksum):
            known = True
            self.checked.add(key)
        if not known:
            if xxhash.xxh3_128_digest(stored) != seg.checksum:
                stored.release()
                raise DamagedCheckpoint(f"pack {seg.pack} is damaged at offset {seg.offset}")
            self.checked.add(key)
        return stored

    def stored(self, key: int) -> bytes:
        """The segment's bytes as stored (encoded), checked against its checksum: what a
        prune copies into a new pack. DamagedCheckpoint (recorded) if the store's are damaged."""
        with self._checked_stored(key, self.index.segment_list[key]) as stored:
            return bytes(stored)

    def _segment(self, key: int, within: int, count: int) -> Segment:
        seg = self.index.segment_list[key]
        if within + count > seg.pages or (seg.codec == CODECS["none"] and seg.length != seg.pages * PAGE):
            raise self._damaged(seg, f"the index of pack {seg.pack} is damaged (segment at {seg.offset})")
        return seg

    def _pages_of(self, key: int, seg: Segment) -> memoryview:
        """The segment's pages, checked and decoded, held for the next reads (but a segment of
        a mapped pack stored as it is: reading it again costs nothing)."""
        held = self.held.get(key)
        if held is not None:
            self.held.move_to_end(key)
            return held
        shared = self.decoded.get(key) if self.decoded is not None and seg.codec != CODECS["none"] else None
        if shared is not None:
            return self._hold(key, memoryview(shared))
        stored = self._checked_stored(key, seg)
        decoded = None
        try:
            if seg.codec != CODECS["none"]:
                decoded = _decode(seg.codec, bytes(stored))
                if len(decoded) != seg.pages * PAGE:  # (its readers copy from raw addresses)
                    raise ValueError(f"{len(decoded)} bytes for {seg.pages} pages")
        except Exception as exc:  # any decoder error means the same: damaged data
            stored.release()
            raise self._damaged(seg, f"pack {seg.pack}: segment at {seg.offset} cannot be decoded ({exc})") from exc
        if decoded is not None:
            if self.decoded is not None:
                self.decoded.put(key, decoded)
            held = memoryview(decoded)
        if held is None:  # stored as it is
            if self.ranges.mapped(pack_name(seg.pack)):
                return stored
            held = stored
        else:
            stored.release()
        return self._hold(key, held)

    def _hold(self, key: int, held: memoryview) -> memoryview:
        self.held[key] = held
        if len(self.held) > HELD_SEGMENTS:
            self.held.popitem(last=False)[1].release()
        return held

    def pages(self, key: int, within: int, count: int) -> bytes:
        """count pages from position within of segment key, checked and decoded (a copy: the
        held segment may be let go, and a view of a mapped pack must not outlive close())."""
        with self.view(key, within, count) as pages:
            return bytes(pages)

    def view(self, key: int, within: int, count: int) -> memoryview:
        """The same pages without a copy: release the view (a `with` block) before the next read."""
        seg = self._segment(key, within, count)
        return self._pages_of(key, seg)[within * PAGE:(within + count) * PAGE]

    @contextlib.contextmanager
    def borrowed(self, key: int, within: int, count: int) -> Iterator[memoryview]:
        """view() for the `with` block this opens: pages of a segment stored as it is that the
        session fetched ahead and checked (a restore from a remote store) are read in place,
        in the fetched range's buffer, neither copied nor held (a copy in reads each page
        once); any other read as view(). Keep no view of it past the block."""
        seg = self._segment(key, within, count)
        lent = None
        if key not in self.held and seg.codec == CODECS["none"]:
            lent = self.ranges.lend(pack_name(seg.pack), seg.offset, seg.length, seg.checksum, count)
        if lent is None:
            with self.view(key, within, count) as pages:
                yield pages
            return
        stored, give_back = lent
        try:
            self.checked.add(key)
            with stored, stored[within * PAGE:(within + count) * PAGE] as pages:
                yield pages
        finally:
            give_back()

    def check(self, key: int, within: int, count: int) -> None:
        """Checks the segment's checksum without decoding or copying it."""
        seg = self._segment(key, within, count)
        if key not in self.checked:
            self._checked_stored(key, seg).release()

    def copy(self, key: int, within: int, count: int, out_fd: int) -> None:
        seg = self._segment(key, within, count)
        name = pack_name(seg.pack)
        if key not in self.checked and seg.codec == CODECS["none"] and self.ranges.mapped(name):
            # A local pack: checked through its mapping once, then copied file to file
            # (sendfile). The check may find the copy damaged and read the store's pack
            # instead, which is then no local mapping: hence mapped() is asked again below.
            self._checked_stored(key, seg).release()
        if seg.codec != CODECS["none"] or not self.ranges.mapped(name):
            with self._pages_of(key, seg)[within * PAGE:(within + count) * PAGE] as pages:
                write_all(out_fd, pages)
            return
        offset, length = seg.offset + within * PAGE, count * PAGE
        try:
            copied = self.ranges.copy_to(name, offset, length, out_fd)
        except DamagedBlob as exc:
            raise self._damaged(seg, f"pack {seg.pack} is damaged at offset {offset} ({exc.message})") from None
        if copied < length:
            raise self._damaged(seg, f"pack {seg.pack} is damaged at offset {offset} (truncated)")

    def close(self) -> None:
        for held in self.held.values():
            held.release()
        self.held.clear()
        self.ranges.close()
