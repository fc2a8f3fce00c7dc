"""The pages a tree's processes share with its root, laid out once.

A worker pool forked from one parent holds most of its parent's memory, copy-on-write: the
pages images of 100 Python workers forked from one parent came to 787 MiB for 206 MiB of
distinct pages, and a full restore wrote every byte of them into its staging directory
before CRIU ran (1.25 s of the restore's 2.7 s, faulting in page cache). CRIU gives a
child's page back shared with the page it inherited when the two are equal (it reads the
child's page and compares, criu/mem.c, restore_priv_vma_content); a page marked "in parent"
(PE_PARENT, an incremental dump's) it reads from the parent images directory, the `parent`
entry of the images directory. So the pages of a process equal to the root's at the same
address are marked in parent and left out of its pages image, and `parent/` holds, under
that process's name, links to the root's pagemap and pages image: one copy of those pages,
read by every process from the same page cache. The restored memory is the same; CRIU's
auto-dedup, which punches out of each pages image what it has read, stays off (the root's
image is read again and again).
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Callable

from ckpt.system.arrays import np

from ckpt.criu.images import (PE_LAZY, PE_PARENT, PE_PRESENT, held_runs, parent_readable_mappings, read_pagemap,
                              write_pagemap)
from ckpt.store.blocks.byaddress import PagesByAddress
from ckpt.store.blocks.segments import ID_LEN, PAGE
from ckpt.store.manifest import FileEntry, Manifest

PARENT_DIR = "parent"  # CRIU's CR_PARENT_LINK
# Shared pages worth it: at least 8 MiB in all and a tenth of the tree's pages (CRIU's
# auto-dedup, off for such a restore, frees the page cache of the images it has read).
WORTH_PAGES = 2048
WORTH_SHARE = 0.1


def plan(images_dir: Path, manifest: Manifest, load_page_list: Callable[[FileEntry], bytes]
         ) -> dict[str, list[tuple[int, int]]]:
    """Marks in the staged pagemaps the pages each process shares with the tree's root (its
    first process) and returns, per pages image, the ranges of pages (first, count) to leave
    out of it; {} when too few are shared (nothing is changed then). Only pages of mappings
    CRIU reads from a parent directory (parent_readable_mappings). link() must follow once
    the root's pages image is written."""
    if len(manifest.processes) < 2:
        return {}
    entries = {entry.name: entry for entry in manifest.files if entry.kind == "pages"}
    root = _Process.read(images_dir, manifest.processes[0]["pid"], entries, load_page_list)
    if root is None or not root.pages:
        return {}
    by_address = PagesByAddress.from_runs(root.held, root.page_list)
    if by_address is None:
        return {}
    changes: dict[Path, tuple[int, list[tuple[int, int, int]]]] = {}
    left_out: dict[str, list[tuple[int, int]]] = {}
    shared_pages, all_pages = 0, root.pages
    for proc in manifest.processes[1:]:
        child = _Process.read(images_dir, proc["pid"], entries, load_page_list)
        if child is None or not child.pages or child.image == root.image:
            continue
        all_pages += child.pages
        addresses = child.addresses()
        same = by_address.same(addresses, child.ids()) & _inside(addresses,
                                                                parent_readable_mappings(images_dir, proc["pid"]))
        if not same.any():
            continue
        shared_pages += int(same.sum())
        changes[child.pagemap] = (child.pages_id, _marked_runs(child.runs, same))
        left_out[child.image] = _ranges(same)
    if shared_pages < max(WORTH_PAGES, WORTH_SHARE * all_pages):
        return {}
    for path, (pages_id, runs) in changes.items():
        write_pagemap(path, pages_id, runs)
    return left_out


def link(images_dir: Path, manifest: Manifest, left_out: dict[str, list[tuple[int, int]]]) -> None:
    """The parent images directory: under the name of each process plan() left pages of out
    (its pages image in left_out), the root's pagemap, and the root's pages image (hard
    links: one page cache)."""
    root_pid = manifest.processes[0]["pid"]
    root_pagemap = images_dir / f"pagemap-{root_pid}.img"
    pages_id, _ = read_pagemap(root_pagemap)
    parent = images_dir / PARENT_DIR
    parent.mkdir(mode=0o700)
    os.link(images_dir / f"pages-{pages_id}.img", parent / f"pages-{pages_id}.img")
    for proc in manifest.processes[1:]:
        pagemap = images_dir / f"pagemap-{proc['pid']}.img"
        if pagemap.exists() and f"pages-{read_pagemap(pagemap)[0]}.img" in left_out:
            os.link(root_pagemap, parent / pagemap.name)


