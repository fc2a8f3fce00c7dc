"""Use case: what changed between two checkpoints (processes, mappings, pages, files, sockets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.commands.results import JsonResult
from ckpt.store import Manifest, Store
from ckpt.store.blocks.blockstore import ID_LEN, PAGE
from ckpt.store.materialize import materialize
from ckpt.store.staging import discard


@dataclass
class _Snapshot:
    """What a checkpoint's images say of each process: its description, its pages (address ->
    page id) and its mappings."""

    processes: dict[int, dict]
    pages: dict[int, dict[int, bytes]]
    vmas: dict[int, set[tuple[int, int]]]


@dataclass
class DiffResult(JsonResult):
    from_id: str
    to_id: str
    added: list[int]  # PIDs only in the newer checkpoint
    removed: list[int]  # PIDs only in the older one
    per_process: list[dict] = field(default_factory=list)  # each PID in both: what changed (docs/json.md)
    totals: dict[str, int] = field(default_factory=lambda: {"pages_changed": 0, "pages_added": 0,
                                                            "pages_removed": 0})

    def to_json(self) -> dict:
        return {"from": self.from_id, "to": self.to_id,
                "processes": {"added": self.added, "removed": self.removed},
                "per_process": self.per_process, "totals": self.totals}


def _snapshot(store: Store, manifest: Manifest) -> _Snapshot:
    from ckpt.criu import images  # deferred: imports pycriu

    image_dir = materialize(store.objects, store.staging_area(), manifest, skip_pages=True)
    try:
        processes = {p["pid"]: p for p in images.describe(image_dir, manifest.processes)}
        page_lists = {e.name: store.objects.load_page_list(e) for e in manifest.files if e.kind == "pages"}
        pages = {}
        for pid in processes:
            image, addresses = images.page_addresses(image_dir, pid)
            ids = page_lists.get(image or "", b"")
            pages[pid] = {addr: ids[k * ID_LEN:(k + 1) * ID_LEN] for k, addr in enumerate(addresses)}
        vmas = {pid: images.mappings(image_dir, pid) for pid in processes}
    finally:
        discard(image_dir)
    return _Snapshot(processes, pages, vmas)


def _fd_key(fd: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in fd.items()))


def _files(old: dict, new: dict) -> dict:
    fds_a = {fd["fd"]: fd for fd in old["fds"]}
    fds_b = {fd["fd"]: fd for fd in new["fds"]}
    return {
        "opened": [fds_b[f] for f in sorted(fds_b.keys() - fds_a.keys())],
        "closed": [fds_a[f] for f in sorted(fds_a.keys() - fds_b.keys())],
        "changed": [{"fd": f, "from": fds_a[f], "to": fds_b[f]} for f in sorted(fds_a.keys() & fds_b.keys())
                    if _fd_key(fds_a[f]) != _fd_key(fds_b[f])],
    }


def _process_change(old: _Snapshot, new: _Snapshot, pid: int) -> dict:
    pa, pb = old.pages[pid], new.pages[pid]
    changed = sum(1 for addr, page in pb.items() if addr in pa and pa[addr] != page)
    added = sum(1 for addr in pb if addr not in pa)
    removed = sum(1 for addr in pa if addr not in pb)
    va, vb = old.vmas[pid], new.vmas[pid]
    return {
        "pid": pid, "command": new.processes[pid]["command"],
        "threads": {"from": len(old.processes[pid]["threads"]), "to": len(new.processes[pid]["threads"])},
        "mappings": {"added": len(vb - va), "removed": len(va - vb),
                     "bytes_added": sum(e - s for s, e in vb - va),
                     "bytes_removed": sum(e - s for s, e in va - vb)},
        "pages": {"changed": changed, "added": added, "removed": removed,
                  "bytes_changed": changed * PAGE, "bytes_added": added * PAGE, "bytes_removed": removed * PAGE},
        "files": _files(old.processes[pid], new.processes[pid]),
    }


def diff(store: Store, ref_a: str, ref_b: str) -> DiffResult:
    """What changed from checkpoint ref_a to ref_b, process by process."""
    with store.lock(exclusive=False):
        a = store.load(store.resolve(ref_a))
        b = store.load(store.resolve(ref_b))
        old, new = _snapshot(store, a), _snapshot(store, b)
    pids_a, pids_b = set(old.processes), set(new.processes)
    result = DiffResult(a.id, b.id, added=sorted(pids_b - pids_a), removed=sorted(pids_a - pids_b))
    for pid in sorted(pids_a & pids_b):
        entry = _process_change(old, new, pid)
        result.per_process.append(entry)
        for what in ("changed", "added", "removed"):
            result.totals[f"pages_{what}"] += entry["pages"][what]
    return result
