"""The local directory backend: a blob is a file under the store's root, at its name.

Durability is the atomic-write rule: temp file in the same directory (".<name>.<pid>...tmp",
which listings leave out), write, fsync, rename, fsync the directory; put_if_absent links the
temp file into place instead of renaming it, which fails if the name exists. The lock is
flock(2) on <root>/lock with holder records in <root>/holders/ (see "Locking" in
docs/design.md).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import json
import mmap
import os
import secrets
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from ckpt.errors import StoreBusy
from ckpt.store.backends.base import (Backend, BlobExists, BlobInfo, BlobNotFound, BlobWriter, LockOwner,
                                      RangeReader, check_name)
from ckpt.system.files import (FILE_MODE, WRITE_PIECE, atomic_write_bytes, can_punch_holes, fsync_dir,
                               make_private_dir, write_all)
from ckpt.system.locks import wait_for_flock
from ckpt.system.procfs import pid_exists

WRITE_BUFFER = WRITE_PIECE  # what a write(2) takes at most (see WRITE_PIECE: larger ones cost more)
# How much of a large blob (a pack) is written before the kernel is asked to start writing it
# to disk: the fsync of the commit then waits for the last stretch only, not for all of it.
WRITEBACK_EVERY = 8 << 20
COPY_CHUNK = 4 << 20


class LocalBackend(Backend):
    def __init__(self, root: Path):
        self.root = root
        self._device: int | None = None  # the store's filesystem, if it can punch holes (keeps_holes)

    def _path(self, name: str, incomplete: bool = False) -> Path:
        """The file of a blob. incomplete=True also accepts a temp file's name (from list)."""
        head, _, last = name.rpartition("/")
        if incomplete and last.startswith("."):
            check_name(f"{head}/{last[1:]}" if head else last[1:])
        else:
            check_name(name)
        return self.root / name

    def where(self, name: str) -> str:
        return str(self._path(name, incomplete=True))

    def _ensure_dir(self, directory: Path) -> None:
        """Makes a blob's directory (0700) if it is missing, durably: its entry in its parent
        is fsynced, or a crash could lose a committed blob along with the new directory."""
        if os.path.isdir(directory):
            return
        make_private_dir(directory)
        fsync_dir(directory.parent)

    # ---- writing ---------------------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._ensure_dir(path.parent)
        atomic_write_bytes(path, data)

    def put_if_absent(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._ensure_dir(path.parent)
        try:
            atomic_write_bytes(path, data, replace=False)
        except FileExistsError:
            raise BlobExists(errno.EEXIST, "blob exists", str(path)) from None

    def put_file(self, name: str, source: Path) -> int:
        path = self._path(name)
        self._ensure_dir(path.parent)
        os.chmod(source, FILE_MODE)
        fd = os.open(source, os.O_RDONLY)
        try:
            os.fsync(fd)  # the file may have been written back already: then this costs nothing
        finally:
            os.close(fd)
        try:
            # Same filesystem (staging in the store's tmp/): a rename moves the data without copying it.
            os.rename(source, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with open(source, "rb") as src, self.writer(name) as out:  # staged in RAM: copy it
                while chunk := src.read(COPY_CHUNK):
                    out.write(chunk)
                out.commit()
            return out.written
        fsync_dir(path.parent)
        return os.stat(path).st_size

    def keeps_holes(self, source: Path) -> bool:
        """put_file renames a file on the store's filesystem (and copies any other); whether
        that filesystem can punch holes is tried once, on a scratch file in the store."""
        if self._device is None:
            self._device = os.stat(self.root).st_dev if can_punch_holes(self.root) else -1
        try:
            return os.stat(source).st_dev == self._device
        except OSError:
            return False

    def writer(self, name: str) -> BlobWriter:
        path = self._path(name)
        self._ensure_dir(path.parent)
        return _LocalWriter(path)

    # ---- reading ---------------------------------------------------------------------------

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise BlobNotFound(errno.ENOENT, "no such blob", str(path)) from None
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            parts = []
            while length > 0:
                chunk = os.pread(fd, min(length, 1 << 30), offset)
                if not chunk:
                    break
                parts.append(chunk)
                offset += len(chunk)
                length -= len(chunk)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    def get_file(self, name: str, dest: Path) -> None:
        path = self._path(name)
        try:
            os.link(path, dest)  # read-only from here on (CRIU reads it): share the blocks
        except FileNotFoundError:
            if not os.path.lexists(path):
                raise BlobNotFound(errno.ENOENT, "no such blob", str(path)) from None
            raise
        except OSError:  # dest on another filesystem (staging in RAM)
            shutil.copyfile(path, dest)

    def stat(self, name: str) -> BlobInfo:
        path = self._path(name)
        try:
            st = os.stat(path)
            return BlobInfo(name, st.st_size, st.st_mtime, allocated=st.st_blocks * 512)
        except FileNotFoundError:
            raise BlobNotFound(errno.ENOENT, "no such blob", str(path)) from None

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def list(self, prefix: str, incomplete: bool = False) -> builtins.list[BlobInfo]:
        head = prefix.rpartition("/")[0]
        if head:
            check_name(head)
        found = list(self._walk(self.root / head if head else self.root, head, prefix, incomplete))
        return sorted(found, key=lambda info: info.name)

    def _walk(self, directory: Path, rel: str, prefix: str, incomplete: bool) -> Iterator[BlobInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            name = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                # Only into directories that can hold names with the prefix (never tmp/ or logs/
                # for "packs/").
                if name.startswith(prefix) or prefix.startswith(name + "/"):
                    yield from self._walk(Path(entry.path), name, prefix, incomplete)
            elif entry.is_file(follow_symlinks=False) and name.startswith(prefix) \
                    and entry.name.startswith(".") == incomplete:
                try:
                    st = entry.stat(follow_symlinks=False)
                    yield BlobInfo(name, st.st_size, st.st_mtime, allocated=st.st_blocks * 512)
                except FileNotFoundError:
                    continue

    def reader(self) -> RangeReader:
        return _LocalReader(self)

    # ---- deleting --------------------------------------------------------------------------

    def delete(self, names: builtins.list[str]) -> None:
        directories = set()
        for name in names:
            path = self._path(name, incomplete=True)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            directories.add(path.parent)
        for directory in sorted(directories):
            fsync_dir(directory)

    # ---- locking ---------------------------------------------------------------------------

    @contextmanager
    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> Iterator[None]:
        """flock(2) on <root>/lock: the kernel releases it when its holder dies, so a crashed
        ckpt never leaves the store locked. Holder records only say whom a waiting command
        waits for."""
        holders_dir = self.root / "holders"
        make_private_dir(holders_dir)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH

        def busy() -> StoreBusy:
            who = ", ".join(h.describe() for h in self.lock_holders()) or "another ckpt command"
            return StoreBusy(f"the store at {self.root} is locked by {who}",
                             hint=f"waited {timeout:.0f} s; try again later or raise CKPT_LOCK_TIMEOUT")

        try:
            wait_for_flock(fd, mode, time.monotonic() + timeout, busy,
                           (lambda: on_wait(self.lock_holders())) if on_wait is not None else None)
            owner = LockOwner(pid=os.getpid(), host=socket.gethostname(), command=" ".join(sys.argv[:3]) or "ckpt",
                              since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              mode="exclusive" if exclusive else "shared")
            holder = _write_holder(holders_dir / f"{os.getpid()}-{secrets.token_hex(4)}.json",
                                   json.dumps(owner.to_json()).encode())
            try:
                if exclusive:
                    _remove_stale_holders(holders_dir)
                yield
            finally:
                if holder is not None:
                    holder.unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the flock

    def lock_holders(self) -> builtins.list[LockOwner]:
        holders = []
        for path in sorted((self.root / "holders").glob("*.json")):
            try:
                record = json.loads(path.read_text())
                owner = LockOwner(pid=int(record.get("pid", 0)), host=str(record.get("host", "")),
                                  command=str(record.get("command", "?")), since=str(record.get("since", "?")),
                                  mode=str(record.get("mode", "?")))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            if owner.pid != os.getpid() and pid_exists(owner.pid):
                holders.append(owner)
        return holders


class _LocalWriter(BlobWriter):
    """Writes through a large buffer (a next dump's segments are a page or two each, and a
    write() apiece cost 20-50 us with the file dirty), asking the kernel to start writing each
    stretch to disk as soon as it is complete: without that, the fsync before the commit
    started all of the writeback (130 ms for 40 MB here) once every segment was written."""

    def __init__(self, path: Path):
        self._path = path
        self._tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")
        self._file = open(os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb",
                          buffering=WRITE_BUFFER)
        self.written = 0
        self._queued = 0  # bytes handed to writeback so far
        self._finished = False

    def write(self, data) -> None:
        with memoryview(data) as view, view.cast("B") as whole:
            if len(whole) <= WRITE_PIECE:
                self._file.write(whole)
            else:  # a buffered file hands a write larger than its buffer to write(2) whole
                for at in range(0, len(whole), WRITE_PIECE):
                    self._file.write(whole[at:at + WRITE_PIECE])
            self.written += len(whole)
        if self.written - self._queued >= WRITEBACK_EVERY:
            self._file.flush()
            # Starts writeback of that stretch without waiting for it (on Linux, DONTNEED
            # writes dirty pages back asynchronously, then drops the clean ones: a pack is
            # not read again soon).
            os.posix_fadvise(self._file.fileno(), self._queued, self.written - self._queued,
                             os.POSIX_FADV_DONTNEED)
            self._queued = self.written

    def commit(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.rename(self._tmp, self._path)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        fsync_dir(self._path.parent)

    def abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            # Without writing what is still buffered: on a full disk that write fails again.
            self._file.close()
        except OSError:
            pass  # the descriptor is closed all the same
        try:
            self._tmp.unlink(missing_ok=True)
        except OSError:
            pass


class _LocalReader(RangeReader):
    """Keeps each blob it reads open and mapped: a restore reads every segment of a pack
    through one mapping, and copies uncompressed ones file to file with sendfile(2) (the bytes
    never pass through a Python buffer, which halves the memory traffic of a restore)."""

    def __init__(self, backend: LocalBackend):
        super().__init__(backend)
        self._local = backend
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self._local._path(name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise BlobNotFound(errno.ENOENT, "no such blob", str(path)) from None
            self._fds[name] = fd
            self._sizes[name] = os.fstat(fd).st_size
        return fd

    def size(self, name: str) -> int:
        self._fd(name)
        return self._sizes[name]

    def read(self, name: str, offset: int, length: int) -> memoryview:
        size = self.size(name)
        end = min(offset + length, size)
        if end <= offset:
            return memoryview(b"")
        mm = self._maps.get(name)
        if mm is None:
            mm = self._maps[name] = mmap.mmap(self._fd(name), size, prot=mmap.PROT_READ)
        return memoryview(mm)[offset:end]

    def mapped(self, name: str) -> bool:
        return True

    def copy_to(self, name: str, offset: int, length: int, fd: int) -> int:
        source = self._fd(name)
        copied = 0
        while copied < length:
            sent = os.sendfile(fd, source, offset + copied, length - copied)
            if sent == 0:
                break  # the blob ends
            copied += sent
        return copied

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()
        super().close()


def _remove_stale_holders(holders_dir: Path) -> None:
    for path in holders_dir.glob("*.json"):
        try:
            pid = int(path.name.split("-", 1)[0])
        except ValueError:
            continue
        if not pid_exists(pid):
            path.unlink(missing_ok=True)


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
            write_all(fd, data)
        finally:
            os.close(fd)
    except OSError:
        path.unlink(missing_ok=True)  # a partial record would read as nobody's
        return None
    return path

