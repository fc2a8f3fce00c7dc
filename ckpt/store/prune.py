"""Reclaiming space: a plan computed from every manifest, then its execution.

The order of execution keeps every remaining checkpoint restorable at every instant, so a
`kill -9` anywhere leaves the store consistent (at worst with space not yet reclaimed):
  0. free what can go before anything is written (a full disk is when a prune is needed
     most): the objects no manifest names, packs no index names, index files naming no live
     page, then the packs only those named;
  1. copy the live segments of packs worth repacking into a new pack, fsync it;
  2. write one new index covering every live page, fsync it;
  3. delete the old index files;
  4. delete the packs no index names any more, then the objects no manifest names.
Callers hold the store's exclusive lock.
"""

from __future__ import annotations

import errno
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import xxhash

from ckpt.errors import StoreError
from ckpt.phases import phase
from ckpt.store.blocks import ID_LEN, PackWriter, Segment, render_index
from ckpt.store.fsutil import atomic_write_bytes, fsync_dir, make_private_dir, translate_os_error

if TYPE_CHECKING:
    from ckpt.store.repository import Store

REPACK_DEAD_SHARE = 0.25  # repack a pack once a quarter of its bytes is dead


@dataclass
class PrunePlan:
    objects: list[Path] = field(default_factory=list)  # unreferenced whole-file objects
    drop_packs: list[str] = field(default_factory=list)  # no live segment
    repack: list[str] = field(default_factory=list)  # live segments copied out, then dropped
    unindexed_packs: list[Path] = field(default_factory=list)  # leftovers of interrupted dumps
    rewrite_index: bool = False
    bytes_freed: int = 0
    files_removed: int = 0
    live_segments: list = field(default_factory=list)
    live_pages: set = field(default_factory=set)
    dead_index_files: list[str] = field(default_factory=list)  # naming no live page
    dead_files_packs: list[str] = field(default_factory=list)  # named only by those

    def to_json(self) -> dict:
        return {"objects": len(self.objects), "drop_packs": self.drop_packs, "repack": self.repack,
                "unindexed_packs": [p.name for p in self.unindexed_packs], "rewrite_index": self.rewrite_index,
                "bytes_freed": self.bytes_freed, "files_removed": self.files_removed}


def prune_plan(store: Store) -> PrunePlan:
    damaged: list[str] = []
    manifests = store.manifests(lambda i, e: damaged.append(i))
    if damaged:
        raise StoreError(f"cannot reclaim space: manifest(s) {', '.join(damaged)} cannot be read",
                         hint="remove or repair them first ('ckpt verify --all' lists them)")
    index = store.blocks.index()
    if index.damaged_files:
        paths = ", ".join(str(store.blocks.index_dir / name) for name in index.damaged_files)
        raise StoreError(f"cannot reclaim space: index file {paths} is damaged, and the packs it names would "
                         "look unused", hint="dumps of the same processes store their pages again; to reclaim "
                         "the space anyway, remove the damaged file first (their checkpoints stay damaged)")
    plan = PrunePlan()
    referenced = {e.hash for m in manifests for e in m.files}
    for top in [store.objects_dir]:
        for sub in top.iterdir() if top.exists() else []:
            for obj in sub.iterdir():
                if obj.name.startswith(".") or obj.name.split(".", 1)[0] not in referenced:
                    plan.objects.append(obj)
                    plan.bytes_freed += obj.stat().st_size
    live_pages: set[bytes] = set()
    for m in manifests:
        for e in m.files:
            if e.kind == "pages":
                page_list = store.load_page_list(e)
                live_pages.update(page_list[i:i + ID_LEN] for i in range(0, len(page_list), ID_LEN))
    live_keys = {index.pages[p] >> 16 for p in live_pages if p in index.pages}
    pack_bytes: dict[str, int] = {}
    live_bytes: dict[str, int] = {}
    for key, seg in enumerate(index.segment_list):
        pack_bytes[seg.pack] = pack_bytes.get(seg.pack, 0) + seg.length
        if key in live_keys:
            live_bytes[seg.pack] = live_bytes.get(seg.pack, 0) + seg.length
    for pack, total in pack_bytes.items():
        live = live_bytes.get(pack, 0)
        if live == 0:
            plan.drop_packs.append(pack)
            plan.bytes_freed += _size(store.blocks.pack_path(pack))
        elif (total - live) / total >= REPACK_DEAD_SHARE:
            plan.repack.append(pack)
            plan.bytes_freed += _size(store.blocks.pack_path(pack)) - live
    indexed = set(pack_bytes)
    packs_dir = store.blocks.packs_dir
    for sub in packs_dir.iterdir() if packs_dir.exists() else []:
        for pack in sub.iterdir():
            if pack.name not in indexed:
                plan.unindexed_packs.append(pack)
                plan.bytes_freed += pack.stat().st_size
    dead_entries = len(index.pages) - len(live_pages & index.pages.keys())
    # Entries of the same page in several index files (a page written by two concurrent dumps)
    # count once in `pages`: rewriting merges the files.
    plan.rewrite_index = bool(plan.drop_packs or plan.repack or dead_entries or len(index.files) > 1)
    plan.live_segments = sorted(live_keys)
    plan.live_pages = live_pages
    if plan.rewrite_index:
        plan.dead_index_files = [name for name, columns in zip(index.files, index.columns)
                                 if not any(page in live_pages for page in columns.id_list())]
        dead = set(plan.dead_index_files)
        named_by_others = {seg.pack for seg, name in zip(index.segment_list, index.segment_file) if name not in dead}
        plan.dead_files_packs = sorted({seg.pack for seg, name in zip(index.segment_list, index.segment_file)
                                        if name in dead} - named_by_others)
    plan.files_removed = len(plan.objects) + len(plan.drop_packs) + len(plan.repack) + len(plan.unindexed_packs)
    return plan


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def execute_prune(store: Store, plan: PrunePlan) -> None:
    try:
        _execute(store, plan)
    except OSError as exc:
        raise translate_os_error(exc, "reclaiming space") from exc


