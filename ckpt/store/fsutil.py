"""The store's checks of who owns and may write its directories, and its I/O errors made typed."""

import errno
import os
import stat
from pathlib import Path

from ckpt.errors import DISK_FULL_HINT, DiskFull, PermissionProblem, StoreError


def translate_os_error(exc: OSError, what: str) -> StoreError | PermissionProblem:
    """Turns an OSError into the typed error a user can act on."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on the store's disk while {what}", hint=DISK_FULL_HINT)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionProblem(f"cannot write the store while {what}: {exc.strerror} ({exc.filename})",
                                 hint="run as root or choose another store with --store")
    return StoreError(f"store I/O error while {what}: {exc.strerror} ({exc.filename})")


def owner_name(uid: int) -> str:
    """The user name of uid, for messages ("uid N" when it has none)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_trusted_dir(path: Path, what: str, follow: bool = False, elsewhere: str | None = None) -> None:
    """Refuses a directory that another user owns or others may write: whoever can write a
    store can plant a checkpoint that its owner restores (code run as that user, as root for
    root's store). follow=False also refuses a symbolic link. elsewhere: how to choose another
    directory, for one the user chose that is not a store (the cache root: "choose another
    CKPT_CACHE")."""
    st = os.stat(path) if follow else os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionProblem(f"{what} {path} is a symbolic link, which ckpt does not follow inside a store",
                                hint="replace it with the directory it points to, or remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionProblem(f"{what} {path} is not a directory", hint="move it away")
    if st.st_uid != me:
        raise PermissionProblem(f"{what} {path} belongs to {owner_name(st.st_uid)}, not to {owner_name(me)} who "
                                "runs ckpt: its owner could plant a checkpoint that you restore",
                                hint=f"chown -R {owner_name(me)} {path}, or "
                                     f"{elsewhere or 'choose another store with --store'}")
    if st.st_mode & 0o022:
        raise PermissionProblem(f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): they "
                                "could plant a checkpoint that you restore",
                                hint=f"chmod 700 {path}, or {elsewhere}" if elsewhere
                                else f"chmod go-w {path} (ckpt makes its directories 0700)")


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
                                    f"{owner_name(st.st_uid)}: they could replace the store with their own",
                                    hint="choose a store in a directory of yours or root's with --store")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PermissionProblem(f"the store {path} is inside {ancestor}, which others may write "
                                    f"(mode {stat.S_IMODE(st.st_mode):04o}): they could replace the store",
                                    hint=f"chmod go-w {ancestor} (or +t), or choose another store with --store")
