"""Moving a dump's images from its staging area into the store, durably: the pages to the block
store (only the pages the store lacks are written), every other image file to an object.
Nothing here is visible until the dump commits its manifest (Store.commit)."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import blake3

from ckpt.errors import StoreError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store.blocks.blockstore import IngestStats, PagesIngest, StreamedPages
from ckpt.store.blocks.segments import CODECS, ID_LEN as PAGE_ID_SIZE, PAGE
from ckpt.store.bundles import BundleContents
from ckpt.store.fsutil import translate_os_error
from ckpt.store.manifest import FileEntry
from ckpt.store.objects import Objects, hash_file, object_codec as stored_codec, worth_compressing
from ckpt.store.staging import DumpStaging

# Called with the page lists before anything else is stored; may lengthen them with pages the
# store already holds (dirty-page tracking) and returns how many pages it added.
CompletePageLists = Callable[[dict[str, bytes]], int]
FILE_WORKERS = 4  # threads storing the small images: most of their time is waiting for fsync


def file_workers(objects: Objects) -> int:
    """Threads storing the small images: FILE_WORKERS, or as many as the store has requests in
    flight (in S3, each image is a request or two that mostly wait for the round trip)."""
    return max(FILE_WORKERS, objects.backend.requests_in_flight())


def ingest(objects: Objects, staging: DumpStaging, codec: str, reporter: Reporter = NullReporter(),  # noqa: PLR0913
           complete_page_lists: CompletePageLists | None = None,
           earlier: dict | None = None, ahead: IngestAhead | None = None
           ) -> tuple[list[FileEntry], int, IngestStats, BundleContents | None]:
    """Moves every image file of the staging area into the store, durably.

    pages-*.img go to the block store; every other file becomes an object. complete_page_lists,
    when given, may complete the page lists first (see CompletePageLists). Returns the file
    entries, the bytes this added to the store, the block figures and, into a remote store, a
    copy of the small objects for the checkpoint's bundle (None otherwise). earlier, when given,
    comes from a checkpoint of the same target (ckpt/dump/unchanged.py): it spares looking up
    the pages that have not changed since (see BlockStore.ingest). ahead, when given, holds
    the images of this staging area stored while CRIU still wrote the others (IngestAhead):
    they are not read again; this stores the rest and commits its pack. On an error its owner
    aborts it (ckpt/dump/early_ingest.py: abort is safe after a commit too).
    """
    if codec not in CODECS:
        raise StoreError(f"unknown compression '{codec}'", hint=f"use one of: {', '.join(CODECS)}")
    page_images, other_files = _images_left(staging, ahead)
    ingestion = ahead.files if ahead is not None else _Ingestion(objects)
    object_codec = objects_codec(codec)
    # The other images are stored by a few threads while the pages are hashed and written: a
    # tree of many processes has hundreds of small images (six or so per process), each object
    # made durable on its own (fsync of the file and of its directory): one after the other
    # they cost a 100-process dump 0.55 s while its tree was frozen (--stop).
    first, rewritten = _before_and_after_pages(other_files, complete_page_lists is not None)
    stored: list[Future] = []
    with ThreadPoolExecutor(max_workers=file_workers(objects), thread_name_prefix="ckpt-ingest") as pool:
        try:
            stored = ingestion.store_files(first, object_codec, pool)
            block_stats, lists = ingestion.store_pages(page_images, codec, reporter, complete_page_lists, earlier,
                                                       pool, ahead.pages if ahead is not None else None)
            stored += lists
            if rewritten:
                stored += ingestion.store_files(rewritten, object_codec, pool)
            for future in stored:
                future.result()
        except OSError as exc:
            raise translate_os_error(exc, "storing the images") from exc
        finally:
            for future in stored:
                future.cancel()  # the pool waits for those running on the way out
    ingestion.entries.sort(key=lambda e: e.name)
    return ingestion.entries, ingestion.added, block_stats, ingestion.bundle


def _images_left(staging: DumpStaging, ahead: IngestAhead | None) -> tuple[list[Path | StreamedPages], list[Path]]:
    """The pages images and the other image files still to store (not stored ahead)."""
    files = [p for p in staging.image_files() if ahead is None or p.name not in ahead.stored]
    pages_files = [p for p in files if is_pages(p)]
    other_files = [p for p in files if not is_pages(p)]  # (not `p not in pages_files`: quadratic)
    # Pages images CRIU streamed to ckpt instead of writing them (ckpt/dump/pagestream.py).
    return [*pages_files, *staging.streamed.values()], other_files


def is_pages(path: Path) -> bool:
    """A pages image (the block store's); every other image file is an object."""
    return path.name.startswith("pages-") and path.name.endswith(".img")


def objects_codec(codec: str) -> str:
    """The codec of the objects a dump with codec stores (zstd unless none)."""
    return "none" if codec == "none" else "zstd"


class IngestAhead:
    """Images of a dump stored one at a time, as CRIU finishes each, before ingest() stores
    the rest (ckpt/dump/early_ingest.py watches for them): pages images into one pack (not
    committed: ingest() commits it), every other image as an object by a few threads (each
    made durable on its own, fsync-bound: they overlap CRIU too). Objects are stored from a
    second name in scratch (a directory of the staging area, outside its images: a hard link,
    or a copy for what is stored as it is), so that the staging area keeps every image as
    CRIU wrote it: if the caller finds anything changed, it drops this (abort) and ingests
    all of them itself. abort() is safe at any time, after a commit too (it does nothing then).
    An object stored here and then not committed is one nobody names (prune's to reclaim),
    as after any dump that failed in its ingest."""

    def __init__(self, objects: Objects, codec: str, scratch: Path):
        scratch.mkdir()
        self.pages = objects.blocks.start_ingest(pages_codec(codec))
        self.files = _Ingestion(objects)
        self.object_codec = objects_codec(codec)
        self.scratch = scratch
        self.stored: set[str] = set()  # names of the images taken
        self._pool = ThreadPoolExecutor(max_workers=file_workers(objects), thread_name_prefix="ckpt-ingest-early")
        self._futures: list[Future] = []

    def add(self, path: Path) -> None:
        if is_pages(path):
            self.pages.add(path)
        else:
            # A second name for the file, which storing it moves into the store (or removes),
            # so that the staging area keeps the image: a hard link, not a copy (600 small
            # images of a 100-process tree copied cost 0.4 s of this thread's time), unless it
            # is to be stored as it is: then the store renames that name into place, and the
            # object would be the staging image itself (a write to the image after it was
            # read would change a published object): a copy.
            # (Decided here once: store_file takes "none" as it is, without sampling again.)
            second = self.scratch / path.name
            codec = stored_codec(path, self.object_codec)
            if codec == "none":
                shutil.copyfile(path, second)
            else:
                os.link(path, second)
            self._futures += self.files.store_files([second], codec, self._pool)
        self.stored.add(path.name)

    def add_all(self, paths: list[Path]) -> None:
        """add() of each path, the pages images handed over together (PagesIngest.add_all
        looks up the next ones while it stores one)."""
        pages = [path for path in paths if is_pages(path)]
        for path in paths:
            if not is_pages(path):
                self.add(path)
        self.pages.add_all(pages)
        self.stored.update(path.name for path in pages)

    def settle(self) -> None:
        """Waits until every object is stored; raises the first error."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Drops the pack; objects already stored stay, named by nobody."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        self.pages.abort()


def pages_codec(codec: str) -> Callable[[Path], str]:
    """The codec each pages image's new segments are stored with: codec, unless a sample of
    the image does not compress (then as they are)."""
    return lambda image: codec if codec == "none" or worth_compressing(image) else "none"


def _before_and_after_pages(files: list[Path], completed: bool) -> tuple[list[Path], list[Path]]:
    """The other images to store while the pages are, and those to store after them: a dump
    with dirty-page tracking rewrites its pagemaps while its pages are stored (runs "in parent"
    made whole, complete_page_lists); stored before, the checkpoint would keep pagemaps naming
    a parent its restore does not have."""
    rewritten = [p for p in files if p.name.startswith("pagemap-")] if completed else []
    later = set(rewritten)
    return [p for p in files if p not in later], rewritten


class _Ingestion:
    """What one ingest has stored so far: the file entries and the bytes added."""

    def __init__(self, objects: Objects):
        self.objects = objects
        self.entries: list[FileEntry] = []
        self.added = 0
        self._lock = threading.Lock()
        self._submitted: dict[str, Future] = {}  # by content: the store_file that stores it
        # Into a remote store: a copy of each small object, for the checkpoint's bundle.
        self.bundle = BundleContents() if objects.remote else None

    def store_pages(self, page_images: list[Path | StreamedPages], codec: str, reporter: Reporter,
                    complete_page_lists: CompletePageLists | None, earlier: dict | None,
                    pool: ThreadPoolExecutor, ahead: PagesIngest | None = None) -> tuple[IngestStats, list[Future]]:
        """The pages to the block store (those of the images ahead does not hold yet: it
        commits them all), then each pages image's page list as an object, in pool's threads:
        returns the figures and the futures of the page lists."""
        sizes = {p.name: p.size if isinstance(p, StreamedPages) else p.stat().st_size for p in page_images}
        run = ahead if ahead is not None else self.objects.blocks.start_ingest(pages_codec(codec), earlier)
        early = f" ({run.bytes_added // PAGE} of them stored as CRIU wrote them)" if run.bytes_added else ""
        reporter.step(f"storing {(run.bytes_added + sum(sizes.values())) // PAGE} pages{early}")
        try:
            run.tell(lambda done, total: reporter.progress(done, total, "storing pages"),
                     run.bytes_added + sum(sizes.values()))
            run.add_all([image for image in page_images if image.name not in run.page_lists])
        except BaseException:
            run.abort()
            raise
        page_lists, block_stats, _ = run.finish()
        with self._lock:
            self.added += block_stats.bytes_new
        if complete_page_lists is not None:
            from_parent = complete_page_lists(page_lists)
            block_stats.pages_from_parent = from_parent
            block_stats.pages += from_parent
            block_stats.bytes_dedup += from_parent * PAGE
        # Each image's size from its page list: the pagemaps may have been rewritten (completed),
        # and the images stored ahead are not among page_images.
        sizes = {name: len(page_list) // PAGE_ID_SIZE * PAGE for name, page_list in page_lists.items()}
        # The page lists as objects, in the pool's threads (one per process: durable one after
        # the other, they cost a 100-process dump 0.3-0.8 s). Lists alike are stored once.
        by_digest: dict[str, list[str]] = {}
        for name in page_lists:  # completion may name a pages image CRIU left empty
            by_digest.setdefault(blake3.blake3(page_lists[name]).hexdigest(), []).append(name)
        stored = [pool.submit(self.store_page_list, page_lists[names[0]], digest,
                              [(name, sizes[name]) for name in names]) for digest, names in by_digest.items()]
        return block_stats, stored

    def store_page_list(self, page_list: bytes, digest: str, images: list[tuple[str, int]]) -> None:
        """A page list as an object, and the entries of the pages images (name, size) it is of."""
        _, stored, new = self.objects.put_bytes(page_list)
        if self.bundle is not None:
            self.bundle.add(digest, page_list)
        with self._lock:
            self.added += new
            self.entries.extend(FileEntry(name, size, digest, "pages", stored, kind="pages") for name, size in images)

    def store_files(self, paths: list[Path], object_codec: str, pool: ThreadPoolExecutor) -> list[Future]:
        """Stores image files as objects in pool's threads; returns their futures (the entries are
        added as each one is done). Files of the same content (the processes of a worker pool
        have many images alike) are stored once: the first one's object is every one's, also
        across calls (a later file like one already submitted waits for it, in its thread)."""
        by_digest: dict[str, list[Path]] = {}
        for path in paths:
            by_digest.setdefault(hash_file(path), []).append(path)
        futures = []
        for digest, same in by_digest.items():
            first = self._submitted.get(digest)
            if first is None:
                self._submitted[digest] = future = pool.submit(self.store_file, same, digest, object_codec)
            else:
                sizes = [(path.name, path.stat().st_size) for path in same]
                future = pool.submit(self._like, first, digest, sizes)
            futures.append(future)
        return futures

    def _like(self, first: Future, digest: str, images: list[tuple[str, int]]) -> tuple[str, int]:
        """Entries for images of the content another call stored (first: its future); returns
        what store_file does (the codec, the stored size)."""
        stored_codec, stored_size = first.result()
        with self._lock:
            self.entries.extend(FileEntry(name, size, digest, stored_codec, stored_size) for name, size in images)
        return stored_codec, stored_size

    def store_file(self, paths: list[Path], digest: str, object_codec: str) -> tuple[str, int]:
        """Image files of one content as an object, unless the store holds it intact already.
        Called from several threads at once: each call adds its entries and bytes under the lock."""
        size = paths[0].stat().st_size
        if self.bundle is not None and self.bundle.wants(size):
            self.bundle.add(digest, paths[0].read_bytes())  # (before store_file may move the file)
        codec = stored_codec(paths[0], object_codec)
        existing = self.objects.find(digest, codecs=(codec,))
        added = 0
        if existing and self.objects.intact(existing.name, existing.codec, digest):
            stored_size = existing.size
        else:
            # New, or damaged: a damaged object is replaced, which heals every older checkpoint
            # naming it (see "Damage and healing" in docs/design.md). The first file may be moved
            # into the store (a rename): the entries are made from what was read before.
            codec, stored_size = self.objects.store_file(paths[0], digest, codec)
            added = stored_size
        with self._lock:
            self.added += added
            self.entries.extend(FileEntry(path.name, size, digest, codec, stored_size) for path in paths)
        return codec, stored_size
