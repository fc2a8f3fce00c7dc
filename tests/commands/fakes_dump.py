"""Fakes for the dump and restore use cases (tests/commands/test_dump.py, test_restore.py): a
CRIU that writes the images a dump leaves (pstree, pagemap, pages) or "restores" a tree by
starting a stand-in process, and a real process to stand for the target."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
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


def write_images(images_dir: Path, pid: int, memory: bytes | None) -> None:
    """The images CRIU leaves for a one-process tree whose memory is `memory` (one mapping;
    None: streamed, the receiver writes the pagemap)."""
    from pycriu import images

    with open(images_dir / "pstree.img", "wb") as f:
        images.dump({"magic": "PSTREE", "entries": [{"pid": pid, "ppid": 0, "pgid": pid, "sid": pid,
                                                     "threads": [pid]}]}, f)
    if memory is None:
        return
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
    streamed: bool = False  # the pages went through ckpt's page stream (RPC ps.fd)
    finished: bool = False  # dump() went past post-dump: the tree was let go (or, --stop, ended)
    resumed: bool = False  # restore() went past post-restore: the restored tree runs
    stop_for: float = 0.0  # seconds the dump takes between its images and post-dump (a slow CRIU)

    def dump(self, options, on_notify=None, on_started=None) -> None:
        stream = None
        if options.page_stream_fd is not None:  # ours before on_started closes the session's copy
            stream = socket.socket(fileno=os.dup(options.page_stream_fd))
        if on_started is not None:
            on_started()
        pid = options.pid
        self._notify(on_notify, "pre-dump", pid)
        write_images(options.images_dir, pid, None if stream else self.memory)
        if stream is not None:
            with stream:
                stream_pages(stream, pid, self.memory)
            self.streamed = True
        if self.fail_dump:
            raise CriuFailed("CRIU dump failed: a fake failure", log_path=str(options.log_dir / options.log_name))
        time.sleep(self.stop_for)
        self._notify(on_notify, "post-dump", pid)
        self.finished = True
        if not options.flags.leave_running and self.target is not None:
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
        try:
            self._notify(on_notify, "post-restore", stand_in.pid)
        except BaseException:
            stand_in.kill()  # CRIU ends what it restored when a notification is refused
            stand_in.wait()
            raise
        self.resumed = True
        return stand_in.pid

    def _notify(self, on_notify, script: str, pid: int) -> None:
        self.notified.append(script)
        if on_notify is not None:
            on_notify(script, pid)
        if script == "post-dump" and self.at_post_dump is not None:
            self.at_post_dump()


COMMAND = struct.Struct("<I4xQQQ")  # CRIU's page-server protocol (criu/page-xfer.c)
OPEN2, ADD_F, FORCE_CLOSE = 4, 6, 0x1024


def stream_pages(sock: socket.socket, pid: int, memory: bytes) -> None:
    """CRIU's side of a page stream: one pagemap, one entry of present pages, the end."""
    sock.sendall(COMMAND.pack(OPEN2, 0, 0, pid << 8 | 1))
    if sock.recv(1) != b"\0":
        raise CriuFailed("the page stream did not open")
    sock.sendall(COMMAND.pack(PE_PRESENT << 16 | ADD_F, len(memory) // PAGE, VADDR, 0))
    sock.sendall(memory)
    sock.sendall(COMMAND.pack(FORCE_CLOSE, 0, 0, 0))
    if sock.recv(4) != struct.pack("<i", 0):
        raise CriuFailed("the page stream did not end")


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
