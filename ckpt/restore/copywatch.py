"""The watcher of a clone (docs/design.md, "Clones"): a detached process, started by `ckpt
clone` once its copies run, that outlives ckpt and waits for each copy's init to end. Then it
removes what the copy left: its network namespace, veth and record (and the nft table with the
last copy network, ckpt/restore/copynet.py), its identity file, and its row of the clone's
registry (the file with its last row). It ends once no copy of the clone is left.

It waits on a pidfd per init (readable once the init has ended, zombie or reaped), each wait
bounded, and checks each init's start time besides, so a PID taken again by another process is
never waited for. Killed itself, it leaves the clean-up to the next `ckpt clone` or restore of
a copy, which remove what belongs to no running copy (copynet.remove_stale,
copies.remove_stale_identities).

Run as `python -c ... <ckpt's root> COPIES_DIR CLONE_ID` (start() below).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.restore import copies, copynet
from ckpt.system import procfs
from ckpt.system.files import atomic_write_bytes

# The longest one wait lasts: how late a copy whose init cannot be waited on by pidfd is seen gone.
POLL_S = 2.0


def start(copies_dir: Path, clone_id: str) -> int:
    """Starts the watcher of clone `clone_id`, detached (its own session, no descriptor of ours:
    a caller reading ckpt's output sees its end); returns its PID."""
    # Imported from where this ckpt is (a checkout run with PYTHONPATH, or an installed one).
    package_root = str(Path(__file__).resolve().parents[2])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ckpt.restore.copywatch import main; "
            "sys.exit(main(sys.argv[2:]))")
    process = subprocess.Popen([sys.executable, "-c", code, package_root, str(copies_dir), clone_id],
                               start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, close_fds=True, cwd="/")
    return process.pid


def registry_path(copies_dir: Path, clone_id: str) -> Path:
    return copies_dir / f"clone-{clone_id}.json"


def _rows(registry: Path) -> list[dict]:
    try:
        copies_ = json.loads(registry.read_bytes())["copies"]
        return [c for c in copies_ if isinstance(c, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def watch(copies_dir: Path, clone_id: str, poll_s: float = POLL_S) -> None:
    """Until every copy the registry lists has ended, each torn down as it ends."""
    registry = registry_path(copies_dir, clone_id)
    waiting: dict[int, tuple[int, int, int | None]] = {}  # index -> (init PID, start ticks, pidfd)
    for row in _rows(registry):
        init, start_ = int(row["init_pid"]), int(row["init_start"])
        try:
            fd: int | None = os.pidfd_open(init)
        except OSError:
            fd = None  # gone already (seen below), or a kernel without pidfds: polled
        waiting[int(row["index"])] = (init, start_, fd)
    try:
        while waiting:
            fds = [fd for _, _, fd in waiting.values() if fd is not None]
            # Opened after the start time was recorded: the start time says it is still that init.
            select.select(fds, [], [], poll_s if fds else min(poll_s, 1.0))
            for index in [i for i, (pid, began, _) in waiting.items() if not procfs.is_running(pid, began)]:
                fd = waiting.pop(index)[2]
                if fd is not None:
                    os.close(fd)
                tear_down(copies_dir, registry, index)
    finally:
        for _, _, fd in waiting.values():
            if fd is not None:
                os.close(fd)


def tear_down(copies_dir: Path, registry: Path, index: int) -> None:
    """What copy `index` left once its init ended: every network and identity file no running
    copy owns (its own among them), then its registry row. Each step on its own: one that
    fails (the network lock held too long) leaves the others done, and the rest to the next
    clone's clean-up."""
    try:
        copynet.remove_stale(copies_dir)
    except (CkptError, OSError, subprocess.SubprocessError):
        pass
    try:
        copies.remove_stale_identities(copies_dir)
    except OSError:
        pass
    try:
        drop_row(registry, index)
    except (OSError, ValueError, KeyError, TypeError):
        pass


def drop_row(registry: Path, index: int) -> None:
    """The registry without copy `index`; removed with its last copy. Only the watcher writes it
    once the clone has written it: no lock."""
    try:
        record = json.loads(registry.read_bytes())
    except FileNotFoundError:
        return
    record["copies"] = [c for c in record["copies"] if int(c.get("index", 0)) != index]
    if record["copies"]:
        atomic_write_bytes(registry, json.dumps(record).encode() + b"\n", durable=False)  # tmpfs
    else:
        registry.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        return 2
    watch(Path(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
