"""The store lock: flock(2) on <store>/lock, shared or exclusive, with holder records.

flock is released by the kernel when the holding process dies, so a crashed ckpt never leaves
the store locked. Holder records exist only so a waiting command can say whom it waits for.
"""

import fcntl
import json
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ckpt import settings
from ckpt.errors import StoreBusy
from ckpt.store.fsutil import FILE_MODE, make_private_dir

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_holders(holders_dir: Path) -> list[dict]:
    holders = []
    for path in sorted(holders_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(record.get("pid", 0))) and record.get("pid") != os.getpid():
            holders.append(record)
    return holders


def remove_stale_holders(holders_dir: Path) -> None:
    for path in holders_dir.glob("*.json"):
        try:
            pid = int(path.name.split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)


@contextmanager
def store_lock(store_root: Path, exclusive: bool, on_wait=None, timeout: float | None = None):
    """Holds the store lock for the duration of the block.

    on_wait(holders) is called once if the lock is not free at once.
    """
    timeout = settings.current().lock_timeout if timeout is None else timeout
    holders_dir = store_root / "holders"
    make_private_dir(holders_dir)
    fd = os.open(store_root / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + timeout
    told = False
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and on_wait is not None:
                    on_wait(live_holders(holders_dir))
                    told = True
                if time.monotonic() >= deadline:
                    who = ", ".join(f"pid {h['pid']} ({h.get('command', '?')}, since {h.get('since', '?')})"
                                    for h in live_holders(holders_dir)) or "another ckpt command"
                    raise StoreBusy(f"the store at {store_root} is locked by {who}",
                                    hint=f"waited {timeout:.0f} s; try again later or raise CKPT_LOCK_TIMEOUT")
                time.sleep(0.1)
        holder = holders_dir / f"{os.getpid()}-{secrets.token_hex(4)}.json"
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv[:3]) or "ckpt",
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "mode": "exclusive" if exclusive else "shared",
        }
        holder = _write_holder(holder, json.dumps(record).encode())
        try:
            if exclusive:
                remove_stale_holders(holders_dir)
            yield
        finally:
            if holder is not None:
                holder.unlink(missing_ok=True)
    finally:
        os.close(fd)  # releases the flock


def _write_holder(path: Path, data: bytes) -> Path | None:
    """Writes a holder record; None if it cannot be written. The record only tells a waiting
    command whom it waits for: a full disk must not stop the command (least of all `rm` or
    `prune`, which free space), so a record that fails is removed and the lock held without."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except OSError:
        return None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError:
        path.unlink(missing_ok=True)  # a partial record would read as nobody's
        return None
    return path
