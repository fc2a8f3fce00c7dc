"""Durable, owner-only file operations: the one copy every layer uses."""

import ctypes
import errno
import mmap
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The most one write(2) is asked to take. The page cache allocates a file's pages in folios
# as large as the write (ext4, kernel 6.18): writing a GiB in 16 MiB writes took 0.7-2.7 s
# here, and 11-14 s when the memory had just gone back to the host (free page reporting hands
# back large free blocks first, and the copy faults every page of them in again: perf shows
# copy_folio_from_iter_atomic); in writes of 64-512 KiB it took 0.23-0.28 s either way.
WRITE_PIECE = 256 << 10


def write_all(fd: int, data) -> None:
    """Writes all of data (bytes or a buffer) to fd: os.write may write less than asked (a
    pipe, a signal, a nearly full disk), so it is called until nothing is left."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_PIECE]):]


def pwrite_all(fd: int, data, offset: int) -> None:
    """Writes all of data at offset in fd (os.pwrite, like os.write, may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view[:WRITE_PIECE], offset)
        view, offset = view[written:], offset + written


def fresh_buffer(size: int) -> memoryview:
    """size writable bytes of zeros, in an anonymous mapping of their own: the kernel hands its
    pages out zeroed as they are first written, where a bytearray is zeroed once more by a
    memset of its own (a GiB fetched into bytearrays: 0.1 CPU-seconds of memset)."""
    return memoryview(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


@contextmanager
def new_file(path: Path, mode: int = FILE_MODE) -> Iterator[int]:
    """Creates path (never one that exists: O_EXCL) and yields its descriptor for the block to
    fill; if the block fails, the file is removed: a part of it must not pass for the whole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def make_readable_dir(path: Path) -> None:
    """A directory only its owner writes and everyone reads (0755): the copies' directory, whose
    identity files a copy running as another user must read."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(path, 0o755)


def replace_staged(path: Path, data: bytes) -> None:
    """Replaces a file of a staging directory (images laid out for CRIU, or a dump's) with a
    new file of this content: a new inode, since the old one may be a hard link to a stored
    object or to another restore's file. The old name is unlinked first, so that the new file
    is not renamed over another: ext4 writes such a file out at once (auto_da_alloc, about 1 ms
    a file here: 100 pagemaps of a tree rewritten twice each took 0.2 s). Nothing reads a
    staging directory while ckpt edits it, and none outlives a failure or a crash meanwhile."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    atomic_write_bytes(path, data, durable=False)


def atomic_write_bytes(path: Path, data: bytes, replace: bool = True, mode: int = FILE_MODE,
                       durable: bool = True, owner: int | None = None) -> None:
    """Temp file in the same directory, write, fsync, rename, fsync the directory: readers see
    the old content or the new, never a part. The temp file's name starts with a dot (cron, for
    one, ignores such names in /etc/cron.d) and is random, opened with O_EXCL|O_NOFOLLOW: in a
    directory others can write (the agent's result files), a planted link is never followed.

    replace=False never replaces an existing file: the temp file is linked into place (which
    fails with FileExistsError if path exists), then unlinked. durable=False skips the fsyncs,
    for files that need not outlive a crash (caches, images being staged, files on tmpfs).
    owner: the uid the file is to belong to (root writing a file for a process it serves)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            if owner is not None and owner != os.geteuid():
                os.fchown(fd, owner, -1)
            write_all(fd, data)
            if mode != FILE_MODE:
                os.fchmod(fd, mode)  # the umask may have taken bits away
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError as exc:
                # A filesystem without hard links (some FUSE or network ones): check, then rename.
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                if os.path.lexists(path):
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
                os.rename(tmp, path)
            else:
                os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(source: Path, target: Path) -> None:
    """rename(2) that never replaces what is at target (renameat2's RENAME_NOREPLACE): plain
    rename silently replaces an empty directory, which another user may have planted in a
    shared directory such as /dev/shm. Raises FileExistsError if target exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS) and not os.path.lexists(target):
        os.rename(source, target)  # a filesystem without RENAME_NOREPLACE (never tmpfs or ext4)
        return
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(target))
    raise OSError(err, os.strerror(err), str(target))


def owned_private_dir(path: Path) -> bool:
    """Whether path is a real directory (not a link) owned by us that nobody else can write:
    the test an entry of a shared directory such as /dev/shm must pass before ckpt uses it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch(fd: int, offset: int, length: int) -> int:
    """Punches a hole of length bytes at offset (FALLOC_FL_PUNCH_HOLE, the size kept);
    returns 0, or the errno it failed with (EINTR retried)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate64", libc.fallocate)  # 64-bit offsets on every build
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    while fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        if ctypes.get_errno() != errno.EINTR:
            return ctypes.get_errno()
    return 0


SYNC_FILE_RANGE_WRITE = 0x02


def start_writeback(path: Path, ranges: list[tuple[int, int]]) -> None:
    """Starts writing the (offset, length) ranges of the file at path to disk without waiting
    (sync_file_range, SYNC_FILE_RANGE_WRITE), so that a later fsync finds them written or on
    their way. Only a head start: where it cannot (another system, an error), the fsync does
    all of it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        sync_file_range = ctypes.CDLL(None).sync_file_range
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        for offset, length in ranges:
            if sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) != 0:
                return
    except AttributeError:
        return
    finally:
        os.close(fd)


def punch_out(path: Path, keep: list[tuple[int, int]]) -> bool:
    """Frees every byte of the file at path outside the sorted, disjoint (offset, length)
    ranges of keep (FALLOC_FL_PUNCH_HOLE, the size kept): those read as zeros and take no
    disk or page cache. False where any range could not be punched (the filesystem cannot,
    the disk is full): the bytes outside keep are then freed in part or not at all, which
    only the store's size shows; the bytes of keep are never touched."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        at = 0
        for offset, length in [*keep, (os.fstat(fd).st_size, 0)]:
            if offset > at and _punch(fd, at, offset - at):
                return False
            at = max(at, offset + length)
        return True
    finally:
        os.close(fd)


def can_punch_holes(directory: Path) -> bool:
    """Whether files in directory can have holes punched in them (FALLOC_FL_PUNCH_HOLE): not
    on every filesystem (NFSv3, FUSE, vfat), and CRIU fails a restore whose auto-dedup it
    cannot do. Tried on a scratch file."""
    import tempfile

    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".punch-")
    except OSError:
        return False
    try:
        os.write(fd, bytes(8192))
        return _punch(fd, 0, 4096) == 0
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
