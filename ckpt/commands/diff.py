"""Use case: what changed between two checkpoints (processes, mappings, pages, files, sockets)."""

from __future__ import annotations


from ckpt.store import Manifest, Store
from ckpt.store.blocks.blockstore import ID_LEN, PAGE
from ckpt.store.staging import discard


def _snapshot(store: Store, manifest: Manifest) -> dict:
    from ckpt.criu import images  # deferred: imports pycriu

    image_dir = store.materialize(manifest, skip_pages=True)
    try:
        processes = {p["pid"]: p for p in images.describe(image_dir, manifest.processes)}
        page_lists = {e.name: store.load_page_list(e) for e in manifest.files if e.kind == "pages"}
        pages = {}
        vmas = {}
        for pid in processes:
            image, addresses = images.page_addresses(image_dir, pid)
            ids = page_lists.get(image or "", b"")
            pages[pid] = {addr: ids[k * ID_LEN:(k + 1) * ID_LEN] for k, addr in enumerate(addresses)}
            mm = image_dir / f"mm-{pid}.img"
            vmas[pid] = {(int(v["start"]), int(v["end"])) for v in images._load(mm)["entries"][0].get("vmas", [])} \
                if mm.exists() else set()
    finally:
        discard(image_dir)
    return {"processes": processes, "pages": pages, "vmas": vmas}


def _fd_key(fd: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in fd.items()))


def diff(store: Store, ref_a: str, ref_b: str) -> dict:
    with store.lock(exclusive=False):
        a = store.load(store.resolve(ref_a))
        b = store.load(store.resolve(ref_b))
        old, new = _snapshot(store, a), _snapshot(store, b)
    pids_a, pids_b = set(old["processes"]), set(new["processes"])
    result: dict = {
        "from": a.id, "to": b.id,
        "processes": {"added": sorted(pids_b - pids_a), "removed": sorted(pids_a - pids_b)},
        "per_process": [],
        "totals": {"pages_changed": 0, "pages_added": 0, "pages_removed": 0},
    }
    for pid in sorted(pids_a & pids_b):
        pa, pb = old["pages"][pid], new["pages"][pid]
        changed = sum(1 for addr, page in pb.items() if addr in pa and pa[addr] != page)
        added = sum(1 for addr in pb if addr not in pa)
        removed = sum(1 for addr in pa if addr not in pb)
        fds_a = {fd["fd"]: fd for fd in old["processes"][pid]["fds"]}
        fds_b = {fd["fd"]: fd for fd in new["processes"][pid]["fds"]}
        files = {
            "opened": [fds_b[f] for f in sorted(fds_b.keys() - fds_a.keys())],
            "closed": [fds_a[f] for f in sorted(fds_a.keys() - fds_b.keys())],
            "changed": [{"fd": f, "from": fds_a[f], "to": fds_b[f]} for f in sorted(fds_a.keys() & fds_b.keys())
                        if _fd_key(fds_a[f]) != _fd_key(fds_b[f])],
        }
        va, vb = old["vmas"][pid], new["vmas"][pid]
        entry = {
            "pid": pid, "command": new["processes"][pid]["command"],
            "threads": {"from": len(old["processes"][pid]["threads"]), "to": len(new["processes"][pid]["threads"])},
            "mappings": {"added": len(vb - va), "removed": len(va - vb),
                         "bytes_added": sum(e - s for s, e in vb - va),
                         "bytes_removed": sum(e - s for s, e in va - vb)},
            "pages": {"changed": changed, "added": added, "removed": removed,
                      "bytes_changed": changed * PAGE, "bytes_added": added * PAGE, "bytes_removed": removed * PAGE},
            "files": files,
        }
        result["per_process"].append(entry)
        result["totals"]["pages_changed"] += changed
        result["totals"]["pages_added"] += added
        result["totals"]["pages_removed"] += removed
    return result
