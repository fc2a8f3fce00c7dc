"""Dirty-page tracking: which checkpoint a dump may give CRIU as its parent, and how the
result is made self-contained again.

On a kernel with soft-dirty bits, CRIU's --track-mem clears a process's bits when it dumps
it; the next dump with the previous images as parent reads only pages written since and
marks the others "in parent" in its pagemaps. That is only correct if nothing cleared the
bits in between: so ckpt records, before each tracked dump, which checkpoint it is about to
make of which process incarnation (tracking log). A later dump uses a parent only when the
last tracked attempt on that very process is a checkpoint that was committed and still
exists; a failed dump, a dump into another store, a removed checkpoint or a restarted
process all lead to a full dump, which starts tracking afresh.

The checkpoint stored is always complete: its pagemaps are rewritten so that pages "in
parent" name the parent's pages directly (the store holds those pages already), and restore,
verify and prune never see a parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ckpt.criu.images import PE_PARENT, PE_PRESENT
from ckpt.errors import DamagedCheckpoint
from ckpt.store.blocks.blockstore import ID_LEN as PAGE_ID_SIZE, PAGE
from ckpt.system import procfs
from ckpt.system.files import atomic_write_bytes, make_private_dir



@dataclass(frozen=True)
class TargetIdentity:
    """One incarnation of a process: a PID is reused, (boot, PID, start time) is not."""

    boot_id: str
    pid: int
    start_ticks: int

    @property
    def key(self) -> str:
        return f"{self.boot_id}-{self.pid}-{self.start_ticks}"


def identify(pid: int) -> TargetIdentity | None:
    try:
        return TargetIdentity(procfs.boot_id(), pid, procfs.start_ticks(pid))
    except (OSError, ValueError, IndexError):
        return None


class TrackingLog:
    """Per process incarnation, the last tracked dump attempt: {"store": path, "checkpoint": id}."""

    def __init__(self, root: Path):
        self.root = root  # CKPT_TRACKING_DIR

    def _path(self, target: TargetIdentity) -> Path:
        return self.root / f"{target.key}.json"

    def last_attempt(self, target: TargetIdentity) -> dict | None:
        try:
            return json.loads(self._path(target).read_text())
        except (OSError, ValueError):
            return None

    def record_attempt(self, target: TargetIdentity, store_root: Path, checkpoint_id: str) -> None:
        """Written (durably) before CRIU clears the soft-dirty bits of the target."""
        make_private_dir(self.root)
        atomic_write_bytes(self._path(target), json.dumps(
            {"store": str(store_root), "checkpoint": checkpoint_id}).encode())

    def forget_gone(self) -> None:
        """Drops the records of process incarnations that no longer exist."""
        if not self.root.exists():
            return
        for path in self.root.glob("*.json"):
            try:
                pid, start = path.stem.rsplit("-", 2)[1:]
            except ValueError:
                continue
            current = identify(int(pid)) if pid.isdigit() else None
            if current is None or str(current.start_ticks) != start:
                path.unlink(missing_ok=True)


def choose_parent(last_attempt: dict | None, store_root: Path, target: TargetIdentity,
                  parent_tracking: dict | None) -> str | None:
    """The checkpoint id CRIU may use as parent, or None for a full dump.

    last_attempt: the tracking log's record for target; parent_tracking: the "tracking" facts
    of the manifest it names (None when that checkpoint is not in the store)."""
    if not last_attempt or last_attempt.get("store") != str(store_root):
        return None
    if not parent_tracking or parent_tracking.get("target") != target.key:
        return None
    return last_attempt.get("checkpoint")


def parent_page_ids(pagemap_runs: list[tuple[int, int, int]], page_list: bytes) -> dict[int, bytes]:
    """Page address -> page id for a (self-contained) checkpoint's pagemap and page list."""
    result: dict[int, bytes] = {}
    position = 0
    for vaddr, nr_pages, flags in pagemap_runs:
        if not flags & PE_PRESENT:
            continue
        for k in range(nr_pages):
            result[vaddr + k * PAGE] = page_list[position:position + PAGE_ID_SIZE]
            position += PAGE_ID_SIZE
    return result


def flatten_runs(runs: list[tuple[int, int, int]], new_page_list: bytes,
                 parent_ids: dict[int, bytes], image_name: str
                 ) -> tuple[list[tuple[int, int, int]], bytes, int]:
    """Resolves the runs CRIU marked "in parent" against the parent's pages.

    Returns the runs with every page present, the complete page list in pagemap order, and
    how many pages came from the parent."""
    flat_runs: list[tuple[int, int, int]] = []
    ids: list[bytes] = []
    position = 0
    from_parent = 0
    for vaddr, nr_pages, flags in runs:
        if flags & PE_PARENT:
            for k in range(nr_pages):
                page_id = parent_ids.get(vaddr + k * PAGE)
                if page_id is None:
                    raise DamagedCheckpoint(
                        f"{image_name}: CRIU took the page at {vaddr + k * PAGE:#x} from the parent "
                        "checkpoint, which does not hold it")
                ids.append(page_id)
            from_parent += nr_pages
            flat_runs.append((vaddr, nr_pages, (flags & ~PE_PARENT) | PE_PRESENT))
        elif flags & PE_PRESENT:
            chunk = new_page_list[position:position + nr_pages * PAGE_ID_SIZE]
            if len(chunk) != nr_pages * PAGE_ID_SIZE:
                raise DamagedCheckpoint(f"{image_name}: the pagemap names more pages than the pages image holds")
            ids.append(chunk)
            position += nr_pages * PAGE_ID_SIZE
            flat_runs.append((vaddr, nr_pages, flags))
        else:
            flat_runs.append((vaddr, nr_pages, flags))
    if position != len(new_page_list):
        raise DamagedCheckpoint(f"{image_name}: the pages image holds pages its pagemap does not name")
    return flat_runs, b"".join(ids), from_parent


def completer(images_dir: Path, parent_dir: Path, parent_files: dict, load_page_list):
    """The function ingest calls to make a dirty-tracking dump self-contained.

    It rewrites each pagemap in images_dir that has runs "in parent" so that every run is
    present, and completes the matching page list from the parent's (parent_dir holds the
    parent's pagemaps, parent_files its manifest entries by name)."""

    def complete(page_lists: dict[str, bytes]) -> int:
        from ckpt.criu import images  # deferred: imports pycriu

        from_parent = 0
        for pagemap in sorted(images_dir.glob("pagemap-*.img")):
            pages_id, runs = images.read_pagemap(pagemap)
            if not any(flags & PE_PARENT for _, _, flags in runs):
                continue
            parent_pagemap = parent_dir / pagemap.name
            if not parent_pagemap.exists():
                raise DamagedCheckpoint(f"{pagemap.name}: CRIU used a parent image the parent checkpoint lacks")
            parent_pages_id, parent_runs = images.read_pagemap(parent_pagemap)
            parent_list = load_page_list(parent_files[f"pages-{parent_pages_id}.img"])
            name = f"pages-{pages_id}.img"
            flat_runs, page_list, taken = flatten_runs(runs, page_lists.get(name, b""),
                                                       parent_page_ids(parent_runs, parent_list), pagemap.name)
            images.write_pagemap(pagemap, pages_id, flat_runs)
            page_lists[name] = page_list
            from_parent += taken
        return from_parent

    return complete
