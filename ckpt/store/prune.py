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
Before step 0, the manifests of unfinished members (docs/design.md, "Groups") are removed.
Callers hold the store's exclusive lock. Everything goes through the store's backend.
"""

from __future__ import annotations

import errno
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

from ckpt.errors import DamagedCheckpoint, StoreError
from ckpt.phases import phase
from ckpt.store import journal
from ckpt.store.backends import BlobInfo
from ckpt.store.blocks.blockstore import BlockStore
from ckpt.store.bundles import BUNDLES_PREFIX
from ckpt.store.blocks.index import BlockIndex, render_index
from ckpt.store.blocks.segments import ID_LEN, INDEX_PREFIX, Segment, pack_name, segment_key, split_location
from ckpt.store.fsutil import translate_os_error
from ckpt.store.repository import MANIFESTS_PREFIX, OBJECTS_PREFIX, Manifest, Store

PACKS_PREFIX = "packs/"

REPACK_DEAD_SHARE = 0.25  # repack a pack once a quarter of its bytes is dead


@dataclass
class PrunePlan:
    # Blob names: unreferenced whole-file objects, and what writes that never finished left
    # under objects/ and index/.
    objects: list[str] = field(default_factory=list)
    drop_packs: list[str] = field(default_factory=list)  # no live segment
    repack: list[str] = field(default_factory=list)  # live segments copied out, then dropped
    unindexed_packs: list[str] = field(default_factory=list)  # blob names: leftovers of interrupted dumps
    rewrite_index: bool = False
    bytes_freed: int = 0
    files_removed: int = 0
    live_segments: list = field(default_factory=list)
    live_pages: set = field(default_factory=set)
    dead_index_files: list[str] = field(default_factory=list)  # naming no live page
    dead_files_packs: list[str] = field(default_factory=list)  # named only by those
    # Journal records no remaining checkpoint can need, in batches deleted in order
    # (ckpt/store/journal.py prunable: intents before their outcomes).
    journal: list[list[str]] = field(default_factory=list)
    # Checkpoint IDs: members of group checkpoints that never committed (no group manifest),
    # removed first, so that what only they name is reclaimed with the rest.
    unfinished_members: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"objects": len(self.objects), "drop_packs": self.drop_packs, "repack": self.repack,
                "unindexed_packs": [p.rpartition("/")[2] for p in self.unindexed_packs],
                "rewrite_index": self.rewrite_index,
                "journal_records": sum(name.endswith(".done.json") for batch in self.journal for name in batch),
                "unfinished_members": self.unfinished_members,
                "bytes_freed": self.bytes_freed, "files_removed": self.files_removed}


def collect_garbage(store: Store) -> tuple[int, int]:
    """Removes what dead commands left, then plans and executes a prune (rm, forget --prune).
    Returns (files removed, bytes freed). The caller holds the exclusive lock."""
    plan = sweep_and_plan(store)
    execute_prune(store, plan)
    return plan.files_removed, plan.bytes_freed


def sweep_and_plan(store: Store) -> PrunePlan:
    """The clean-up every prune starts with (staging and restore directories of commands that
    are gone), then the plan. The caller holds the exclusive lock."""
    store.remove_leftovers()
    store.remove_restore_leftovers()
    return prune_plan(store)


def prune_plan(store: Store) -> PrunePlan:
    """What prune would do, computed without changing anything (a dry run prints it)."""
    finished, unfinished, index = _readable_manifests_and_index(store)
    plan = PrunePlan()
    young = _young(store.backend)
    stale, still_young = _split_unfinished(store, unfinished, young)
    plan.unfinished_members = [m.id for m in stale]
    manifests = finished + still_young  # what stays: everything they name is live
    plan.journal = journal.prunable(store.backend, [(m.id, m.name) for m in manifests])
    _plan_objects(plan, store.backend, {e.hash for m in manifests for e in m.files}, young)
    _plan_bundles(plan, store.backend, {m.id for m in manifests}, young)
    live_pages = _live_pages(store, index, manifests, young)
    live_keys = {segment_key(index.pages[p]) for p in live_pages if p in index.pages}
    _plan_packs(plan, store.backend, index, live_keys, young)
    dead_entries = len(index.pages) - len(live_pages & index.pages.keys())
    # Entries of the same page in several index files (a page written by two concurrent dumps)
    # count once in `pages`: rewriting merges the files.
    plan.rewrite_index = bool(plan.drop_packs or plan.repack or dead_entries or len(index.files) > 1)
    plan.live_segments = sorted(live_keys)
    plan.live_pages = live_pages
    if plan.rewrite_index:
        _plan_dead_index_files(plan, index, live_pages)
    plan.files_removed = len(plan.objects) + len(plan.drop_packs) + len(plan.repack) + len(plan.unindexed_packs) \
        + sum(len(batch) for batch in plan.journal) + len(plan.unfinished_members)
    return plan


def _readable_manifests_and_index(store: Store):
    """Every manifest (those a reader sees, those of unfinished members) and the index, refused
    if any cannot be read: what they name would look unused."""
    damaged: list[str] = []
    finished, unfinished = store.manifests_by_visibility(lambda i, e: damaged.append(i))
    if damaged:
        raise StoreError(f"cannot reclaim space: manifest(s) {', '.join(damaged)} cannot be read",
                         hint="remove or repair them first ('ckpt verify --all' lists them)")
    index = store.blocks.index()
    if index.damaged_files:
        paths = ", ".join(store.backend.where(INDEX_PREFIX + name) for name in index.damaged_files)
        raise StoreError(f"cannot reclaim space: index file {paths} is damaged, and the packs it names would "
                         "look unused", hint="dumps of the same processes store their pages again; to reclaim "
                         "the space anyway, remove the damaged file first (their checkpoints stay damaged)")
    return finished, unfinished, index


def _split_unfinished(store: Store, unfinished: list[Manifest], young) -> tuple[list[Manifest], list[Manifest]]:
    """The unfinished members to remove, and those to keep: on a store whose locks can be lost,
    a member committed less than the margin ago may belong to a group checkpoint still being
    taken (its group manifest not written yet), so it stays, and so does what it names."""
    if not unfinished:
        return [], []
    blobs = {info.name: info for info in store.backend.list(MANIFESTS_PREFIX)}
    stale: list[Manifest] = []
    kept: list[Manifest] = []
    for manifest in unfinished:
        info = blobs.get(Store.manifest_name(manifest.id))
        (kept if info is None or young(info) else stale).append(manifest)
    return stale, kept


def _plan_objects(plan: PrunePlan, backend, referenced: set[str], young) -> None:
    """Whole-file objects no manifest names, and writes under objects/ and index/ that never finished."""
    for info in backend.list(OBJECTS_PREFIX):
        if info.name.rpartition("/")[2].split(".", 1)[0] not in referenced and not young(info):
            plan.objects.append(info.name)
            plan.bytes_freed += info.size
    for info in backend.list(OBJECTS_PREFIX, incomplete=True) + backend.list(INDEX_PREFIX, incomplete=True):
        if not young(info):
            plan.objects.append(info.name)
            plan.bytes_freed += info.size


def _plan_bundles(plan: PrunePlan, backend, live_ids: set[str], young) -> None:
    """The bundles of checkpoints that are gone, or that a dump never committed (a young one
    may be a dump's, written before its manifest)."""
    for info in backend.list(BUNDLES_PREFIX):
        if info.name[len(BUNDLES_PREFIX):] not in live_ids and not young(info):
            plan.objects.append(info.name)
            plan.bytes_freed += info.size
    for info in backend.list(BUNDLES_PREFIX, incomplete=True):  # an upload that died midway
        if not young(info):
            plan.objects.append(info.name)
            plan.bytes_freed += info.size


def _live_pages(store: Store, index, manifests, young) -> set[bytes]:
    """The ids of the pages a checkpoint names, or a young index file (a dump's still committing)."""
    live_pages: set[bytes] = set()
    young_files = {info.name[len(INDEX_PREFIX):] for info in store.backend.list(INDEX_PREFIX) if young(info)}
    for name, columns in zip(index.files, index.columns, strict=True):
        if name in young_files:
            live_pages.update(columns.id_list())
    for m in manifests:
        for e in m.files:
            if e.kind == "pages":
                page_list = store.objects.load_page_list(e)
                live_pages.update(page_list[i:i + ID_LEN] for i in range(0, len(page_list), ID_LEN))
    return live_pages


def _plan_packs(plan: PrunePlan, backend, index, live_keys: set[int], young) -> None:
    """Packs with nothing live (dropped), with much dead (repacked), and packs no index names."""
    pack_bytes: dict[str, int] = {}
    live_bytes: dict[str, int] = {}
    for key, seg in enumerate(index.segment_list):
        pack_bytes[seg.pack] = pack_bytes.get(seg.pack, 0) + seg.length
        if key in live_keys:
            live_bytes[seg.pack] = live_bytes.get(seg.pack, 0) + seg.length
    stored = {info.name: info for info in backend.list(PACKS_PREFIX)}
    for pack, named in pack_bytes.items():
        live = live_bytes.get(pack, 0)
        # What the pack takes: a file adopted as a pack (a pages image) may hold bytes no
        # segment names (dead too), or have had them punched out (PackWriter.commit).
        size = stored[pack_name(pack)].held if pack_name(pack) in stored else 0
        total = max(named, size)
        if live == 0:
            plan.drop_packs.append(pack)
            plan.bytes_freed += size
        elif (total - live) / total >= REPACK_DEAD_SHARE:
            plan.repack.append(pack)
            plan.bytes_freed += max(0, size - live)
    indexed = {pack_name(pack) for pack in pack_bytes}
    for info in [info for name, info in stored.items() if name not in indexed] + backend.list(PACKS_PREFIX,
                                                                                                incomplete=True):
        if young(info):
            continue
        plan.unindexed_packs.append(info.name)
        plan.bytes_freed += info.held


def _plan_dead_index_files(plan: PrunePlan, index, live_pages: set[bytes]) -> None:
    """Index files with no live page, and the packs only they name."""
    plan.dead_index_files = [name for name, columns in zip(index.files, index.columns, strict=True)
                             if not any(page in live_pages for page in columns.id_list())]
    dead = set(plan.dead_index_files)
    segment_files = list(zip(index.segment_list, index.segment_file, strict=True))
    named_by_others = {seg.pack for seg, name in segment_files if name not in dead}
    plan.dead_files_packs = sorted({seg.pack for seg, name in segment_files if name in dead} - named_by_others)


def _young(backend) -> Callable[[BlobInfo], bool]:
    """Whether a blob is within the backend's safety margin (see "Pruning" in design.md):
    never for local stores (margin 0), else modified less than the margin ago by the server's
    clock."""
    margin = backend.gc_margin()
    if margin <= 0:
        return lambda info: False
    cutoff = backend.now() - margin
    return lambda info: info.modified is None or info.modified > cutoff


def execute_prune(store: Store, plan: PrunePlan) -> None:
    try:
        _execute(store, plan)
    except OSError as exc:
        raise translate_os_error(exc, "reclaiming space") from exc


def _execute(store: Store, plan: PrunePlan) -> None:
    blocks, backend = store.blocks, store.backend
    index = blocks.index()
    old_index_files = list(index.files)
    store.check_lock("deleting what no checkpoint uses")
    # The unfinished members first: what only they name is planned as dead already.
    store.remove(plan.unfinished_members)
    # Step 0: nothing a remaining checkpoint (or a later dump's deduplication) could reach.
    # An index file goes before its packs, as in steps 3-4: no page is ever found in a pack
    # that is gone (each delete is durable when it returns).
    _delete(backend, plan.unindexed_packs + plan.objects)
    for batch in plan.journal:  # each durable before the next
        backend.delete(batch)
    if plan.dead_index_files:
        backend.delete([INDEX_PREFIX + name for name in plan.dead_index_files])
        backend.delete([pack_name(pack) for pack in plan.dead_files_packs])
    if plan.rewrite_index:
        repack = set(plan.repack)
        try:
            new_index, segments, kept = _write_new_index(blocks, index, plan, repack)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not plan.repack:
                raise
            # No room for the copies: drop what is dead, leave the packs to repack as they are.
            repack = set()
            new_index, segments, kept = _write_new_index(blocks, index, plan, repack)
        repacked = [pack for pack in plan.repack if pack in repack and pack not in kept]
        backend.delete([INDEX_PREFIX + name for name in old_index_files if name != new_index])
        _delete(backend, [pack_name(pack) for pack in plan.drop_packs + repacked])
        blocks.drop_stale_markers({(s.pack, s.offset) for s in segments})
        blocks.forget_index()


def _delete(backend, names: list[str]) -> None:
    """Deletes durably; the first name alone, so that a test can stop prune between two
    deletions (phase prune.deleting)."""
    if names:
        backend.delete(names[:1])
        phase("prune.deleting")
        backend.delete(names[1:])


def _intact_stored(reader, index: BlockIndex, key: int) -> bytes | None:
    """The segment's bytes as stored (no re-encoding), checked; None when they are damaged or
    recorded damaged: such a segment stays where it is, even where the checksum passes (a
    segment that cannot be decoded, a page that does not match its id)."""
    seg = index.segment_list[key]
    try:
        if key in index.damaged:
            raise DamagedCheckpoint(f"segment at {seg.offset} of pack {seg.pack} is recorded damaged")
        return reader.stored(key)
    except DamagedCheckpoint:
        return None


def _put_index(backend, index: BlockIndex, plan: PrunePlan, segments: list[Segment], seg_no: dict) -> str:
    """One index file naming every live page in its (new) segment; returns its name."""
    live = [page for page in plan.live_pages if page in index.pages]
    data = render_index(segments, b"".join(live), [seg_no[segment_key(index.pages[page])] for page in live],
                        [split_location(index.pages[page])[1] for page in live])
    name = blake3.blake3(data).hexdigest()
    backend.put(INDEX_PREFIX + name, data)
    phase("prune.index-written")
    return name


def _write_new_index(blocks: BlockStore, index: BlockIndex, plan: PrunePlan, repack: set[str]
                     ) -> tuple[str, list[Segment], set[str]]:
    """Steps 1 and 2: copies the live segments of the packs in `repack` into a new pack, then
    writes one index file naming every live page. Returns its name ("" if nothing is live),
    its segments, and the packs of `repack` to keep as they are. On failure the new pack is
    removed: no index names it yet, and on a full disk it would hold the space step 0 freed.

    Every segment copied is checked against its checksum first (a damaged copy in a remote
    store's cache is read again from the store itself). A segment whose bytes in the store
    are damaged (or gone) is never copied: it stays where it is, recorded as damaged, and so
    does its pack, so that nothing damaged is ever written and no original is deleted
    unless every byte copied out of it was verified."""
    backend = blocks.backend
    new_pack = secrets.token_hex(16)
    segments: list[Segment] = []
    seg_no: dict = {}
    kept: set[str] = set()
    out = None
    offset = 0
    reader = blocks.page_reader()
    try:
        for key in plan.live_segments:
            seg = index.segment_list[key]
            if seg.pack in repack:
                data = _intact_stored(reader, index, key)
                if data is None:
                    kept.add(seg.pack)
                else:
                    if out is None:
                        out = backend.writer(pack_name(new_pack))
                    out.write(data)
                    phase("prune.repacking")
                    seg = Segment(new_pack, offset, seg.length, seg.pages, seg.codec, seg.checksum)
                    offset += seg.length
            seg_no[key] = len(segments)
            segments.append(seg)
        if out is not None:
            out.commit()
        phase("prune.before-index")
        if not segments:
            return "", segments, kept
        return _put_index(backend, index, plan, segments, seg_no), segments, kept
    except BaseException:
        _drop_new_pack(backend, out, new_pack)
        raise
    finally:
        reader.close()


def _drop_new_pack(backend, out, new_pack: str) -> None:
    if out is not None:
        out.abort()
    try:
        backend.delete([pack_name(new_pack)])
    except OSError:
        pass  # the next prune reclaims it (no index names it)
