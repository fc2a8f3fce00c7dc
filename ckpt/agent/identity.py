"""Which copy am I: a process restored by `ckpt clone REF --copies N` runs in a PID namespace
of its own, and ckpt writes, before the copy runs, `<copies dir>/pidns-<inode>.json` (the
inode of that namespace; docs/design.md, "Clones"):

    {"format": 1, "clone": ID, "copy": k, "copies": N, "checkpoint": ID, "name": NAME|null,
     "created": TIME}

copy_info() reads the file of the caller's own PID namespace (`/proc/self/ns/pid`): outside a
copy there is none. The journal (ckpt/agent/journal.py) takes its branch from it.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.store import ids

if TYPE_CHECKING:
    from ckpt.settings import Settings

FORMAT = 1
# What a file must hold to be taken for an identity (readers ignore other keys).
REQUIRED = ("clone", "copy", "checkpoint")
MAX_BYTES = 65536


def copies_dir(config: Settings) -> Path:
    """Where the identity files and clone registries are: the settings' copies_dir (CKPT_COPIES_DIR)."""
    return config.copies_dir


def pidns_inode(pid: int | str = "self") -> int:
    """The inode of the PID namespace of process pid: names the namespace while it lives."""
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def identity_path(directory: Path, inode: int) -> Path:
    return directory / f"pidns-{int(inode)}.json"


def read_identity(directory: Path, inode: int | None = None) -> dict | None:
    """The identity of the copy whose PID namespace has that inode (default: the caller's), or
    None: no file (not a copy), or one that is not an identity. Only a regular file owned by
    root or by the caller counts: another user may be able to create names in the directory,
    but not make a process believe it is a copy."""
    path = identity_path(directory, pidns_inode() if inode is None else inode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            return None
        data = os.read(fd, MAX_BYTES)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if _valid(record) else None


def _valid(record: object) -> bool:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return False
    if any(key not in record for key in REQUIRED):
        return False
    copy = record["copy"]
    return (isinstance(copy, int) and not isinstance(copy, bool) and copy >= 1
            and isinstance(record["clone"], str) and ids.is_id(record["clone"])
            and isinstance(record["checkpoint"], str) and ids.is_id(record["checkpoint"]))


class Remembered:
    """The identity this process last found, kept in its memory (which checkpoints keep).

    The file names a PID namespace, and a checkpoint of a copy restored later (plainly: into
    a new PID namespace CRIU makes, with no identity file) is still that copy as far as its
    journal goes: its memory holds what the copy did. So current() looks again whenever the
    process is in another PID namespace than last time, and keeps what it knew when the new
    one has no file. A process that never saw an identity has none (the original, and its
    plain restores)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: tuple[Path, int] | None = None  # (directory, pidns inode) last looked in
        self._identity: dict | None = None

    def current(self, directory: Path) -> dict | None:
        inode = pidns_inode()
        with self._lock:
            if self._seen != (directory, inode):
                found = read_identity(directory, inode)
                if found is not None or self._seen is None or self._seen[0] != directory:
                    self._identity = found
                self._seen = (directory, inode)
            return self._identity


remembered = Remembered()