def _execute(store: Store, plan: PrunePlan) -> None:
    blocks = store.blocks
    index = blocks.index()
    old_index_files = list(index.files)
    # Step 0: nothing a remaining checkpoint (or a later dump's deduplication) could reach.
    # An index file goes before its packs, as in steps 3-4: no page is ever found in a pack
    # that is gone.
    for pack_path in plan.unindexed_packs:
        pack_path.unlink(missing_ok=True)
        phase("prune.deleting")
    for obj in plan.objects:
        obj.unlink(missing_ok=True)
        phase("prune.deleting")
    if plan.dead_index_files:
        for name in plan.dead_index_files:
            (blocks.index_dir / name).unlink(missing_ok=True)
        fsync_dir(blocks.index_dir)
        for pack in plan.dead_files_packs:
            blocks.pack_path(pack).unlink(missing_ok=True)
    if plan.rewrite_index:
        try:
            new_index, segments = _write_new_index(blocks, index, plan, set(plan.repack))
            repacked = plan.repack
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not plan.repack:
                raise
            # No room for the copies: drop what is dead, leave the packs to repack as they are.
            new_index, segments = _write_new_index(blocks, index, plan, set())
            repacked = []
        for name in old_index_files:
            if name != new_index:
                (blocks.index_dir / name).unlink(missing_ok=True)
        if blocks.index_dir.exists():
            fsync_dir(blocks.index_dir)
        for pack in plan.drop_packs + repacked:
            blocks.pack_path(pack).unlink(missing_ok=True)
            phase("prune.deleting")
        blocks.drop_stale_markers({(s.pack, s.offset) for s in segments})
        blocks._index = None


def _write_new_index(blocks, index, plan: PrunePlan, repack: set[str]) -> tuple[str, list[Segment]]:
    """Steps 1 and 2: copies the live segments of the packs in `repack` into a new pack, then
    writes one index file naming every live page. Returns its name ("" if nothing is live)
    and its segments. On failure the new pack is removed: no index names it yet, and on a
    full disk it would hold the space step 0 freed."""
    new_pack = secrets.token_hex(16)
    new_pack_path = blocks.pack_path(new_pack)
    segments: list[Segment] = []
    seg_no: dict = {}
    out = None
    offset = 0
    try:
        for key in plan.live_segments:
            seg = index.segment_list[key]
            if seg.pack in repack:
                if out is None:
                    make_private_dir(new_pack_path.parent)
                    out = PackWriter(new_pack_path)
                try:
                    with open(blocks.pack_path(seg.pack), "rb") as src:
                        src.seek(seg.offset)
                        data = src.read(seg.length)
                except FileNotFoundError:
                    data = b""
                # Checked on the way: a segment of a pack with recorded damage is trusted at
                # its new place only if it is intact; one cut short is padded to its length,
                # so that the segments after it stay where the new index says they are.
                intact = len(data) == seg.length and xxhash.xxh3_128_digest(data) == seg.checksum
                out.write(data + bytes(seg.length - len(data)))  # as stored: no re-encoding
                phase("prune.repacking")
                seg = Segment(new_pack, offset, seg.length, seg.pages, seg.codec, seg.checksum)
                offset += seg.length
                if key in index.damaged or not intact:  # the only copy of a live page: still damaged
                    blocks.record_damage(seg)
            seg_no[key] = len(segments)
            segments.append(seg)
        if out is not None:
            out.sync_and_close()
            fsync_dir(new_pack_path.parent)
        phase("prune.before-index")
        if not segments:
            return "", segments
        live = [page for page in plan.live_pages if page in index.pages]
        data = render_index(segments, b"".join(live), [seg_no[index.pages[page] >> 16] for page in live],
                            [index.pages[page] & 0xFFFF for page in live])
        name = blake3.blake3(data).hexdigest()
        make_private_dir(blocks.index_dir)
        atomic_write_bytes(blocks.index_dir / name, data)
        phase("prune.index-written")
        return name, segments
    except BaseException:
        if out is not None:
            out.discard()
        new_pack_path.unlink(missing_ok=True)
        raise
