"""Durable, owner-only file operations."""

import ctypes
import errno
import os
import stat
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


def translate_os_error(exc: OSError, what: str) -> StoreError | PermissionProblem:
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


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_trusted_dir(path: Path, what: str, follow: bool = False) -> None:
    """Refuses a directory that another user owns or others may write: whoever can write a
    store can plant a checkpoint that its owner restores (code run as that user, as root for
    root's store). follow=False also refuses a symbolic link."""
    st = os.stat(path) if follow else os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionProblem(f"{what} {path} is a symbolic link, which ckpt does not follow inside a store",
                                hint="replace it with the directory it points to, or remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionProblem(f"{what} {path} is not a directory", hint="move it away")
    if st.st_uid != me:
        raise PermissionProblem(f"{what} {path} belongs to {_owner_name(st.st_uid)}, not to {_owner_name(me)} who "
                                "runs ckpt: its owner could plant a checkpoint that you restore",
                                hint=f"chown -R {_owner_name(me)} {path}, or choose another store with --store")
    if st.st_mode & 0o022:
        raise PermissionProblem(f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): they "
                                "could plant a checkpoint that you restore",
                                hint=f"chmod go-w {path} (ckpt makes its directories 0700)")


def check_safe_ancestors(path: Path) -> None:
    """Refuses a store inside a directory someone else could rename it out of: every ancestor
    must belong to root or to us, and be writable by nobody else unless sticky (as /tmp)."""
    me = os.geteuid()
    for ancestor in path.parents:
        try:
            st = os.stat(ancestor)
        except FileNotFoundError:
            continue  # made by ckpt itself (0700) when it creates the store
        if st.st_uid not in (0, me):
            raise PermissionProblem(f"the store {path} is inside {ancestor}, which belongs to "
                                    f"{_owner_name(st.st_uid)}: they could replace the store with their own",
                                    hint="choose a store in a directory of yours or root's with --store")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PermissionProblem(f"the store {path} is inside {ancestor}, which others may write "
                                    f"(mode {stat.S_IMODE(st.st_mode):04o}): they could replace the store",
                                    hint=f"chmod go-w {ancestor} (or +t), or choose another store with --store")
