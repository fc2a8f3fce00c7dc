"""Moving a dump's images from its staging area into the store, durably: the pages to the block
store (only the pages the store lacks are written), every other image file to an object.
Nothing here is visible until the dump commits its manifest (Store.commit)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ckpt.errors import StoreError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store.blocks.blockstore import IngestStats, StreamedPages
from ckpt.store.blocks.segments import CODECS, ID_LEN as PAGE_ID_SIZE, PAGE
from ckpt.store.fsutil import translate_os_error
from ckpt.store.manifest import FileEntry
from ckpt.store.objects import Objects, hash_file, worth_compressing
from ckpt.store.staging import DumpStaging

# Called with the page lists before anything else is stored; may lengthen them with pages the
# store already holds (dirty-page tracking) and returns how many pages it added.
CompletePageLists = Callable[[dict[str, bytes]], int]


def ingest(objects: Objects, staging: DumpStaging, codec: str, reporter: Reporter = NullReporter(),
           complete_page_lists: CompletePageLists | None = None,
           earlier: dict | None = None) -> tuple[list[FileEntry], int, IngestStats]:
    """Moves every image file of the staging area into the store, durably.

    pages-*.img go to the block store; every other file becomes an object. complete_page_lists,
    when given, may complete the page lists first (see CompletePageLists). Returns the file
    entries, the bytes this added to the store and the block figures. earlier, when given,
    comes from a checkpoint of the same target (ckpt/dump/unchanged.py): it spares looking up
    the pages that have not changed since (see BlockStore.ingest).
    """
    if codec not in CODECS:
        raise StoreError(f"unknown compression '{codec}'", hint=f"use one of: {', '.join(CODECS)}")
    files = staging.image_files()
    pages_files = [p for p in files if p.name.startswith("pages-") and p.name.endswith(".img")]
    other_files = [p for p in files if p not in pages_files]
    # Pages images CRIU streamed to ckpt instead of writing them (ckpt/dump/pagestream.py).
    page_images: list[Path | StreamedPages] = [*pages_files, *staging.streamed.values()]
    ingestion = _Ingestion(objects)
    # Writing the small images back to disk runs in a thread while the pages are hashed.
    fds = [os.open(p, os.O_RDONLY) for p in other_files]
    with ThreadPoolExecutor(max_workers=1) as pool:
        flushed = pool.submit(lambda: list(map(os.fsync, fds)))
        try:
            block_stats = ingestion.store_pages(page_images, codec, reporter, complete_page_lists, earlier)
            for path in other_files:
                ingestion.store_file(path, "none" if codec == "none" else "zstd")
            flushed.result()
            objects.backend.delete(ingestion.superseded)  # only now that the fresh copies are durable
        except OSError as exc:
            raise translate_os_error(exc, "storing the images") from exc
        finally:
            flushed.exception()  # never leave the thread running past the descriptors
            for fd in fds:
                os.close(fd)
    ingestion.entries.sort(key=lambda e: e.name)
    return ingestion.entries, ingestion.added, block_stats


class _Ingestion:
    """What one ingest has stored so far: the file entries, the bytes added, and the damaged
    copies under another codec's name that are deleted last."""

    def __init__(self, objects: Objects):
        self.objects = objects
        self.entries: list[FileEntry] = []
        self.added = 0
        self.superseded: list[str] = []

    def store_pages(self, page_images: list[Path | StreamedPages], codec: str, reporter: Reporter,
                    complete_page_lists: CompletePageLists | None, earlier: dict | None) -> IngestStats:
        """The pages to the block store, then each pages image's page list as an object."""
        sizes = {p.name: p.size if isinstance(p, StreamedPages) else p.stat().st_size for p in page_images}
        reporter.step(f"storing {sum(sizes.values()) // 4096} pages")
        page_lists, block_stats, _ = self.objects.blocks.ingest(
            page_images, lambda image: codec if codec == "none" or worth_compressing(image) else "none",
            earlier, lambda done, total: reporter.progress(done, total, "storing pages"))
        self.added += block_stats.bytes_new
        if complete_page_lists is not None:
            from_parent = complete_page_lists(page_lists)
            block_stats.pages_from_parent = from_parent
            block_stats.pages += from_parent
            block_stats.bytes_dedup += from_parent * PAGE
            # The pagemaps were rewritten: take their sizes again.
            sizes = {name: len(page_list) // PAGE_ID_SIZE * PAGE for name, page_list in page_lists.items()}
        for name in sorted(page_lists):  # completion may name a pages image CRIU left empty
            digest, stored, new = self.objects.put_bytes(page_lists[name], self.superseded)
            self.added += new
            self.entries.append(FileEntry(name, sizes[name], digest, "pages", stored, kind="pages"))
        return block_stats

    def store_file(self, path: Path, object_codec: str) -> None:
        """One image file as an object, unless the store holds it intact already."""
        size = path.stat().st_size
        digest = hash_file(path)
        existing = self.objects.find(digest)
        if existing and self.objects.intact(*existing, digest):
            stored_name, stored_codec = existing
            self.entries.append(FileEntry(path.name, size, digest, stored_codec,
                                          self.objects.backend.stat(stored_name).size))
            return
        # New, or damaged: a damaged object is replaced, which heals every older checkpoint
        # naming it (see "Damage and healing" in docs/design.md).
        stored_codec, stored_size = self.objects.store_file(path, digest, object_codec)
        if existing and existing[1] != stored_codec:
            self.superseded.append(existing[0])
        self.added += stored_size
        self.entries.append(FileEntry(path.name, size, digest, stored_codec, stored_size))
