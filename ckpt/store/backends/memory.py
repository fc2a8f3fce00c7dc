"""The in-memory backend: the blobs of a store held in a dict, for fast tests.

It keeps the interface's promises (base.py) the way the local and S3 backends do, so that
a use case can be tested against it without a disk, a server or root: whole blobs appear
atomically, a writer's blob appears only on commit (until then its bytes are listed as an
unfinished write, ".<name>.<token>.tmp", as the local backend's temp files are),
create-if-absent has one winner, and the lock is a readers-writer lock whose holders are
threads of this process. It proves itself by passing the conformance suite
(tests/unit/test_backends.py), all but the tests that share a backend between processes,
which a dict cannot be. Nothing of it is on disk: a second MemoryBackend is another store.
"""

from __future__ import annotations

import builtins
import errno
import os
import secrets
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from ckpt.errors import StoreBusy
from ckpt.store.backends.base import Backend, BlobExists, BlobInfo, BlobNotFound, BlobWriter, LockOwner, check_name
from ckpt.system.files import FILE_MODE


@dataclass
class _Blob:
    data: bytes
    modified: float


@dataclass
class _Write:
    """A write in progress: appended to, listed as an unfinished write, not readable."""

    data: bytearray
    modified: float


@dataclass(eq=False)  # each holding is itself: two of one thread are two
class _Hold:
    """One holding of the lock: its owner (for messages) and the thread holding it, whose end
    makes the hold stale (as a flock dies with its process)."""

    owner: LockOwner
    thread: threading.Thread


