"""Where each page of a new dump sat in the target's newest checkpoint, by virtual address.

Any kernel, no dirty tracking: a dump still hashes every page, but a page whose id is the one
its address had in an earlier checkpoint is known to be in the store without looking it up in
the index (see BlockIndex.missing). For a target that rewrote 1% of 2 GiB, that spares
sorting and searching half a million ids (0.3 s). Pages are matched by address, not by their
row in the pages image: a mapping that grew or a new one shifts every row after it (a Python
heap growing between two dumps did, and the rows of the other 2 GiB no longer matched).

The earlier checkpoint's pagemaps and page lists are read in a thread while CRIU dumps (they
are in the store, which the dump's shared lock keeps); only the new pagemaps are read after.

Only a shortcut: whatever cannot be read here (an earlier checkpoint with damaged or missing
images, an image pycriu cannot parse) leaves its pages to the index lookup. Any row mapping
is safe, since a page counts as held only if its id equals the earlier one.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ckpt.criu.images import held_runs
from ckpt.store import Manifest, Store
from ckpt.store.blocks import ID_LEN, PAGE


class EarlierCheckpoint:
    """A checkpoint of the target, read ahead: each process's pagemap runs and page list."""

    def __init__(self, manifest: Manifest, store: Store, scratch: Path):
        self.manifest = manifest
        self._store, self._scratch = store, scratch  # scratch: a directory for its pagemaps
        self._processes: dict[str, tuple[list, bytes]] = {}  # pagemap name -> (runs, page list)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts reading in a thread (`rows` and `wait` wait for it)."""
        self._thread = threading.Thread(target=self._read, name="ckpt-earlier-read")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _read(self) -> None:
        from ckpt.criu import images  # deferred: imports pycriu

        files = {entry.name: entry for entry in self.manifest.files}
        for name, entry in files.items():
            if not (name.startswith("pagemap-") and name.endswith(".img")):
                continue
            try:
                self._scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
                path = self._scratch / name
                self._store.check_entry(entry, path)
                pages_id, runs = images.read_pagemap(path)
                self._processes[name] = (runs, self._store.load_page_list(files[f"pages-{pages_id}.img"]))
            except Exception:  # noqa: BLE001 - a shortcut only (see the module's docstring)
                continue

    def rows(self, images_dir: Path) -> dict[str, tuple]:
        """For each pages image of the new dump in images_dir: the earlier page list of the
        same process and, for each row of the new image, the row of that list holding the
        page at the same address (-1: none)."""
        import numpy as np

        from ckpt.criu import images  # deferred: imports pycriu

        if self._thread is None:
            self._read()
        self.wait()
        result: dict[str, tuple] = {}
        for pagemap in sorted(images_dir.glob("pagemap-*.img")):
            known = self._processes.get(pagemap.name)
            if known is None:
                continue  # a process the earlier checkpoint did not have (or could not read)
            try:
                pages_id, runs = images.read_pagemap(pagemap)
            except Exception:  # noqa: BLE001 - a shortcut only
                continue
            earlier_runs, earlier_list = known
            rows = _rows_by_address(runs, earlier_runs, len(earlier_list) // ID_LEN, np)
            if rows is not None:
                result[f"pages-{pages_id}.img"] = (earlier_list, rows)
        return result


def _rows_by_address(runs, earlier_runs, earlier_pages: int, np):
    """For each page the runs hold, the row of the earlier image holding the same address, or
    -1. None if the earlier runs do not account for the earlier page list."""
    from ckpt.store.blockindex import argsort

    held, earlier = held_runs(runs), held_runs(earlier_runs)
    if sum(n for _, n in earlier) != earlier_pages:
        return None  # a page list that does not fit its pagemap: not worth trusting
    if not held:
        return np.zeros(0, dtype=np.int64)
    if not earlier:
        return np.full(sum(n for _, n in held), -1, dtype=np.int64)
    starts = np.array([vaddr for vaddr, _ in earlier], dtype=np.uint64)
    counts = np.array([n for _, n in earlier], dtype=np.int64)
    first_rows = np.cumsum(counts) - counts
    if len(starts) > 1 and not (starts[1:] > starts[:-1]).all():
        order = argsort(starts)  # CRIU writes pagemaps in address order: not expected
        starts, counts, first_rows = starts[order], counts[order], first_rows[order]
    addresses = _addresses(held, np)
    # The earlier run that starts at or below each address (2,000 runs for 2 GiB: a search in
    # that, not in half a million page addresses), then whether the address is inside it.
    run = np.maximum(np.searchsorted(starts, addresses, side="right") - 1, 0)
    inside = addresses >= starts[run]
    offset = np.where(inside, (addresses - starts[run]) // np.uint64(PAGE), 0).astype(np.int64)
    inside &= offset < counts[run]
    return np.where(inside, first_rows[run] + offset, -1)


def _addresses(held: list[tuple[int, int]], np):
    """The address of each page of the held runs, in order."""
    starts = np.array([vaddr for vaddr, _ in held], dtype=np.uint64)
    counts = np.array([n for _, n in held], dtype=np.int64)
    first_rows = np.cumsum(counts) - counts
    within = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first_rows, counts)).astype(np.uint64)
    return np.repeat(starts, counts) + within * np.uint64(PAGE)
