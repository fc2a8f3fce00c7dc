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

import bisect
import threading
from pathlib import Path

from ckpt.criu.images import held_runs
from ckpt.store import Manifest, Store
from ckpt.store.blocks.blockstore import ID_LEN, PAGE


class EarlierCheckpoint:
    """A checkpoint of the target, read ahead: each process's pagemap runs and page list."""

    def __init__(self, manifest: Manifest, store: Store, scratch: Path):
        self.manifest = manifest
        self._store, self._scratch = store, scratch  # scratch: a directory for its pagemaps
        self._processes: dict[str, tuple[list, bytes]] = {}  # pagemap name -> (runs, page list)
        self._thread: threading.Thread | None = None
        self._read_already = False

    def start(self) -> None:
        """Starts reading in a thread (`rows` and `wait` wait for it), unless read_now() did."""
        if self._read_already:
            return
        self._thread = threading.Thread(target=self._read, name="ckpt-earlier-read")
        self._thread.start()

    def read_now(self) -> dict[str, tuple[list, bytes]]:
        """Reads now, in this thread: each pagemap image name's (runs, page list)."""
        self._read()
        return self._processes

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _read(self) -> None:
        from ckpt.criu import images  # deferred: imports pycriu

        self._read_already = True
        files = {entry.name: entry for entry in self.manifest.files}
        for name, entry in files.items():
            if not (name.startswith("pagemap-") and name.endswith(".img")):
                continue
            try:
                self._scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
                path = self._scratch / name
                self._store.objects.check_entry(entry, path)
                pages_id, runs = images.read_pagemap(path)
                self._processes[name] = (runs, self._store.objects.load_page_list(files[f"pages-{pages_id}.img"]))
            except Exception:  # noqa: BLE001 - a shortcut only (see the module's docstring)
                continue

    def pieces(self, images_dir: Path) -> dict[str, tuple]:
        """For each pages image of the new dump in images_dir: the earlier page list of the
        same process, and where the new image's pages sat in it (see `_pieces_by_address`)."""
        from ckpt.criu import images  # deferred: imports pycriu

        if self._thread is None and not self._read_already:
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
            pieces = _pieces_by_address(runs, earlier_runs, len(earlier_list) // ID_LEN)
            if pieces is not None:
                result[f"pages-{pages_id}.img"] = (earlier_list, pieces)
        return result


def _pieces_by_address(runs, earlier_runs, earlier_pages: int):
    """Where the pages the runs hold sat in the earlier image: an array of (row, earlier row,
    count), one per stretch of consecutive rows whose addresses the earlier image held at
    consecutive rows, in row order; rows in no stretch had no page there. None if the earlier
    runs do not account for the earlier page list.

    Stretches, not a row per page: with a layout that did not change, or a mapping that grew,
    they are a handful for half a million pages, and comparing ids stretch by stretch reads
    both page lists in order (BlockIndex.missing)."""
    # (Here, not at the top: byaddress imports numpy, which a dump loads once CRIU has started.)
    from ckpt.store.blocks.byaddress import runs_by_address
    from ckpt.system.arrays import np

    held = held_runs(runs)
    by_address = runs_by_address(held_runs(earlier_runs), earlier_pages)
    if by_address is None:
        return None
    starts = [start for start, _, _ in by_address]
    pieces: list[list[int]] = []
    row = 0
    for vaddr, n in held:
        end = vaddr + n * PAGE
        k = max(bisect.bisect_right(starts, vaddr) - 1, 0)
        while k < len(by_address) and by_address[k][0] < end:
            earlier_start, earlier_end, earlier_row = by_address[k]
            low, high = max(vaddr, earlier_start), min(end, earlier_end)
            if low < high:
                at, then, count = row + (low - vaddr) // PAGE, earlier_row + (low - earlier_start) // PAGE, \
                    (high - low) // PAGE
                last = pieces[-1] if pieces else None
                if last and last[0] + last[2] == at and last[1] + last[2] == then:
                    last[2] += count  # continues the stretch before it
                else:
                    pieces.append([at, then, count])
            k += 1
        row += n
    return np.array(pieces, dtype=np.int64).reshape(-1, 3)