class MemoryBackend(Backend):
    """Blobs in memory, safe to use from several threads.

    label names the store in messages and tells two memory stores apart (where() is
    "<label>/<name>"); clock is the backend's clock (now(), BlobInfo.modified), for tests of
    what depends on time (prune's safety margin); gc_margin is what gc_margin() answers."""

    def __init__(self, label: str = "memory://store", clock: Callable[[], float] = time.time,
                 gc_margin: float = 0.0):
        self.label = label
        self._clock = clock
        self._gc_margin = gc_margin
        self._blobs: dict[str, _Blob] = {}
        self._unfinished: dict[str, _Write] = {}  # writes in progress, by their temp name
        self._mutex = threading.Lock()  # guards both dicts
        self._lock_changed = threading.Condition()  # guards _holds
        self._holds: builtins.list[_Hold] = []

    def where(self, name: str) -> str:
        return f"{self.label}/{name}"

    def _not_found(self, name: str) -> BlobNotFound:
        return BlobNotFound(errno.ENOENT, "no such blob", self.where(name))

    # ---- writing ---------------------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        check_name(name)
        blob = _Blob(bytes(data), self._clock())
        with self._mutex:
            self._blobs[name] = blob

    def put_if_absent(self, name: str, data: bytes) -> None:
        check_name(name)
        blob = _Blob(bytes(data), self._clock())
        with self._mutex:
            if name in self._blobs:
                raise BlobExists(errno.EEXIST, "blob exists", self.where(name))
            self._blobs[name] = blob

    def put_file(self, name: str, source: Path) -> int:
        check_name(name)
        data = source.read_bytes()
        self.put(name, data)
        source.unlink()  # consumed, as the local backend's rename consumes it
        return len(data)

    def writer(self, name: str) -> BlobWriter:
        head, _, last = check_name(name).rpartition("/")
        temp = f"{head}/.{last}.{secrets.token_hex(3)}.tmp" if head else f".{last}.{secrets.token_hex(3)}.tmp"
        with self._mutex:
            self._unfinished[temp] = _Write(bytearray(), self._clock())
        return _MemoryWriter(self, name, temp)

    def _append(self, temp: str, data) -> None:
        with self._mutex:
            blob = self._unfinished.get(temp)
            if blob is None:  # deleted as a leftover meanwhile (prune under the exclusive lock)
                raise FileNotFoundError(errno.ENOENT, "unfinished write deleted", self.where(temp))
            blob.data += data
            blob.modified = self._clock()

    def _finish(self, temp: str, name: str | None) -> None:
        """Moves a write in progress into place (name), or drops it (None)."""
        with self._mutex:
            blob = self._unfinished.pop(temp, None)
            if name is None:
                return
            if blob is None:
                raise FileNotFoundError(errno.ENOENT, "unfinished write deleted", self.where(temp))
            self._blobs[name] = _Blob(bytes(blob.data), self._clock())

    # ---- reading ---------------------------------------------------------------------------

    def _blob(self, name: str) -> _Blob:
        check_name(name)
        with self._mutex:
            blob = self._blobs.get(name)
        if blob is None:
            raise self._not_found(name)
        return blob

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self._blob(name).data
        return data[offset:] if length is None else data[offset:offset + length]

    def get_file(self, name: str, dest: Path) -> None:
        data = self._blob(name).data
        with open(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as out:
            out.write(data)

    def stat(self, name: str) -> BlobInfo:
        blob = self._blob(name)
        return BlobInfo(name, len(blob.data), blob.modified)

    def list(self, prefix: str, incomplete: bool = False) -> builtins.list[BlobInfo]:
        with self._mutex:
            blobs: dict[str, _Blob] | dict[str, _Write] = self._unfinished if incomplete else self._blobs
            found = [BlobInfo(name, len(blob.data), blob.modified) for name, blob in blobs.items()
                     if name.startswith(prefix)]
        return sorted(found, key=lambda info: info.name)

    # ---- deleting --------------------------------------------------------------------------

    def delete(self, names: builtins.list[str]) -> None:
        for name in names:
            head, _, last = name.rpartition("/")
            check_name(f"{head}/{last[1:]}" if head and last.startswith(".") else name.lstrip("."))
        with self._mutex:
            for name in names:
                self._unfinished.pop(name, None)
                self._blobs.pop(name, None)

    # ---- locking ---------------------------------------------------------------------------

    @contextmanager
    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> Iterator[None]:
        """A readers-writer lock between the threads of this process. Like two flocks of one
        process, a thread holding it shared that asks for it exclusive waits for itself: the
        timeout then says so (StoreBusy), as it would on a local store."""
        hold = _Hold(_owner(exclusive), threading.current_thread())
        self._acquire(hold, timeout, on_wait)
        try:
            yield
        finally:
            with self._lock_changed:
                if hold in self._holds:  # else dropped as stale: its thread ended holding it
                    self._holds.remove(hold)
                self._lock_changed.notify_all()

    def _acquire(self, hold: _Hold, timeout: float,
                 on_wait: Callable[[builtins.list[LockOwner]], None] | None) -> None:
        deadline = time.monotonic() + timeout
        told = on_wait is None
        while True:
            with self._lock_changed:
                if not self._conflicting(hold.owner.mode == "exclusive"):
                    self._holds.append(hold)
                    return
                if told:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._busy(timeout)
                    self._lock_changed.wait(min(left, 0.05))  # wakes to notice holders that died
                    continue
            told = True
            if on_wait is not None:  # outside the mutex: the callback may take its time
                on_wait(self.lock_holders())

    def _conflicting(self, exclusive: bool) -> bool:
        """Whether a live hold excludes the one asked for; holds of ended threads are dropped."""
        self._holds = [hold for hold in self._holds if hold.thread.is_alive()]
        return any(exclusive or hold.owner.mode == "exclusive" for hold in self._holds)

    def _busy(self, timeout: float) -> StoreBusy:
        who = ", ".join(owner.describe() for owner in self.lock_holders()) or "another ckpt command"
        return StoreBusy(f"the store at {self.label} is locked by {who}",
                         hint=f"waited {timeout:.0f} s; try again later or raise CKPT_LOCK_TIMEOUT")

    def lock_holders(self) -> builtins.list[LockOwner]:
        """The live holders, the calling thread's own holds excepted (every holder is of this
        process: the base class's "this process excepted" would leave none to name)."""
        me = threading.current_thread()
        with self._lock_changed:
            return [hold.owner for hold in self._holds if hold.thread.is_alive() and hold.thread is not me]

    def gc_margin(self) -> float:
        return self._gc_margin

    def now(self) -> float:
        return self._clock()


def _owner(exclusive: bool) -> LockOwner:
    return LockOwner(pid=os.getpid(), host=socket.gethostname(), command=" ".join(sys.argv[:3]) or "ckpt",
                     since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     mode="exclusive" if exclusive else "shared")


class _MemoryWriter(BlobWriter):
    def __init__(self, backend: MemoryBackend, name: str, temp: str):
        self._backend, self._name, self._temp = backend, name, temp
        self.written = 0
        self._finished = False

    def write(self, data) -> None:
        self._backend._append(self._temp, data)
        self.written += len(data)

    def commit(self) -> None:
        self._finished = True
        self._backend._finish(self._temp, self._name)

    def abort(self) -> None:
        if not self._finished:
            self._finished = True
            self._backend._finish(self._temp, None)
