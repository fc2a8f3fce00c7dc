"""Which copy am I: a process restored by `ckpt clone REF --copies N` runs in a PID namespace
of its own, and ckpt writes, before the copy runs, `<copies dir>/pidns-<inode>.json` (the
inode of that namespace; docs/design.md, "Clones"):

    {"format": 2, "clone": ID, "copy": k, "copies": N, "checkpoint": ID, "name": NAME|null,
     "created": TIME, "init": [HOST PID, START TICKS]}

copy_info() reads the file of the caller's own PID namespace (`/proc/self/ns/pid`): outside a
copy there is none. The journal (ckpt/agent/journal.py) takes its branch from it.

A namespace's inode is reused once the namespace is gone, and a file whose copy ended may
still be there (its watcher was killed): a file counts only while the init it names (host PID
and start time) still runs and is in the namespace asked about. While that init runs its
namespace lives, so the inode is still that namespace's and no other's.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.store import ids
from ckpt.system import procfs

if TYPE_CHECKING:
    from ckpt.settings import Settings

FORMAT = 2
# What a file must hold to be taken for an identity (readers ignore other keys).
REQUIRED = ("clone", "copy", "checkpoint", "init")
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
    inode = pidns_inode() if inode is None else inode
    path = identity_path(directory, inode)
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
    return record if _valid(record) and init_runs_in(record, inode) else None


def init_of(record: dict) -> tuple[int, int] | None:
    """The (host PID, start ticks) of the init an identity names, or None."""
    init = record.get("init")
    if not isinstance(init, list) or len(init) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in init):
        return None
    return int(init[0]), int(init[1])


def init_runs_in(record: dict, inode: int) -> bool:
    """Whether the identity's init still runs and is in PID namespace `inode`. The init's host
    PID is looked up in this /proc: a copy's tree sees the host's (it joined the host's mount
    namespace). A process that may not look at the init's namespace link (another user's
    copy) has its liveness: a live init keeps its namespace, and its inode, from anyone else."""
    init = init_of(record)
    if init is None or not procfs.is_running(*init):
        return False
    try:
        return pidns_inode(init[0]) == inode
    except PermissionError:
        return True
    except OSError:
        return False


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
