"""Fakes for the dump and restore use cases (tests/commands/test_dump.py, test_restore.py): a
CRIU that writes the images a dump leaves (pstree, pagemap, pages) or "restores" a tree by
starting a stand-in process, and a real process to stand for the target."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ckpt.criu.binary import CriuBinary
from ckpt.criu.images import PE_PRESENT, write_pagemap
from ckpt.errors import CriuFailed

PAGE = 4096
VADDR = 0x7F0000000000
FAKE_BINARY = CriuBinary(path="/bin/true", version=(4, 0), version_text="4.0")


def pages(count: int, first: int = 0) -> bytes:
    """count distinct pages (each filled with its own byte)."""
    return b"".join(bytes([(first + i) % 251 + 1]) * PAGE for i in range(count))


def start_target() -> subprocess.Popen:
    """A real process (the pre-flight reads /proc), in its own session, with no terminal."""
    return subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def write_images(images_dir: Path, pid: int, memory: bytes) -> None:
    """The images CRIU leaves for a one-process tree whose memory is `memory` (one mapping)."""
    from pycriu import images

    with open(images_dir / "pstree.img", "wb") as f:
        images.dump({"magic": "PSTREE", "entries": [{"pid": pid, "ppid": 0, "pgid": pid, "sid": pid,
                                                     "threads": [pid]}]}, f)
    write_pagemap(images_dir / f"pagemap-{pid}.img", 1, [(VADDR, len(memory) // PAGE, PE_PRESENT)])
    (images_dir / "pages-1.img").write_bytes(memory)


@dataclass
class FakeCriu:
    """A CRIU client: dump() writes the images of `memory` for the target and tells the
    session what CRIU tells (pre-dump, post-dump), fails where asked; restore() starts a
    stand-in for the tree and returns its PID. What it saw is kept for the test."""

    memory: bytes = field(default_factory=lambda: pages(8))
    fail_dump: bool = False
    fail_restore: bool = False
    # Called at post-dump, while the tree is "frozen": what the test wants to know then.
    at_post_dump: Callable[[], None] | None = None
    # --stop: CRIU ends the tree after post-dump; this is the target to end.
    target: subprocess.Popen | None = None
    notified: list[str] = field(default_factory=list)
    restored_images: dict[str, bytes] = field(default_factory=dict)
    restored: list[subprocess.Popen] = field(default_factory=list)
    binary: CriuBinary = FAKE_BINARY

    def dump(self, options, on_notify=None, on_started=None) -> None:
        if on_started is not None:
            on_started()
        pid = options.pid
        self._notify(on_notify, "pre-dump", pid)
        write_images(options.images_dir, pid, self.memory)
        if self.fail_dump:
            raise CriuFailed("CRIU dump failed: a fake failure", log_path=str(options.log_dir / options.log_name))
        self._notify(on_notify, "post-dump", pid)
        if not options.leave_running and self.target is not None:
            self.target.kill()
            self.target.wait()

    def restore(self, options, on_notify=None) -> int:
        self.restored_images = {p.name: p.read_bytes() for p in Path(options.images_dir).iterdir() if p.is_file()}
        stand_in = start_target()
        self.restored.append(stand_in)
        if self.fail_restore:
            stand_in.kill()  # CRIU kills what it restored when it fails
            stand_in.wait()
            raise CriuFailed("CRIU restore failed: a fake failure", log_path=str(options.log_dir / options.log_name))
        self._notify(on_notify, "post-restore", stand_in.pid)
        return stand_in.pid

    def _notify(self, on_notify, script: str, pid: int) -> None:
        self.notified.append(script)
        if on_notify is not None:
            on_notify(script, pid)
        if script == "post-dump" and self.at_post_dump is not None:
            self.at_post_dump()


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie child of ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
