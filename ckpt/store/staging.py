"""Staging areas: where CRIU writes a dump's images before they enter the store, and where a
restore lays out a checkpoint's images for CRIU.

The base is the store's own tmp/ (covered by the store's ownership checks) or, with
CKPT_STAGING=ram, /dev/shm: a directory every user can write, where no name can be trusted,
since another user can plant a symbolic link or a directory under any name ckpt would pick.
So, in either base:
- every directory ckpt makes is made by mkdtemp (random name, O_EXCL, mode 0700);
- a dump's directory appears under its final name, dump-*, only once it is locked: it is made
  as new-*, flock'd, then renamed with RENAME_NOREPLACE. A dump-* directory whose lock is
  free therefore belongs to a dump that is gone, and the sweep of leftovers never races a
  live dump;
- an entry counts as ckpt's only if lstat shows a real directory, ours, mode 0700 (in a
  sticky directory such as /dev/shm, nobody else can then rename or remove it);
- removal never follows a link (shutil.rmtree works on directory descriptors; the detached
  `rm -rf` only ever gets a directory that is ours in a sticky base).
Names in /dev/shm start with ckpt-<uid>-<12 hex of the BLAKE3 of the store path>-, so that each
store finds its own leftovers there.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from ckpt.errors import StoreError
from ckpt.system.files import owned_private_dir, rename_noreplace

if TYPE_CHECKING:
    from ckpt.store.blocks.blockstore import StreamedPages

RAM_BASE = Path("/dev/shm")
LARGE_TREE = 512 << 20
# A new-* directory is unlocked only between mkdtemp and flock (microseconds); one older than
# this with its lock free was left by a dump killed in that moment.
ABANDONED_NEW_S = 3600
TRASH_SUFFIX = ".trash"
KINDS = ("new", "dump", "restore")


def _is_locked(path: Path) -> bool:
    """Whether a live process holds the flock of the directory (or of the owner file inside it,
    which dumps of earlier versions locked)."""
    for target, flags in ((path, os.O_DIRECTORY), (path / "owner", 0)):
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | flags)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def _tree_bytes(path: Path) -> int:
    total = 0
    for sub in (path, path / "images"):
        try:
            total += sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(sub)
                         if e.is_file(follow_symlinks=False))
        except OSError:
            pass
    return total


def remove_tree(path: Path) -> None:
    """Removes a staging or restore directory, never following a link.

    Freeing a large one takes a while (about 0.2 s per GiB in tmpfs) that the user should not
    wait for: it is renamed to <name>.trash at once and removed by a detached `rm`. If that rm
    is killed, the next sweep of leftovers removes the .trash directory."""
    if not owned_private_dir(path):
        return  # not ours (or already gone): never removed through a link
    if _tree_bytes(path) >= LARGE_TREE:
        trash = path.with_name(f"{path.name}-{secrets.token_hex(3)}{TRASH_SUFFIX}")
        try:
            rename_noreplace(path, trash)
        except OSError:
            pass
        else:
            subprocess.Popen(["rm", "-rf", "--", str(trash)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            return
    shutil.rmtree(path, ignore_errors=True)


discard = remove_tree  # a materialised images directory is removed the same way


def check_shared_base(base: Path) -> None:
    """A directory others can write is usable for staging only if they cannot rename or remove
    what ckpt makes in it: it must be root's (or ours) and sticky, as /dev/shm is."""
    try:
        st = os.lstat(base)
    except OSError as exc:
        raise StoreError(f"cannot stage in {base}: {exc.strerror}", hint="unset CKPT_STAGING (stage on disk)") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise StoreError(f"{base} is not a directory of root's with the sticky bit (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): others could rename ckpt's "
                         "staging there", hint="unset CKPT_STAGING to stage on disk in the store's tmp/")


class StagingArea:
    """One base directory and the prefix of ckpt's names in it (empty in the store's tmp/)."""

    def __init__(self, base: Path, prefix: str = ""):
        self.base = base
        self.prefix = prefix

    @classmethod
    def in_ram(cls, store_root: Path) -> StagingArea:
        check_shared_base(RAM_BASE)
        tag = blake3.blake3(str(store_root).encode()).hexdigest()[:12]
        return cls(RAM_BASE, f"ckpt-{os.geteuid()}-{tag}-")

    def new_dir(self, kind: str) -> Path:
        """A fresh private directory <prefix><kind>-<random>."""
        return Path(tempfile.mkdtemp(prefix=f"{self.prefix}{kind}-", dir=self.base))

    def begin_dump(self, checkpoint_id: str) -> DumpStaging:
        return DumpStaging(self, checkpoint_id)

    def entries(self) -> list[tuple[str, Path]]:
        """ckpt's directories here as (kind, path); kind is "trash" for directories being
        removed. Anything that is not a real directory of ours, mode 0700, is ignored."""
        try:
            names = os.listdir(self.base)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            if not name.startswith(self.prefix):
                continue
            kind = "trash" if name.endswith(TRASH_SUFFIX) else name[len(self.prefix):].split("-", 1)[0]
            if kind in (*KINDS, "trash") and owned_private_dir(self.base / name):
                found.append((kind, self.base / name))
        return found

    def sweep(self, restores: bool) -> int:
        """Removes what dumps that are gone left behind (and, with restores=True, restore
        directories: only callers holding the store's exclusive lock may, since restores hold
        the shared one). Returns how many directories it removed."""
        removed = 0
        for kind, path in self.entries():
            if kind in ("dump", "new") and _is_locked(path):
                continue
            if kind == "new":
                try:
                    if time.time() - os.lstat(path).st_mtime < ABANDONED_NEW_S:
                        continue
                except OSError:
                    continue
            if kind == "restore" and not restores:
                continue
            if kind == "trash":
                shutil.rmtree(path, ignore_errors=True)
            else:
                remove_tree(path)
            removed += 1
        return removed


class DumpStaging:
    """<prefix>dump-<id>-<random>: where CRIU writes. The directory stays flock'd while the dump
    is alive, and has its final name only once locked (see the module's docstring)."""

    def __init__(self, area: StagingArea, checkpoint_id: str):
        fresh = area.new_dir("new")
        self.root = fresh
        # Pages images streamed by CRIU rather than written into images_dir, by name
        # (ckpt/dump/pagestream.py): their kept pages live under root.
        self.streamed: dict[str, StreamedPages] = {}
        self._lock_fd = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            final = area.base / f"{area.prefix}dump-{checkpoint_id}-{fresh.name[-8:]}"
            rename_noreplace(fresh, final)
            self.root = final
            self.images_dir = self.root / "images"
            os.mkdir(self.images_dir, 0o700)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            os.close(self._lock_fd)
            raise

    def image_files(self) -> list[Path]:
        return sorted(p for p in self.images_dir.iterdir() if not p.is_symlink() and p.is_file())

    def remove(self) -> None:
        remove_tree(self.root)
        os.close(self._lock_fd)
