"""The result file of a checkpoint a program asked for: how the dumper tells the process that
asked, without any descriptor linking the two across the freeze (docs/design.md, "Checkpoints
a program asks for").

`<agent dir>/<pid>-<id>.json` is written once, atomically, by whoever dumped (`ckpt dump
--result-file`, or the `ckpt run` supervisor): {"id": ID, "ok": true, ...} or {"id": ID, "ok":
false, "error": "...", "exit_code": N, ...}. `<pid>-<id>.log` is the detached dumper's output.
The directory is shared (mode 1777, sticky, like /tmp): a program under `ckpt run` need not be
root, but the supervisor that writes its result is. A reader trusts only files owned by root
or by itself.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from ckpt.errors import UsageError
from ckpt.store import ids
from ckpt.system.files import atomic_write_bytes

SHARED_DIR_MODE = 0o1777
_RESULT_RE = re.compile(r"^([1-9][0-9]{0,9})-(.+)\.json$")


def result_path(agent_dir: Path, pid: int, checkpoint_id: str) -> Path:
    """Where the result of checkpoint `checkpoint_id`, asked for by process `pid`, is written."""
    return agent_dir / f"{pid}-{ids.check_id(checkpoint_id)}.json"


def log_path(agent_dir: Path, pid: int, checkpoint_id: str) -> Path:
    """Where the detached dumper's output goes (removed once the checkpoint succeeded)."""
    return agent_dir / f"{pid}-{ids.check_id(checkpoint_id)}.log"


def ensure_dir(agent_dir: Path) -> None:
    """Creates the shared directory (1777) if it is missing. Its parent (/run/ckpt, which other
    parts of ckpt create 0700) is made traversable when it is root's: a program under `ckpt run`
    that is not root must reach its result file; every other directory in it stays private."""
    try:
        st = os.lstat(agent_dir)
    except FileNotFoundError:
        agent_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            agent_dir.mkdir()
            os.chmod(agent_dir, SHARED_DIR_MODE)  # mkdir's mode is cut by the umask
        except FileExistsError:
            pass  # another process made it first
        st = os.lstat(agent_dir)
        parent = os.stat(agent_dir.parent)
        if os.geteuid() == 0 and parent.st_uid == 0 and not parent.st_mode & 0o001:
            os.chmod(agent_dir.parent, stat.S_IMODE(parent.st_mode) | 0o111)
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{agent_dir} is not a directory",
                         hint="remove it, or point CKPT_AGENT_DIR at a directory")
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
        raise UsageError(f"{agent_dir} belongs to another user or anyone may replace files in it",
                         hint="remove it (ckpt makes it again, mode 1777) or point CKPT_AGENT_DIR elsewhere")


def check_result_file(path: Path, agent_dir: Path, checkpoint_id: str) -> Path:
    """--result-file's value: a file <pid>-<id>.json right in the agent directory (with the
    dump's --id), so that a root dumper never writes where the caller chose."""
    path = Path(os.path.abspath(path))
    match = _RESULT_RE.match(path.name)
    if path.parent != Path(os.path.abspath(agent_dir)) or not match or match.group(2) != checkpoint_id:
        raise UsageError(f"--result-file {path} is not {agent_dir}/<pid>-{checkpoint_id}.json",
                         hint="it is the file ckpt.checkpoint() waits for; give it as that function does")
    return path


def write(path: Path, record: dict, uid: int | None = None) -> None:
    """Writes the record atomically (a fresh temp file, then rename), owner-only, owned by uid
    (the process that waits for it) when given. The temp file's random name is opened with
    O_EXCL|O_NOFOLLOW: the directory is shared, and a planted link must not be followed."""
    # tmpfs: nothing to fsync; the rename makes it appear whole.
    atomic_write_bytes(path, json.dumps(record).encode() + b"\n", durable=False, owner=uid)


def read(path: Path) -> dict | None:
    """The record, or None while there is none (or only one somebody else planted: only root's
    or our own files count). Looks with stat first: no descriptor is opened before it exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid not in (0, os.geteuid()):
            return None
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None  # never half-written (rename); a stranger's file: ignore
    return record if isinstance(record, dict) else None


def remove(*paths: Path) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
