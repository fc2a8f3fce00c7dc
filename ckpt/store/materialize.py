"""Laying a checkpoint's images out in a directory, each verified on the way: for a restore,
for inspection (show, diff, check), or as the parent images of a dirty-tracking dump."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path
from typing import Callable

from ckpt.errors import DamagedCheckpoint
from ckpt.reporting import NullReporter, Reporter
from ckpt.store.blocks.blockstore import BlockStore, DecodedSegments, pages_between_holes
from ckpt.store.blocks.segments import ID_LEN, pack_name, segment_key
from ckpt.store.manifest import FileEntry, Manifest
from ckpt.store.objects import Objects
from ckpt.store.staging import StagingArea, discard
from ckpt.system.files import FILE_MODE, make_private_dir
from ckpt.system.textutil import human_bytes



@dataclass
class LeftOut:
    """Per pages image, page ranges (first, count) left out of it altogether: the file holds
    the other pages one after the other (CRIU reads these from the parent images directory,
    ckpt/restore/treeshare.py). Not checked either: they are another image's pages.
    holes: per pages image, the ranges of the pages left (counted without those) that ckpt
    copies in itself (a full restore through userfaultfd): holes of the file, as for a lazy
    restore."""

    ranges: dict[str, list[tuple[int, int]]]
    holes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


# Per pages image, the page ranges a page server is to serve (a lazy restore): left out as
# holes of the file; or LeftOut.
HolesFor = Callable[[Path], "dict[str, list[tuple[int, int]]] | LeftOut"]
# Given the holes (per pages image, the page ranges copied in or served later): whether the
# packs holding most of the pages are to come down whole first (see materialize).
WholePacks = Callable[["dict[str, list[tuple[int, int]]]"], bool]


def materialize(objects: Objects, area: StagingArea, manifest: Manifest, reporter: Reporter = NullReporter(),
                skip_pages: bool = False, before_pages: Callable[[Path], LeftOut | None] | None = None,
                whole_packs: WholePacks = lambda holes: False) -> Path:
    """Writes the checkpoint's images into a fresh restore-* directory of area (the store's
    staging area, Store.staging_area), verifying each.

    skip_pages leaves out the page data (for inspection, which needs only the metadata).
    before_pages(directory) is called once every other image is written, before the pages
    images (the bulk): a restore checks the host there, and what it raises ends the layout;
    it may return the pages to leave out (LeftOut). whole_packs(holes), asked once the pages
    to leave out are known: whether the packs holding most of the pages to write are to be
    downloaded whole into the cache first (a full restore from a remote store, which reads
    them all before the tree runs: BlockStore.keep_packs_whole)."""
    def no_holes(directory: Path) -> dict[str, list[tuple[int, int]]] | LeftOut:
        left_out = before_pages(directory) if before_pages is not None else None
        return left_out if left_out is not None else {}

    return _lay_out(objects, area, manifest, reporter, skip_pages, no_holes, whole_packs=whole_packs)[0]


def link_images(area: StagingArea, source: Path) -> Path:
    """A fresh restore-* directory of area whose files are hard links to those of source: the
    same checkpoint laid out (and verified) by materialize for another restore of it (the
    copies of a clone), so that no byte is written twice. The files are then shared: an edit
    must replace a file (an atomic rewrite, as every edit of staged images is: they may be
    links to stored objects anyway), never write into it, and CRIU must not punch holes into
    the pages images it has read (auto_dedup). Each directory is removed on its own; the
    data goes with the last link."""
    dest = area.new_dir("restore")
    try:
        for entry in os.scandir(source):
            if not entry.is_file(follow_symlinks=False):
                raise DamagedCheckpoint(f"{entry.path} is not a regular file: the laid out images cannot be shared")
            os.link(entry.path, dest / entry.name, follow_symlinks=False)
    except BaseException:
        discard(dest)
        raise
    return dest


def materialize_lazily(objects: Objects, area: StagingArea, manifest: Manifest, holes_for: HolesFor,  # noqa: PLR0913
                       reporter: Reporter = NullReporter(), check_holes: bool = True,
                       whole_packs: WholePacks = lambda holes: False) -> tuple[Path, dict[str, list[int]]]:
    """Like materialize, for a lazy restore: holes_for(directory), called once every image
    but the pages images is written, names per pages image the page ranges a page server
    is to serve; they are verified but left out (check_holes=False: not verified here, the
    caller checks each segment before its pages reach the tree). whole_packs: see
    materialize (the holes too are read before the tree runs when the memory is copied in).
    Returns the directory and, per pages image, the location of each page (what the page
    server reads)."""
    return _lay_out(objects, area, manifest, reporter, False, holes_for, check_holes, whole_packs)


def _lay_out(objects: Objects, area: StagingArea, manifest: Manifest, reporter: Reporter, skip_pages: bool,  # noqa: PLR0913
             holes_for: HolesFor, check_holes: bool = True, whole_packs: WholePacks = lambda holes: False
             ) -> tuple[Path, dict[str, list[int]]]:
    """The images into a fresh restore-* directory of area, each verified; holes_for names the
    page ranges to verify but leave out. Returns the directory and, per pages image with
    holes, the location of each page (what a page server reads)."""
    dest = area.new_dir("restore")
    progress = _Progress(reporter, manifest.bytes_total or 1)
    locations: dict[str, list[int]] = {}
    pages = [entry for entry in manifest.files if entry.kind == "pages"]
    others = [entry for entry in manifest.files if entry.kind != "pages"]
    try:
        # Each image checked and written in a few threads: a tree of many processes has hundreds
        # of images (a 101-process tree: 712, 5 s one after the other), and the work on each
        # (reading, decompressing, hashing, writing) mostly releases the GIL; from a remote
        # store, as many threads as its requests in flight (each mostly waits for its answer).
        workers = max(LAY_OUT_WORKERS, objects.backend.requests_in_flight())
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-lay-out") as pool:
            # Images of one content (many in a worker pool) are checked once, the others linked to it.
            alike: dict[str, list[FileEntry]] = {}
            for entry in others:
                alike.setdefault(entry.hash, []).append(entry)

            def write_alike(entry: FileEntry) -> None:
                objects.check_entry(entry, dest / entry.name)
                for other in alike[entry.hash][1:]:
                    os.link(dest / entry.name, dest / other.name, follow_symlinks=False)

            _each(pool, write_alike, [same[0] for same in alike.values()], progress,
                  lambda entry: sum(other.size for other in alike[entry.hash]))
            # Pages images last: which of their pages a lazy restore leaves out depends on the pagemaps.
            if pages and not skip_pages:
                found_holes = holes_for(dest)
                left_out = found_holes if isinstance(found_holes, LeftOut) else LeftOut({}, found_holes)
                locations = _write_pages_images(objects, pool, dest, pages, left_out, check_holes, progress,
                                                whole_packs(left_out.holes))
    except BaseException:
        discard(dest)
        raise
    return dest, locations


def _write_pages_images(objects: Objects, pool: ThreadPoolExecutor, dest: Path, pages: list[FileEntry],  # noqa: PLR0913
                        left_out: LeftOut, check_holes: bool, progress: _Progress,
                        whole_packs: bool = False) -> dict[str, list[int]]:
    """The pages images into dest by the pool's threads, but the pages left out; returns, per
    image with holes, the location of each of its pages. whole_packs: the packs holding most
    of the located pages are downloaded whole into the cache first (see materialize)."""
    # Every image's pages looked up at once, before the threads write them (the page lists
    # read by the threads: from a store in S3, each is a request).
    lists = pool.map(lambda entry: objects.image_page_list(entry, left_out.ranges.get(entry.name, ())), pages)
    page_lists = {entry.name: page_list for entry, page_list in zip(pages, lists, strict=True)}
    located = objects.blocks.locate_images(page_lists)
    if whole_packs:
        # The pages this layout writes: the holes are copied in later, from ranges fetched
        # ahead in large requests while the copy goes on (a 1 GiB tree's one pack downloaded
        # whole first, then copied, took 3.6 s against 1.7-3.2 s).
        written = [pages_between_holes(located[entry.name], left_out.holes.get(entry.name, [])) for entry in pages]
        wanted = objects.blocks.packs_worth_keeping_whole(list(located.values()), written)
        if wanted:
            progress.reporter.step(f"downloading {len(wanted)} pack(s) of the checkpoint whole "
                                   f"({human_bytes(sum(wanted.values()))}): the restore reads most of them")
            objects.blocks.keep_packs_whole(list(wanted))
    # Segments found intact by one image are not checked again for the next, nor decoded
    # again while they are among the last decoded: the processes of a tree share most of their pages.
    checked: set[int] = set()
    decoded = DecodedSegments()
    locations: dict[str, list[int]] = {}

    def write_pages(entry: FileEntry) -> None:
        holes = left_out.holes.get(entry.name, ())
        found = objects.check_entry(entry, dest / entry.name, holes=holes, checked=checked, check_holes=check_holes,
                                    located=(page_lists[entry.name], located[entry.name]), decoded=decoded)
        if holes and found is not None:
            locations[entry.name] = found

    _each(pool, write_pages, pages, progress)
    return locations


LAY_OUT_WORKERS = 4
# A tree with this many other images (each a request from a remote store) has its packs
# downloaded whole while they come (PacksAhead): fewer take too little time to hide a download.
PACKS_AHEAD_MIN_OBJECTS = 64
PACKS_AHEAD_MIN_READERS = 8  # images reading a pack for it to come down whole ahead


class PacksAhead:
    """The packs a full restore from a remote store reads most of (BlockStore.
    packs_worth_keeping_whole, counting every page of the checkpoint as read by the layout),
    downloaded whole into the cache in front of the store by a thread while the restore's
    other images are still laid out: a tree's hundreds of small images are requests that take
    their time (a 101-process tree's 513, 1.5 s from a server on this host), and its one 300
    MiB pack came down only after them. Best effort, as keep_packs_whole: what is not kept by
    the time the pages images are written is decided and read as without this (whatever went
    wrong here is met there again, and reported there). page_lists: the futures of the
    checkpoint's page lists, being read."""

    def __init__(self, blocks: BlockStore, page_lists: list[Future[bytes]]):
        self.wanted: dict[str, int] | None = None  # the packs (blob name: bytes) to download, once decided
        self.kept: list[str] = []  # those held in the cache once done
        self.left: set[str] = set()  # packs worth it that few images read: the layout's to decide
        self._decided = threading.Event()
        self._thread = threading.Thread(target=self._keep, args=(blocks, page_lists), name="ckpt-packs-ahead",
                                        daemon=True)
        self._thread.start()

    def _keep(self, blocks: BlockStore, page_lists: list[Future[bytes]]) -> None:
        try:
            lists = [future.result() for future in page_lists]
            # Every page at once, as one array (image by image, as lists of locations, the
            # decision took 0.18 s of a 101-process tree's restore before its download began).
            located = blocks.index().find(b"".join(lists))
            if len(located) == 0 or located.min() < 0:
                return  # a page missing: the layout says which (and the decision is its)
            wanted = blocks.packs_worth_keeping_whole([located], [located])
            readers = _readers_of_packs(blocks, located, [len(page_list) // ID_LEN for page_list in lists])
            # Only packs many images read a little of each (a tree's): one image's many pages
            # (a 1 GiB process's) come in large ranges fetched ahead while the copy goes on,
            # sooner than downloaded whole first (see materialize); the layout decides those.
            self.left = {name for name in wanted if readers.get(name, 0) < PACKS_AHEAD_MIN_READERS}
            wanted = self.wanted = {name: size for name, size in wanted.items() if name not in self.left}
            self._decided.set()
            if wanted:
                blocks.keep_packs_whole(list(wanted))
                self.kept = [name for name in wanted if blocks.backend.held_locally(name)]
        except Exception:  # noqa: BLE001 - best effort (see above); a read cancelled included
            pass
        finally:
            self._decided.set()

    def wait(self, reporter: Reporter = NullReporter()) -> bool:
        """Returns once the downloads begun are done (no thread of this is left running),
        telling the reporter of them; whether it decided which packs to download (then that
        decision stands: made again, it could take the room in the cache these copies took)."""
        self._decided.wait()
        running = self._thread.is_alive()
        if self.wanted and running:
            reporter.step(f"downloading {len(self.wanted)} pack(s) of the checkpoint whole "
                          f"({human_bytes(sum(self.wanted.values()))}): the restore reads most of them")
        self._thread.join()
        if self.kept and self.wanted and not running:
            reporter.step(f"downloaded {len(self.kept)} pack(s) of the checkpoint whole "
                          f"({human_bytes(sum(self.wanted[name] for name in self.kept))}) while the other "
                          "images came: the restore reads most of them")
        return self.wanted is not None and not self.left


def _readers_of_packs(blocks: BlockStore, located, counts: list[int]) -> dict[str, int]:
    """For each pack (blob name), how many of the images read it: located holds the location
    of every page of the images, one after the other, counts how many pages each has."""
    from ckpt.system.arrays import distinct, np

    segments = blocks.index().segment_list
    keys, of_page = np.unique(segment_key(located), return_inverse=True)
    names = [pack_name(segments[key].pack) for key in keys.tolist()]
    packs, of_key = np.unique(np.asarray(names, dtype=object), return_inverse=True)
    image = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    # Each (image, pack) once: how many images each pack has.
    pairs = distinct(image * len(packs) + of_key[of_page.reshape(-1)])
    return dict(zip(packs.tolist(), np.bincount(pairs % len(packs), minlength=len(packs)).tolist(), strict=True))


class _Progress:
    """Bytes of the checkpoint's images laid out so far, told to the reporter (from one thread)."""

    def __init__(self, reporter: Reporter, total: int):
        self.reporter, self.total, self.done = reporter, total, 0

    def add(self, size: int) -> None:
        self.done += size
        self.reporter.progress(self.done, self.total, "verifying images")


def _each(pool: ThreadPoolExecutor, work: Callable[[FileEntry], object], entries: list[FileEntry],
          progress: _Progress, size: Callable[[FileEntry], int] = lambda entry: entry.size) -> None:
    """work(entry) for every entry in the pool's threads; returns once all are done. The first
    failure is raised once the others have stopped (none is started after it): the caller
    removes the directory they write into."""
    futures = {pool.submit(work, entry): entry for entry in entries}
    try:
        for future in as_completed(futures):
            future.result()
            progress.add(size(futures[future]))
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)
        raise


def materialize_parent(objects: Objects, manifest: Manifest, dest: Path) -> None:
    """Lays out a checkpoint as the parent images of a dirty-tracking dump: CRIU reads only the
    parent's inventory and pagemaps, so its pages images are left as sparse files of their
    size (no page is read or written)."""
    if objects.blocks.damage_markers():
        # CRIU would take pages from the parent without reading them: none may be damaged.
        _check_no_damaged_pages(objects, manifest)
    make_private_dir(dest)
    for entry in manifest.files:
        if entry.kind == "pages":
            with open(os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
                f.truncate(entry.size)
        elif entry.name == "inventory.img" or entry.name.startswith("pagemap-"):
            objects.check_entry(entry, dest / entry.name)


def _check_no_damaged_pages(objects: Objects, manifest: Manifest) -> None:
    index = objects.blocks.index()
    for entry in manifest.files:
        if entry.kind == "pages":
            page_list = objects.load_page_list(entry)
            objects.blocks.check_suspect(page_list)
            if not index.held(page_list).all():
                raise DamagedCheckpoint(f"checkpoint {manifest.id}: image {entry.name} holds pages "
                                        "recorded as damaged")
