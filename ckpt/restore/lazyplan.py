"""What a lazy restore (and a full restore through userfaultfd) leaves out of the pages images
and copies in afterwards: per process, the runs of lazy pages and where each page is in the store."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.criu.images import lazy_runs
from ckpt.store import Manifest
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.blocks.segments import segment_key


def thp_always() -> bool:
    """Whether transparent huge pages are on for every mapping, not only madvised ones."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@dataclass
class LazyPlan:
    """What a page server serves: per process, its pagemap's lazy entries
    (vaddr, nr_pages, first position in its pages image) and its pages image's name; per
    pages image, the location of each page in the store."""

    runs: dict[int, tuple[str, list[tuple[int, int, int]]]] = field(default_factory=dict)
    locations: dict[str, list[int]] = field(default_factory=dict)

    def prepare(self, images_dir: Path, manifest: Manifest, minimum_bytes: int
                ) -> dict[str, list[tuple[int, int]]] | None:
        """Reads (and adjusts) the staged pagemaps: the page ranges to leave out of each pages
        image, {} when fewer than minimum_bytes would be lazy, None when the restore must not
        be lazy (criu/images.py, lazy_runs)."""
        # Under THP "always", a checkpoint that took pages from its parent (dirty tracking) may
        # hold many eager pages in any mapping: treated like a MADV_HUGEPAGE one.
        took_from_parent = bool((manifest.criu.get("tracking") or {}).get("pages_from_parent"))
        runs = lazy_runs(images_dir, huge_pages_everywhere=thp_always() and took_from_parent)
        if runs is None:
            return None
        self.runs = runs
        return self.holes() if self.pages * PAGE >= minimum_bytes else {}

    def holes(self) -> dict[str, list[tuple[int, int]]]:
        holes: dict[str, list[tuple[int, int]]] = {}
        for image, runs in self.runs.values():
            holes.setdefault(image, []).extend((first, nr_pages) for _, nr_pages, first in runs)
        return holes

    @property
    def pages(self) -> int:
        return sum(nr_pages for _, runs in self.runs.values() for _, nr_pages, _ in runs)


def needed_segments(plan: LazyPlan) -> list[int]:
    """The segments holding the plan's lazy pages, each once, in the order the daemon will
    likely ask for them: it fills in each process's memory by address, the processes in turn,
    so the processes' segments are taken in turn, each process's by address."""
    from ckpt.system.arrays import np  # (not for a dump, which imports this module too)

    per_process: list[list[int]] = []
    for image, runs in plan.runs.values():
        # By array: a GiB's 263,000 pages one by one took 0.1 s of the page server's start,
        # before its first fetch.
        keys_of_pages = segment_key(np.asarray(plan.locations.get(image, []), dtype=np.int64))
        keys: dict[int, None] = {}
        for _, nr_pages, first in sorted(runs):
            run = keys_of_pages[first:first + nr_pages]
            if len(run):
                changes = np.flatnonzero(run[1:] != run[:-1]) + 1  # where the next segment begins
                keys.update(dict.fromkeys(run[np.concatenate(([0], changes))].tolist()))
        per_process.append(list(keys))
    order: dict[int, None] = {}
    for turn in itertools.zip_longest(*per_process):
        for key in turn:
            if key is not None:
                order[key] = None
    return list(order)


def pages_by_segment(plan: LazyPlan) -> dict[int, int]:
    """How many distinct pages of each segment the plan's lazy pages are: what the copy in
    reads of it at least (a page in several processes, or at several addresses, is read for
    each; one repeated is read as a copy, see Prefetcher.lend)."""
    from ckpt.system.arrays import distinct, np

    of_image = {image: np.asarray(locations, dtype=np.int64) for image, locations in plan.locations.items()}
    no_locations = np.empty(0, dtype=np.int64)
    locations = [of_image.get(image, no_locations)[first:first + nr_pages]
                 for image, runs in plan.runs.values() for _, nr_pages, first in runs if nr_pages]
    if not locations:
        return {}
    found, counts = np.unique(segment_key(distinct(np.concatenate(locations))), return_counts=True)
    return dict(zip(found.tolist(), counts.tolist(), strict=True))
