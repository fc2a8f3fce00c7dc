"""A dump's pages streamed out of CRIU into ckpt while the tree is frozen.

Why: in VMs that hand free memory back to their host (virtio-balloon free page reporting),
CRIU writing a 2 GiB pages image into the page cache faults in memory the host took back,
about 8 us per 4 KiB page: most of a dump's freeze (docs/performance.md). CRIU can send the
pages over a socket instead, with its page-server protocol (the RPC's `ps.fd`: a connected
socket CRIU inherits). ckpt reads them into one buffer faulted in before the freeze, names
each page by its id as it comes, and keeps only the pages whose id is not the one their
address had in the target's newest checkpoint: for a target that rewrote 1% of its memory,
1% of it is written anywhere while the tree is frozen. The kept pages go to a staging file of
their own; after the freeze the ingest stores them as it stores a pages image
(BlockStore.ingest, StreamedPages), and the pagemap images CRIU would have written are
written here. The store's format does not change.

The protocol (CRIU's criu/page-xfer.c), commands of 32 bytes {u32 cmd, u64 nr_pages,
u64 vaddr, u64 dst_id}, cmd = flags << 16 | command:
- OPEN2: a new pagemap, dst_id = id << 8 | type (1: a process, pagemap-<pid>.img; 2: shared
  memory, pagemap-shmem-<id>.img). Answered with one byte, 0: no parent, every page is sent.
- ADD_F: a pagemap entry; with PE_PRESENT its nr_pages pages follow. ADD and HOLE are older
  CRIUs' ADD_F with PE_PRESENT and with PE_PARENT.
- CLOSE, FORCE_CLOSE: the end, answered with an int32 0 once everything is received. CRIU
  sends it before it lets the tree run again (and before its post-dump notification).
Anything else, or a socket closed early, fails the receiver: it closes its end, CRIU's dump
fails, and CRIU lets the tree run as it does after any failure.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.system.arrays import np

from ckpt.criu.images import PE_PARENT, PE_PRESENT, write_pagemap
from ckpt.errors import CkptError, PageStreamFailed
from ckpt.phases import phase
from ckpt.store.blocks.blockstore import StreamedPages, page_ids
from ckpt.store.blocks.byaddress import PagesByAddress
from ckpt.store.blocks.segments import PAGE
from ckpt.system.files import write_all

COMMAND = struct.Struct("<I4xQQQ")
PS_IOV_ADD, PS_IOV_HOLE, PS_IOV_OPEN, PS_IOV_OPEN2, PS_IOV_ADD_F = 1, 2, 3, 4, 6
PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 0x1023, 0x1024
TYPE_PROCESS, TYPE_SHMEM = 1, 2
BATCH_PAGES = 8192  # 32 MiB: hashed at once; faulted in before the freeze
SOCKET_BUFFER = 8 << 20  # CRIU splices ahead while a batch is hashed
RECEIVE_TIMEOUT = 300.0  # seconds without a byte from CRIU before the stream is given up


class _StreamCut(Exception):
    """CRIU's end closed before the stream's end: CRIU failed (or died), and says why."""


@dataclass
class _Image:
    """One pagemap being received."""

    pagemap_name: str
    pages_id: int
    earlier: PagesByAddress | None
    kept_path: Path
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # pagemap entries (vaddr, nr_pages, flags)
    page_list: bytearray = field(default_factory=bytearray)
    kept_rows: list[np.ndarray] = field(default_factory=list)
    kept_fd: int = -1
    received: int = 0  # pages


class PageStream:
    """The receiving end: start() before CRIU (it gives CRIU's descriptor), criu_started()
    once CRIU runs, finish() once it has returned."""

    def __init__(self, images_dir: Path, kept_dir: Path, seed: int, earlier: dict[str, PagesByAddress]):
        self.images_dir, self.kept_dir, self.seed = images_dir, kept_dir, seed
        self.earlier = earlier  # by pagemap image name
        self.images: list[_Image] = []
        self.received_pages = 0
        self.kept_pages = 0
        self._error: BaseException | None = None
        self._ours: socket.socket | None = None
        self._theirs: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # Two buffers: one fills from the socket while the pages of the other are named and
        # written (_store), so the freeze is the slower of the two, not their sum. Faulted in
        # now, before the freeze: touching fresh memory is what the stream avoids.
        self._buffers = []
        for _ in range(2):
            buffer = mmap.mmap(-1, BATCH_PAGES * PAGE,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
            buffer[0:len(buffer):PAGE] = b"\0" * BATCH_PAGES
            self._buffers.append(buffer)
        self._free = [threading.Semaphore(1), threading.Semaphore(1)]
        self._batches: queue.Queue = queue.Queue()
        self._storer: threading.Thread | None = None
        self._store_error: BaseException | None = None
        # What the receiver fills (_serve): the buffer of slot, its batch of (vaddr, pages, row
        # in the buffer), how many pages it holds, and the pagemap they belong to.
        self._slot = 0
        self._buffer = memoryview(b"")
        self._batch: list[tuple[int, int, int]] = []
        self._used = 0
        self._image: _Image | None = None

    def start(self) -> int:
        """Starts receiving; returns the descriptor to give CRIU (RPC ps.fd)."""
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (self._ours, self._theirs):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            except OSError:
                pass  # the kernel's limits: only slower
        # Not forever: were CRIU's stream to get out of step (a splice failing midway through
        # an entry's pages, then its closing command read as pages), CRIU would wait for an
        # answer and ckpt for pages, the tree frozen. CRIU's pauses between commands (seizing
        # the tree, dumping its other state) are far shorter.
        self._ours.settimeout(RECEIVE_TIMEOUT)
        self.kept_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._receive, name="ckpt-page-stream", daemon=True)
        self._storer = threading.Thread(target=self._store_batches, name="ckpt-page-store", daemon=True)
        self._storer.start()
        self._thread.start()
        return self._theirs.fileno()

    def criu_started(self) -> None:
        """CRIU holds its end now: ours is closed, so that the stream ends if CRIU dies."""
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    def finish(self) -> dict[str, StreamedPages]:
        """Waits for the receiver; writes the pagemap images; returns the streamed pages
        images by name. Raises PageStreamFailed if the stream did not end as CRIU ends it."""
        self.criu_started()
        if self._thread is not None:
            self._thread.join()
        self._close()
        failure = self.failure()
        if failure is not None:
            raise failure
        if self._error is not None:  # cut, though CRIU said it succeeded
            raise PageStreamFailed(f"receiving the pages CRIU streamed failed: {self._error}")
        streamed = {}
        for image in self.images:
            try:
                write_pagemap(self.images_dir / image.pagemap_name, image.pages_id, image.runs)
                if image.earlier is None and image.received:  # every page kept, none named yet
                    with open(image.kept_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as kept:
                        image.page_list = bytearray(page_ids(kept, self.seed))
            except OSError as exc:
                from ckpt.store.fsutil import translate_os_error

                raise translate_os_error(exc, "writing the streamed images") from None
            rows = np.concatenate(image.kept_rows) if image.kept_rows else np.zeros(0, dtype=np.int64)
            name = f"pages-{image.pages_id}.img"
            streamed[name] = StreamedPages(name, image.kept_path, bytes(image.page_list), rows)
        return streamed

    def failure(self) -> CkptError | None:
        """Why the receiver stopped early, if it did (then CRIU's own error is only its echo)."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        error = self._error
        if error is None or isinstance(error, (_StreamCut, BrokenPipeError, ConnectionResetError)):
            return None  # CRIU ended first: its error is the one that explains
        if isinstance(error, CkptError):
            return error
        if isinstance(error, TimeoutError):
            return PageStreamFailed(f"CRIU sent no pages for {RECEIVE_TIMEOUT:.0f} s; gave the dump up")
        if isinstance(error, OSError) and error.filename is not None:
            from ckpt.store.fsutil import translate_os_error

            return translate_os_error(error, "keeping the pages CRIU streamed")
        return PageStreamFailed(f"receiving the pages CRIU streamed failed: {error}")

    def abort(self) -> None:
        """Ends the receiver whatever its state (the dump failed elsewhere)."""
        if self._ours is not None:
            try:
                self._ours.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.criu_started()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close()

    def _close(self) -> None:
        if self._storer is not None and self._storer.is_alive():
            return  # still writing (a slow disk): its files close with the process
        for image in self.images:
            if image.kept_fd >= 0:
                os.close(image.kept_fd)
                image.kept_fd = -1
        if self._ours is not None:
            self._ours.close()
            self._ours = None

    # ---- the receiving thread ----

    def _receive(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self._error = self._store_error or exc
            self._cut_criu_off()
        finally:
            self._batches.put(None)  # the storer ends once it has stored what came before
            if self._storer is not None:
                self._storer.join()
            if self._error is None and self._store_error is not None:
                self._error = self._store_error

    def _cut_criu_off(self) -> None:
        if self._ours is not None:
            try:  # CRIU's next write fails: its dump fails and the tree runs on
                self._ours.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _store_batches(self) -> None:
        """The storing thread: each batch handed over, in order; frees its buffer after."""
        while (item := self._batches.get()) is not None:
            image, batch, used, slot = item
            try:
                if self._store_error is None:
                    self._store(image, batch, used, slot)
            except BaseException as exc:  # noqa: BLE001 - said by the receiver, then finish()
                self._store_error = exc
                self._cut_criu_off()
            finally:
                self._free[slot].release()

    def _recv_exactly(self, view: memoryview) -> None:
        assert self._ours is not None
        got = 0
        while got < len(view):
            n = self._ours.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if n == 0:
                raise _StreamCut("CRIU closed the stream midway")
            got += n

    def _serve(self) -> None:
        """One branch per command, as CRIU's page_server_serve."""
        assert self._ours is not None
        header = bytearray(COMMAND.size)
        self._free[self._slot].acquire()
        self._buffer = memoryview(self._buffers[self._slot])
        while True:
            self._recv_exactly(memoryview(header))
            cmd, nr_pages, vaddr, dst_id = COMMAND.unpack(header)
            command, flags = cmd & 0xFFFF, cmd >> 16
            if command in (PS_IOV_ADD, PS_IOV_HOLE):
                command, flags = PS_IOV_ADD_F, PE_PRESENT if command == PS_IOV_ADD else PE_PARENT
            if command == PS_IOV_OPEN2:
                self._hand_over()
                self._image = self._open(dst_id)
                self._ours.sendall(b"\0")
            elif command == PS_IOV_ADD_F:
                self._add(vaddr, nr_pages, flags)
            elif command in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self._end()
                return
            else:
                raise PageStreamFailed(f"CRIU sent an unknown page-server command {command}")

    def _add(self, vaddr: int, nr_pages: int, flags: int) -> None:
        """A pagemap entry; its pages, if they follow, into the buffer filling."""
        image = self._image
        if image is None:
            raise PageStreamFailed("CRIU sent pages before opening a pagemap")
        image.runs.append((vaddr, nr_pages, flags))
        if not flags & PE_PRESENT or flags & PE_PARENT:
            return
        done = 0
        while done < nr_pages:
            if self._used == BATCH_PAGES:
                self._hand_over()
            count = min(nr_pages - done, BATCH_PAGES - self._used)
            self._recv_exactly(self._buffer[self._used * PAGE:(self._used + count) * PAGE])
            self._batch.append((vaddr + done * PAGE, count, self._used))
            self._used += count
            done += count

    def _hand_over(self) -> None:
        """The filled buffer to the storer; the other one, once free, fills next."""
        if not self._used:
            return
        self._batches.put((self._image, self._batch, self._used, self._slot))
        self._slot ^= 1
        self._free[self._slot].acquire()
        if self._store_error is not None:
            raise self._store_error
        self._buffer = memoryview(self._buffers[self._slot])
        self._batch, self._used = [], 0

    def _end(self) -> None:
        assert self._ours is not None
        if self._used:
            self._batches.put((self._image, self._batch, self._used, self._slot))
        else:
            self._free[self._slot].release()
        # Every page is in ckpt's buffers: CRIU may let the tree run while the last batch is
        # stored (a failure there fails finish(): nothing is committed).
        self._ours.sendall(struct.pack("<i", 0))

    def _open(self, dst_id: int) -> _Image:
        kind, number = dst_id & 0xFF, dst_id >> 8
        if kind == TYPE_PROCESS:
            name = f"pagemap-{number}.img"
        elif kind == TYPE_SHMEM:
            name = f"pagemap-shmem-{number}.img"
        else:
            raise PageStreamFailed(f"CRIU opened a pagemap of unknown type {kind}")
        if any(image.pagemap_name == name for image in self.images):
            raise PageStreamFailed(f"CRIU opened {name} twice")
        pages_id = len(self.images) + 1
        image = _Image(name, pages_id, self.earlier.get(name), self.kept_dir / f"pages-{pages_id}.kept")
        image.kept_fd = os.open(image.kept_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.images.append(image)
        return image

    def _store(self, image: _Image, batch: list[tuple[int, int, int]], used: int, slot: int) -> None:
        """Names the pages in a buffer, keeps those not known unchanged. With nothing to
        compare them with, every page is kept and named after the freeze (finish): on two
        cores, hashing while CRIU and the receiver run only slowed the freeze down."""
        data = memoryview(self._buffers[slot])[:used * PAGE]
        first_row = image.received
        image.received += used
        keep = np.ones(used, dtype=bool)
        if image.earlier is not None:
            ids_bytes = page_ids(data, self.seed)
            image.page_list += ids_bytes
            # The address of each page of the batch: its entry's, plus its place in the entry.
            firsts = np.array([vaddr for vaddr, _, _ in batch], dtype=np.uint64)
            counts = np.array([count for _, count, _ in batch], dtype=np.int64)
            places = np.arange(used, dtype=np.int64) - np.repeat(np.array([at for _, _, at in batch]), counts)
            addresses = np.repeat(firsts, counts) + places.astype(np.uint64) * np.uint64(PAGE)
            keep = ~image.earlier.same(addresses, np.frombuffer(ids_bytes, dtype=np.uint64).reshape(-1, 2))
        rows = np.flatnonzero(keep)
        if len(rows):
            # Runs of consecutive kept pages, each one write.
            breaks = np.flatnonzero(np.diff(rows) != 1) + 1
            for run in np.split(rows, breaks):
                start, end = int(run[0]), int(run[-1]) + 1
                try:
                    write_all(image.kept_fd, data[start * PAGE:end * PAGE])
                except OSError as exc:
                    exc.filename = str(image.kept_path)
                    raise
            image.kept_rows.append(rows.astype(np.int64) + first_row)
        self.received_pages += used
        self.kept_pages += len(rows)
        phase("dump.streaming")
        data.release()


def earlier_pages(processes: dict[str, tuple[list, bytes]]) -> dict[str, PagesByAddress]:
    """PagesByAddress by pagemap image name, from EarlierCheckpoint's (runs, page list)."""
    from ckpt.criu.images import held_runs

    result = {}
    for name, (runs, page_list) in processes.items():
        pages = PagesByAddress.from_runs(held_runs(runs), page_list)
        if pages is not None:
            result[name] = pages
    return result
