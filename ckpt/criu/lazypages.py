"""CRIU's lazy restore, the part ckpt speaks: the page server protocol and the lazy-pages daemon.

In a lazy restore CRIU recreates the tree without its lazily restorable memory (private
anonymous mappings, which pagemaps mark PE_LAZY) and registers that memory with userfaultfd;
`criu lazy-pages` receives the userfaultfds, and fills the memory in, first where the tree
touches it, then everything else in the background, asking a page server for the pages. The
page server is ckpt's (ckpt/restore/lazy.py): the pages come from the store's packs, and no pages image
of that memory is ever written. The wire format is CRIU's struct page_server_iov
(criu/page-xfer.c); requests and answers go in order over one stream socket.
"""

from __future__ import annotations

import socket
import struct
import subprocess
from pathlib import Path
from typing import Protocol

from ckpt.criu.binary import CriuBinary
from ckpt.criu.images import PE_PRESENT

# struct page_server_iov { u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id; } (natural alignment)
_IOV = struct.Struct("=I4xQQQ")
_PS_IOV_ADD_F = 6
_PS_IOV_GET = 7
_PS_IOV_CLOSE = 0x1023
_PS_IOV_FORCE_CLOSE = 0x1024
_PS_CMD_BITS = 16


class PageServerError(Exception):
    pass


class PageSource(Protocol):
    def available(self, pid: int, vaddr: int, nr_pages: int) -> int:
        """How many of the nr_pages pages from vaddr of process pid it can send (0: none)."""

    def send(self, pid: int, vaddr: int, nr_pages: int, out_fd: int) -> None:
        """Writes those pages to out_fd."""


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    while data and len(data) < size:  # MSG_WAITALL may still return early on a signal
        more = sock.recv(size - len(data), socket.MSG_WAITALL)
        if not more:
            break
        data += more
    return data


def serve(sock: socket.socket, source: PageSource) -> tuple[int, int]:
    """Answers the lazy-pages daemon's requests until it says it is done; returns the pages sent
    and the number of requests."""
    sent = requests = 0
    while True:
        header = _recv_exactly(sock, _IOV.size)
        if len(header) < _IOV.size:
            raise PageServerError("the lazy-pages daemon closed the connection before it was done")
        cmd, nr_pages, vaddr, pid = _IOV.unpack(header)
        cmd &= (1 << _PS_CMD_BITS) - 1
        if cmd in (_PS_IOV_CLOSE, _PS_IOV_FORCE_CLOSE):
            sock.sendall(struct.pack("=i", 0))  # the daemon waits for this answer before it exits
            return sent, requests
        if cmd != _PS_IOV_GET:
            raise PageServerError(f"unexpected page server command {cmd}")
        count = source.available(pid, vaddr, nr_pages)
        if count == 0:
            raise PageServerError(f"process {pid} asked for pages at {vaddr:#x} that the checkpoint "
                                  "does not hold as lazy pages")
        # May be fewer pages than asked for (to the end of a pagemap entry): the daemon asks again.
        sock.sendall(_IOV.pack(PE_PRESENT << _PS_CMD_BITS | _PS_IOV_ADD_F, count, vaddr, pid))
        source.send(pid, vaddr, count, sock.fileno())
        sent += count
        requests += 1


def start_daemon(binary: CriuBinary, images_dir: Path, work_dir: Path, page_server_fd: int, status_fd: int,
                 log_name: str, log_level: int) -> subprocess.Popen:
    """Starts `criu lazy-pages`: it listens on work_dir/lazy-pages.socket for the restoring CRIU,
    asks for pages over page_server_fd, and writes a byte to status_fd once it listens."""
    return subprocess.Popen(
        [binary.path, "lazy-pages", "--page-server", "--ps-socket", str(page_server_fd),
         "--status-fd", str(status_fd), "-D", str(images_dir), "-W", str(work_dir), "-o", log_name,
         f"-v{log_level}"],
        pass_fds=(page_server_fd, status_fd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, close_fds=True, umask=0o077)
