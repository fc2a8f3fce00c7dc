"""Durable, owner-only file operations."""

import errno
import os
from pathlib import Path

from ckpt.errors import DiskFull, PermissionProblem, StoreError

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


DISK_FULL_HINT = "free some space or remove old checkpoints with 'ckpt rm' (which works on a full disk)"


def translate_os_error(exc: OSError, what: str) -> StoreError:
    """Turns an OSError into the typed error a user can act on."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on the store's disk while {what}", hint=DISK_FULL_HINT)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionProblem(f"cannot write the store while {what}: {exc.strerror} ({exc.filename})",
                                 hint="run as root or choose another store with --store")
    return StoreError(f"store I/O error while {what}: {exc.strerror} ({exc.filename})")


def atomic_write_bytes(path: Path, data: bytes, replace: bool = True) -> None:
    """Temp file in the same directory, write, fsync, rename, fsync the directory.

    replace=False never replaces an existing file: the temp file is linked into place (which
    fails with FileExistsError if path exists), then unlinked."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
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
    fsync_dir(path.parent)