def root_in_full(images_dir: Path, manifest: Manifest) -> None:
    """Marks none of the root's pages lazy: CRIU restores them from its pages image before it
    forks the other processes, so that they inherit them, and the pages plan() marked in
    parent are read from that image (a lazy page is a hole there). A full restore through
    userfaultfd then copies in only the other processes' own pages."""
    pagemap = images_dir / f"pagemap-{manifest.processes[0]['pid']}.img"
    pages_id, runs = read_pagemap(pagemap)
    if any(flags & PE_LAZY for _, _, flags in runs):
        write_pagemap(pagemap, pages_id, [(vaddr, n, flags & ~PE_LAZY) for vaddr, n, flags in runs])


def linked(images_dir: Path) -> bool:
    """Whether some pages are read from the parent images directory (auto-dedup must stay off)."""
    return (images_dir / PARENT_DIR).is_dir()


class _Process:
    """A process's staged pagemap and the ids of its pages."""

    def __init__(self, pagemap: Path, pages_id: int, runs: list[tuple[int, int, int]], page_list: bytes):
        self.pagemap, self.pages_id, self.runs, self.page_list = pagemap, pages_id, runs, page_list
        self.image = f"pages-{pages_id}.img"
        self.held = held_runs(runs)
        self.pages = len(page_list) // ID_LEN

    @classmethod
    def read(cls, images_dir: Path, pid: int, entries: dict[str, FileEntry],
             load_page_list: Callable[[FileEntry], bytes]) -> _Process | None:
        pagemap = images_dir / f"pagemap-{pid}.img"
        if not pagemap.exists():
            return None
        pages_id, runs = read_pagemap(pagemap)
        entry = entries.get(f"pages-{pages_id}.img")
        if entry is None:
            return None
        proc = cls(pagemap, pages_id, runs, load_page_list(entry))
        # Only a pagemap that accounts for its page list, all of it present (no page already in
        # a parent, none lazy): anything else is restored as it was.
        if sum(n for _, n in proc.held) != proc.pages or any(not flags & PE_PRESENT or flags & PE_PARENT
                                                             for _, n, flags in runs if n):
            return None
        return proc

    def addresses(self) -> np.ndarray:
        if not self.held:
            return np.zeros(0, dtype=np.uint64)
        return np.concatenate([np.arange(vaddr, vaddr + n * PAGE, PAGE, dtype=np.uint64) for vaddr, n in self.held])

    def ids(self) -> np.ndarray:
        return np.frombuffer(self.page_list, dtype=np.uint64).reshape(-1, 2)


def _inside(addresses: np.ndarray, mappings: list[tuple[int, int]]) -> np.ndarray:
    """For each address, whether it lies in one of the (start, end) mappings (sorted, disjoint)."""
    if not mappings:
        return np.zeros(len(addresses), dtype=bool)
    starts = np.array([start for start, _ in mappings], dtype=np.uint64)
    ends = np.array([end for _, end in mappings], dtype=np.uint64)
    k = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    found = k >= 0
    k[~found] = 0
    return found & (addresses < ends[k])


def _marked_runs(runs: list[tuple[int, int, int]], same: np.ndarray) -> list[tuple[int, int, int]]:
    """The pagemap's runs with the pages of `same` (by row) marked in parent: a run split where
    that changes; such a run holds no page of the pages image, and is not lazy either (CRIU
    would leave a lazy one to userfaultfd instead of reading it from the parent)."""
    marked: list[tuple[int, int, int]] = []
    # The rows where `same` changes, found once (numpy's calls per run cost more than the
    # rest for a process of thousands of short runs).
    changes = (np.flatnonzero(same[1:] != same[:-1]) + 1).tolist()
    shared = same.tolist()
    row = 0
    for vaddr, n, flags in runs:
        if not n:
            marked.append((vaddr, n, flags))
            continue
        inside = changes[bisect.bisect_right(changes, row):bisect.bisect_left(changes, row + n)]
        cuts = [row, *inside, row + n]
        for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
            marked.append((vaddr + (begin - row) * PAGE, end - begin,
                           (flags & ~(PE_PRESENT | PE_LAZY)) | PE_PARENT if shared[begin] else flags))
        row += n
    return marked


def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """The (first, count) runs of True rows of mask."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(begin), int(end - begin)) for begin, end in zip(edges[0::2], edges[1::2], strict=True)]
