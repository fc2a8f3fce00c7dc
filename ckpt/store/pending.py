"""Copies still to make: durable records of checkpoints that a schedule or `ckpt run` with
--copy-to must copy to another store (docs/design.md, "Copying between stores").

A record is a local file of the source store, `<store>/copy-pending/<id>.json`: it is this
host's promise to copy, written (fsynced, with its directory) before the checkpoint's manifest
is committed, so that no committed checkpoint lacks it, and deleted once the copy has
committed in the destination. It is local rather than a blob because it is mutable (attempts,
last error) and names a destination as this host sees it (a path, a URL), like schedules/.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from ckpt.store import ids
from ckpt.store.fsutil import check_trusted_dir
from ckpt.system.files import atomic_write_bytes, make_private_dir

PENDING_DIR = "copy-pending"


def _dir(store_root: Path) -> Path:
    return store_root / PENDING_DIR


def _path(store_root: Path, checkpoint_id: str) -> Path:
    return _dir(store_root) / f"{ids.check_id(checkpoint_id)}.json"


def add(store_root: Path, checkpoint_id: str, to: str, origin: str) -> None:
    """Records (durably) that the checkpoint is to be copied to the store `to`. origin says
    who owes the copy: "schedule NAME" or "run NAME"."""
    make_private_dir(_dir(store_root))
    record = {"id": checkpoint_id, "to": to, "origin": origin,
              "since": datetime.now(timezone.utc).isoformat(timespec="seconds"), "attempts": 0, "error": None}
    atomic_write_bytes(_path(store_root, checkpoint_id), json.dumps(record, indent=2).encode())


def update(store_root: Path, record: dict, error: str) -> dict:
    """Notes a failed attempt in the record (which stays)."""
    record = {**record, "attempts": int(record.get("attempts", 0)) + 1, "error": error,
              "last_attempt": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    atomic_write_bytes(_path(store_root, record["id"]), json.dumps(record, indent=2).encode())
    return record


def remove(store_root: Path, checkpoint_id: str) -> None:
    try:
        os.unlink(_path(store_root, checkpoint_id))
    except FileNotFoundError:
        pass


def records(store_root: Path, origin: str | None = None) -> list[dict]:
    """The pending records, oldest checkpoint first (only origin's, if given). Unreadable
    records (a disk that lost one) are left out."""
    found = []
    try:
        # A record names where checkpoints go: only ckpt's own directory is read.
        check_trusted_dir(_dir(store_root), "the directory of pending copies")
        names = sorted(os.listdir(_dir(store_root)))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or not ids.is_id(name[:-5]):
            continue  # temp files of atomic writes, anything else
        try:
            record = json.loads((_dir(store_root) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("id") == name[:-5] and isinstance(record.get("to"), str) \
                and (origin is None or record.get("origin") == origin):
            found.append(record)
    return found
