"""The local cache of a remote store: CachingBackend wraps a backend (S3) with a directory of
copies of its immutable blobs, so that a next dump does not download the index files again and
a restore on the host that dumped (or restored) downloads nothing.

Only `index/`, `objects/` and `packs/` are cached: they are named by their content or by a
random pack id and never change once written (see "Storage backends" in docs/design.md).
Everything else (manifests, which `forget` deletes; `store.json`, `key`, damage markers, lock
objects) and every question about what exists (`stat`, `exists`, `list`) goes to the remote
store: a cached copy of a blob that another host pruned must never make it look present (a
dump would name an object that is gone). Only content comes from the cache, and only for names
the store found named by what it listed.

See "Local cache" in docs/design.md for the layout, the cap, eviction and why it is safe.
"""

from __future__ import annotations

import bisect
import builtins
import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import blake3

from ckpt.errors import CkptError, DamagedCheckpoint
from ckpt.store.backends.base import (Backend, BlobInfo, BlobNotFound, BlobWriter, LockOwner, RangeReader,
                                      check_name)
from ckpt.store.backends.local import LocalBackend
from ckpt.store.fsutil import check_trusted_dir
from ckpt.system.files import FILE_MODE, make_private_dir, pwrite_all, write_all

CACHED_PREFIXES = ("index/", "objects/", "packs/")
OBJECTS_PREFIX = "objects/"
# Blobs named by the BLAKE3 of their content (objects: of their decompressed content): a
# cached copy is checked against its name the first time a process reads it.
CHECKED_PREFIXES = ("index/", "objects/")
DAMAGED_PREFIX = "damaged/"
# A blob read in part but not cached is downloaded whole first if it is at most this big (one
# request instead of many; objects and index files are kilobytes to megabytes, the packs of
# next dumps a few MiB). A larger one (the first pack of a 1 GiB target) is read range by
# range: a lazy restore must not wait for a whole pack before the tree runs.
WHOLE_BELOW = 64 << 20
# A segment is at most 256 pages (1 MiB), a little more stored if it did not compress: a
# damage marker's segment lies within this much of its offset.
COMPARE_WINDOW = 2 << 20
# Eviction brings the cache down to this share of the cap, so that not every write evicts.
LOW_WATER = 0.9
# A temp file this old belongs to a writer that died (a download takes seconds, a pack
# written during a dump minutes): eviction removes it.
STALE_TEMP = 3600.0
BLOBS_DIR = "blobs"
USAGE_FILE = "usage"
EVICT_LOCK = "evict.lock"
COPY_CHUNK = 4 << 20


def _copy_dir(directory: Path) -> None:
    """Makes a copy's directory (0700) if it is missing; not durably, as the copies (_install)."""
    if not os.path.isdir(directory):
        make_private_dir(directory)


def store_cache_dir(cache_root: Path, store_id: str) -> Path:
    """The directory of one remote store under the cache root: <root>/<16 hex digits of the
    BLAKE3 of the store's identity>. Its blobs/ is the cache; the rest is the caller's (a
    remote store's tmp/ and logs/)."""
    return cache_root / blake3.blake3(store_id.encode()).hexdigest()[:16]


def cache_bytes(spec: str, directory: Path) -> int:
    """The cap of CKPT_CACHE_SIZE: a number of bytes with an optional K, M, G or T (powers of
    1024), or a percentage of the size of the filesystem holding directory (its nearest
    existing ancestor). ValueError if it is neither; 0 turns the cache off."""
    text = spec.strip().upper().removesuffix("B").removesuffix("I")
    if text.endswith("%"):
        share = float(text[:-1])
        if not 0 <= share <= 100:
            raise ValueError(f"{spec!r} is not a percentage from 0 to 100")
        existing = directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        fs = os.statvfs(existing)
        return int(fs.f_blocks * fs.f_frsize * share / 100)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:], 1)
    number = float(text[:-1] if text[-1:] in units else text)
    if number < 0:
        raise ValueError(f"{spec!r} is negative")
    return int(number * scale)


def _cached(name: str) -> bool:
    return name.startswith(CACHED_PREFIXES) and not name.rpartition("/")[2].startswith(".")


def _temp_name(path: Path, suffix: str = "tmp") -> Path:
    """A temp file next to path: a dot-name (listings and lookups skip it), unique per writer."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.{suffix}")


def _content_ok(name: str, path: Path) -> bool:
    """Whether a cached index file or object holds what its name says (its BLAKE3; a .zst
    object's decompressed content's). Any other name: True (the store checks packs)."""
    if not name.startswith(CHECKED_PREFIXES):
        return True
    last = name.rpartition("/")[2]
    digest, compressed = (last[:-4], True) if last.endswith(".zst") else (last, False)
    import zstandard

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    try:
        if compressed:
            with open(path, "rb") as src, zstandard.ZstdDecompressor().stream_reader(src) as reader:
                while chunk := reader.read(COPY_CHUNK):
                    hasher.update(chunk)
        elif os.stat(path).st_size:
            hasher.update_mmap(path)
    except FileNotFoundError:
        raise  # evicted meanwhile: not damage
    except (OSError, zstandard.ZstdError):
        return False
    return hasher.hexdigest() == digest


class CachingBackend(Backend):
    """inner (a remote store) behind a local cache of its immutable blobs.

    cache_root is the cache directory shared by every store and process (CKPT_CACHE); this
    store's copies live in store_cache_dir(cache_root, store_id)/blobs. max_bytes caps what
    the copies of all stores under cache_root take together (oldest used first out).
    whole_below: see WHOLE_BELOW (tests make it small)."""

    def __init__(self, inner: Backend, cache_root: Path, store_id: str, max_bytes: int, *,
                 whole_below: int = WHOLE_BELOW):
        self.inner = inner
        self.cache_root = Path(cache_root)
        self.directory = store_cache_dir(self.cache_root, store_id) / BLOBS_DIR
        self.max_bytes = max(0, max_bytes)
        self.whole_below = whole_below
        self._lock = threading.Lock()
        self._checked: set[str] = set()  # names whose cached copy this process checked
        self._drops: dict[str, int] = {}  # names whose cached copy this process dropped, and how often
        self._sizes: dict[str, int] = {}  # sizes of blobs read in ranges (immutable: asked once)
        self._read_again: set[str] = set()  # copies dropped as damaged whose store bytes were intact
        self._prepare()
        self._local = LocalBackend(self.directory)

    def _prepare(self) -> None:
        """Makes the cache's directories (0700): the copies are process memory, and a reader
        restores what it finds there, so they must be the user's alone. An existing cache root
        is not chmod'ed (it may be a directory the user chose), only checked."""
        if not os.path.isdir(self.cache_root):
            self.cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_trusted_dir(self.cache_root, "the cache directory", follow=True)
        for directory in (self.directory.parent, self.directory):
            make_private_dir(directory)
            check_trusted_dir(directory, "the cache directory")
        for prefix in CACHED_PREFIXES:
            # Made here, each 0700: mkdir(parents=True) would make them with the umask's mode.
            make_private_dir(self.directory / prefix)

    def _path(self, name: str) -> Path:
        return self.directory / check_name(name)

    def where(self, name: str) -> str:
        return self.inner.where(name)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    # ---- writing: to the remote store, and a copy kept -------------------------------------

    def put(self, name: str, data: bytes) -> None:
        if name.startswith(DAMAGED_PREFIX) and self._damage_is_the_caches(name):
            return
        self.inner.put(name, data)
        if _cached(name) and self.max_bytes:
            self._keep_bytes(name, data)

    def put_if_absent(self, name: str, data: bytes) -> None:
        self.inner.put_if_absent(name, data)  # manifests, store.json, key: never cached

    def put_file(self, name: str, source: Path) -> int:
        if not _cached(name) or self.max_bytes == 0:
            return self.inner.put_file(name, source)
        kept = self._adopt(name, source)  # before the inner backend consumes it
        try:
            size = self.inner.put_file(name, source)
        except BaseException:
            if kept is not None:
                kept.unlink(missing_ok=True)
            raise
        if kept is not None:
            self._install(name, kept)
        return size

    def writer(self, name: str) -> BlobWriter:
        out = self.inner.writer(name)
        if not _cached(name) or self.max_bytes == 0:
            return out
        try:
            copy = self._local.writer(name)
        except OSError:
            copy = None  # no room for the copy: the blob is written all the same
        return _TeeWriter(self, name, out, copy)

    # ---- reading: the cached copy, else the remote store -----------------------------------

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        if not _cached(name) or self.max_bytes == 0:
            return self.inner.get(name, offset, length)
        if self._use(name) is not None:
            try:
                return self._local.get(name, offset, length)
            except BlobNotFound:
                pass  # evicted in between
        if offset == 0 and length is None:
            data = self.inner.get(name)
            self._keep_bytes(name, data, check=True)
            return data
        # A range (a prune copying segments, a decompressor reading an object): the whole blob
        # first if it is small. Sizes never change: asked once per process.
        size = self._sizes.get(name)
        if size is None and offset == 0 and length is not None and name.startswith(OBJECTS_PREFIX):
            # An object is read from its start to its end (decompressed): a first read that
            # comes back short is the whole object, without its size asked first (from S3,
            # a request per object of a restore's layout).
            data = self.inner.get(name, 0, length)
            if len(data) < length:
                self._keep_bytes(name, data, check=True)
            return data  # (a larger one: the next range, further on, asks its size)
        if size is None:
            size = self._sizes[name] = self.inner.stat(name).size
        if self._fits_whole(size) and self._fetch(name) is not None:
            try:
                return self._local.get(name, offset, length)
            except BlobNotFound:
                pass
        return self.inner.get(name, offset, length)

    def get_file(self, name: str, dest: Path) -> None:
        if not _cached(name) or self.max_bytes == 0:
            return self.inner.get_file(name, dest)
        if self._use(name) is None and self._fetch(name, spare=dest) is None:
            if not os.path.lexists(dest):  # else _fetch moved there what it could not keep
                self.inner.get_file(name, dest)
            return
        try:
            self._local.get_file(name, dest)  # a hard link where it can: no copy
        except BlobNotFound:  # evicted in between
            self.inner.get_file(name, dest)

    def stat(self, name: str) -> BlobInfo:
        info = self.inner.stat(name)
        if _cached(name):
            self._sizes[name] = info.size  # (get of a range asks no more)
        return info

    def exists(self, name: str) -> bool:
        # A stat, whose size get() then knows: a restore from S3 finds each object of its
        # images (ObjectStore.find), then reads it.
        try:
            self.stat(name)
        except BlobNotFound:
            return False
        return True

    def list(self, prefix: str, incomplete: bool = False) -> builtins.list[BlobInfo]:
        return self.inner.list(prefix, incomplete)

    def reader(self) -> RangeReader:
        return _CachingReader(self)

    def without_copies(self) -> Backend:
        return self.inner.without_copies()

    def held_locally(self, name: str) -> bool:
        if _cached(name) and self.max_bytes:
            try:
                if os.path.exists(self._path(name)):
                    return True
            except ValueError:
                pass
        return self.inner.held_locally(name)

    def keep_whole(self, name: str) -> int:
        if not _cached(name) or self.max_bytes == 0:
            return 0
        return self.warm(name)

    def drop_copy(self, name: str) -> bool:
        if not _cached(name) or self.max_bytes == 0:
            return False
        try:
            present = os.path.lexists(self._path(name))
        except ValueError:
            return False
        if not present:
            return False
        self._drop(name)
        return True

    def copies_read_again(self) -> builtins.list[str]:
        with self._lock:
            return sorted(self._read_again)

    def copy_room(self) -> int:
        # What eviction leaves (LOW_WATER of the cap): a larger copy would be evicted itself,
        # with every other copy, right after it was installed.
        return int(self.max_bytes * LOW_WATER)

    def keep_copy(self, name: str, path: Path) -> bool:
        if not _cached(name) or self.max_bytes == 0:
            return False
        try:
            if os.stat(path).st_size > self.copy_room():
                return False
            _copy_dir(self._path(name).parent)
        except (OSError, ValueError):
            return False
        return self._install(name, path)  # renamed, counted, evicts above the cap

    # ---- deleting and locking: the remote store's -----------------------------------------

    def delete(self, names: builtins.list[str]) -> None:
        self.inner.delete(names)
        for name in names:
            if _cached(name):
                self._drop(name)

    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> AbstractContextManager:
        return self.inner.lock(exclusive, timeout, on_wait)

    def requests_in_flight(self) -> int:
        return self.inner.requests_in_flight()

    def gc_margin(self) -> float:
        return self.inner.gc_margin()

    def now(self) -> float:
        return self.inner.now()

    def lock_holders(self) -> builtins.list[LockOwner]:
        return self.inner.lock_holders()

    # ---- the copies ------------------------------------------------------------------------

    def _fits_whole(self, size: int) -> bool:
        return size <= self.whole_below and size <= self.max_bytes

    def _use(self, name: str) -> Path | None:
        """The cached copy of name, marked as just used (its mtime: eviction's order), or None.
        An index file or object is checked against its name the first time this process
        reads it: a copy damaged on the local disk is dropped, not served."""
        path = self._path(name)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        except OSError:
            return None  # not ours to touch (never made by ckpt): not used
        if name.startswith(CHECKED_PREFIXES) and name not in self._checked:
            try:
                intact = _content_ok(name, path)
            except FileNotFoundError:
                return None
            if not intact:
                self._drop(name)
                return None
            with self._lock:
                self._checked.add(name)
        return path

    def _keep_bytes(self, name: str, data, check: bool = False) -> None:
        """Keeps a copy of a blob just written or read whole. Best effort: a cache that cannot
        be written (a full disk) never fails the command."""
        if len(data) > self.max_bytes:
            return
        path = self._path(name)
        try:
            _copy_dir(path.parent)
            tmp = _temp_name(path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            if check and not _content_ok(name, tmp):
                tmp.unlink(missing_ok=True)  # the remote copy is damaged: the store will say so
                return
            if self._install(name, tmp) and not check:
                with self._lock:
                    self._checked.add(name)  # the store's own bytes, just written
        except OSError:
            return

    def _adopt(self, name: str, source: Path) -> Path | None:
        """A temp file in the cache holding source's bytes: a hard link (same filesystem, as the
        staging of a remote store's dump under the cache directory), else a copy if small."""
        path = self._path(name)
        try:
            size = os.stat(source).st_size
            if size > self.max_bytes:
                return None
            _copy_dir(path.parent)
            tmp = _temp_name(path)
            try:
                os.link(source, tmp)
                os.chmod(tmp, FILE_MODE)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK) or size > self.whole_below:
                    return None
                shutil.copyfile(source, tmp)
                os.chmod(tmp, FILE_MODE)
            return tmp
        except OSError:
            return None

    def _fetch(self, name: str, spare: Path | None = None) -> Path | None:
        """Downloads a whole blob into the cache; its path, or None if it cannot be kept (then,
        with spare, the download is moved there rather than thrown away). BlobNotFound and
        the remote store's errors pass; a failing cache disk only means None."""
        path = self._path(name)
        tmp = _temp_name(path)
        try:
            _copy_dir(path.parent)
            try:
                self.inner.get_file(name, tmp)
            except BlobNotFound:
                raise
            except OSError:
                return None
            if os.stat(tmp).st_size <= self.max_bytes and _content_ok(name, tmp) and self._install(name, tmp):
                with self._lock:
                    self._checked.add(name)
                return path
            if spare is not None:
                try:
                    os.rename(tmp, spare)
                except OSError:
                    try:
                        shutil.copyfile(tmp, spare)
                    except OSError:
                        spare.unlink(missing_ok=True)
                        raise
            return None
        except BlobNotFound:
            raise
        except OSError:
            return None
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def _install(self, name: str, tmp: Path) -> bool:
        """Moves a complete temp file into place (a rename: a process that dies leaves a whole
        copy or none), counts it and evicts if the cap is passed. Not made durable: a copy a
        power loss tore is met by the check every read makes (an object or index file against
        its name, a pack segment by segment: see "Local cache" in docs/design.md), dropped and
        read from the store again. An fsync apiece cost a 101-process tree's restore from S3,
        which keeps 500 small objects, 0.2 s of its 3."""
        path = self._path(name)
        try:
            size = os.stat(tmp).st_size
            with self._usage_locked() as usage:
                replaced = _size_or_zero(path)
                os.rename(tmp, path)
                total = usage.add(size - replaced)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self._evict_above_cap(total)
        return True

    def _drop(self, name: str) -> None:
        """Removes the cached copy (deleted from the store, or found damaged); open readers of
        this process read the remote store from then on."""
        path = self._path(name)
        with self._lock:
            self._checked.discard(name)
            self._drops[name] = self._drops.get(name, 0) + 1
        try:
            with self._usage_locked() as usage:
                size = os.stat(path).st_size
                path.unlink()
                usage.add(-size)
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # never serve it again, counted or not (eviction recounts)

    def _drop_count(self, name: str) -> int:
        with self._lock:
            return self._drops.get(name, 0)

    def _damage_is_the_caches(self, marker: str) -> bool:
        """The store records a damaged segment (damaged/<pack>-<offset>, see "Damage and
        healing" in docs/design.md) that it may have read from the cached copy of the pack. A
        marker is seen by every host, so it must not record damage that only our copy has:
        the cached copy is dropped, and if it differs from the remote pack (its size, or the
        bytes around the offset) the marker is not written. The next read takes the remote
        pack; damage found there is recorded as usual."""
        pack, _, offset = marker[len(DAMAGED_PREFIX):].partition("-")
        if not offset.isdigit() or len(pack) < 2:
            return False
        name = f"packs/{pack[:2]}/{pack}"
        try:
            path = self._path(name)
        except ValueError:
            return False
        if not os.path.exists(path):
            return False
        try:
            differs = self._differs_from_remote(name, path, int(offset))
        except (CkptError, OSError):
            differs = False  # cannot tell: record the damage, as without a cache
        self._drop(name)
        return differs

    def _differs_from_remote(self, name: str, path: Path, offset: int) -> bool:
        try:
            remote_size = self.inner.stat(name).size
        except BlobNotFound:
            return False
        with open(path, "rb") as cached:
            if os.fstat(cached.fileno()).st_size != remote_size:
                return True
            if offset >= remote_size:
                return False
            length = min(COMPARE_WINDOW, remote_size - offset)
            return os.pread(cached.fileno(), length, offset) != self.inner.get(name, offset, length)

    # ---- the cap ---------------------------------------------------------------------------

    # Every change to the set of copies (a rename into place, an unlink) is made under the
    # lock of <root>/usage together with the change to the recorded total: eviction counts the
    # copies afresh under that lock, so a copy installed by another process while eviction
    # scanned can be neither missed nor counted twice.

    def _usage_locked(self) -> AbstractContextManager[_Usage]:
        return _Usage.locked(self.cache_root / USAGE_FILE, lambda: sum(size for _, size, _ in self._scan(sweep=False)))

    def _evict_above_cap(self, total: int) -> None:
        if total > self.max_bytes:
            self.evict()

    def usage(self) -> int:
        """What the cached copies of every store under the cache root take, as recorded."""
        with self._usage_locked() as usage:
            return usage.add(0)

    def evict(self) -> None:
        """Removes the least recently used copies (of any store under the cache root) until
        they take at most LOW_WATER of the cap, and temp files of writers that died. One
        process evicts at a time (the others go on); files vanishing meanwhile are skipped."""
        try:
            fd = os.open(self.cache_root / EVICT_LOCK, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            with self._usage_locked() as usage:
                copies = sorted(self._scan(sweep=True))
                total = sum(size for _, size, _ in copies)
                goal = int(self.max_bytes * LOW_WATER) if total > self.max_bytes else total
                for _, size, path in copies:
                    if total <= goal:
                        break
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError:
                        continue
                    total -= size
                usage.set(total)
        except OSError:
            return
        finally:
            os.close(fd)

    def _scan(self, sweep: bool) -> builtins.list[tuple[float, int, Path]]:
        """(mtime, size, path) of every cached copy under the cache root; with sweep, temp files
        older than STALE_TEMP are removed."""
        found: builtins.list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            stores = list(os.scandir(self.cache_root))
        except OSError:
            return found
        for store in stores:
            if store.is_dir(follow_symlinks=False):
                self._walk(Path(store.path) / BLOBS_DIR, found, sweep, now)
        return found

    def _walk(self, directory: Path, found: builtins.list[tuple[float, int, Path]], sweep: bool, now: float) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    self._walk(Path(entry.path), found, sweep, now)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished: evicted or installed by another process
            if entry.name.startswith("."):
                if sweep and now - st.st_mtime > STALE_TEMP:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, st.st_size, Path(entry.path)))

    # ---- warming (`ckpt cache warm`, ckpt/commands/cache_warm.py) --------------------------

    def warm(self, name: str, size: int | None = None) -> int:
        """Makes sure the cache holds a whole copy of name (an index file, object or pack),
        downloading it whole if it lacks one; returns the bytes downloaded, 0 if the copy was
        there (then marked as just used, as every read marks it: eviction takes it last). The
        download is checked before it is installed, as every download is (an index file or
        object against its name; a pack is authenticated by the encryption beneath). Safe from
        several threads. BlobNotFound and the remote store's errors pass; DamagedCheckpoint if
        the remote blob fails its check; OSError if the copy cannot be kept (the cache's disk,
        or a blob larger than the cap). size, when known (the blob's): a copy of another size
        (a pack's copy a power loss cut short: copies are not made durable) is downloaded again."""
        if not _cached(name) or self.max_bytes == 0:
            raise ValueError(f"{name} is not a blob the cache keeps")
        held = self._use(name)
        if held is not None:
            if size is None or _size_or_zero(held) == size:
                return 0
            self._drop(name)
        path = self._path(name)
        _copy_dir(path.parent)
        tmp = _temp_name(path)
        try:
            self.inner.get_file(name, tmp)
            size = os.stat(tmp).st_size
            if size > self.max_bytes:
                raise OSError(errno.EFBIG, f"{size} bytes, larger than the cache's cap", name)
            if not _content_ok(name, tmp):
                raise DamagedCheckpoint(f"{self.inner.where(name)} does not hold what its name says",
                                        hint="run `ckpt verify`")
            if not self._install(name, tmp):
                raise OSError(errno.EIO, "the copy could not be put in place", str(path))
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._checked.add(name)
        return size


class _TeeWriter(BlobWriter):
    """Writes a blob to the remote store and a copy to the cache. The copy is given up (never
    the blob) when the cache's disk fails or the blob outgrows the cap; it is moved into place
    only once the remote blob is committed."""

    def __init__(self, cache: CachingBackend, name: str, out: BlobWriter, copy: BlobWriter | None):
        self._cache, self._name, self._out, self._copy = cache, name, out, copy
        self.written = 0

    def write(self, data) -> None:
        self._out.write(data)
        self.written = self._out.written
        if self._copy is not None:
            try:
                if self.written > self._cache.max_bytes:
                    raise OSError(errno.EFBIG, "larger than the cache")
                self._copy.write(data)
            except OSError:
                self._copy.abort()
                self._copy = None

    def commit(self) -> None:
        try:
            self._out.commit()
        except BaseException:
            self._abort_copy()
            raise
        self.written = self._out.written
        if self._copy is None:
            return
        try:
            with self._cache._usage_locked() as usage:
                replaced = _size_or_zero(self._cache._path(self._name))
                self._copy.commit()  # fsync, rename, fsync the directory
                total = usage.add(self.written - replaced)
        except OSError:
            self._copy = None
            return
        self._copy = None
        self._cache._evict_above_cap(total)

    def abort(self) -> None:
        self._out.abort()
        self._abort_copy()

    def _abort_copy(self) -> None:
        if self._copy is not None:
            self._copy.abort()
            self._copy = None


def _size_or_zero(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class _Usage:
    """The recorded total of the cache's copies (<root>/usage, shared by every process), held
    under its flock; a total missing or garbled is counted afresh."""

    def __init__(self, fd: int, count: Callable[[], int]):
        self._fd, self._count = fd, count

    @classmethod
    @contextmanager
    def locked(cls, path: Path, count: Callable[[], int]) -> Iterator[_Usage]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield cls(fd, count)
        finally:
            os.close(fd)

    def add(self, delta: int) -> int:
        try:
            known = int(os.pread(self._fd, 32, 0).decode() or "x")
        except ValueError:
            return self.set(self._count())
        return self.set(max(0, known + delta)) if delta else known

    def set(self, total: int) -> int:
        data = f"{total}\n".encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        return total


class _Assembly:
    """A blob too big to download whole, put together in a sparse temp file of the cache from
    the ranges a reading session reads anyway; installed once every byte has been read."""

    def __init__(self, path: Path, size: int):
        self.path = path
        self.size = size
        self.tmp = _temp_name(path, "part")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        self.starts: list[int] = []  # disjoint, merged [start, end) ranges written
        self.ends: list[int] = []
        self.covered = 0

    def add(self, offset: int, data) -> None:
        end = offset + memoryview(data).nbytes
        pwrite_all(self.fd, data, offset)
        # Starts writing the range to disk now (and drops it from the page cache once
        # written): a pack's copy, read by nobody in this restore, does not pile up as
        # hundreds of MiB of dirty memory beside the tree being restored.
        os.posix_fadvise(self.fd, offset, end - offset, os.POSIX_FADV_DONTNEED)
        # Merge [offset, end) with the ranges it touches.
        first = bisect.bisect_left(self.ends, offset)
        last = bisect.bisect_right(self.starts, end)
        if first < last:
            offset = min(offset, self.starts[first])
            end = max(end, self.ends[last - 1])
            self.covered -= sum(e - s for s, e in zip(self.starts[first:last], self.ends[first:last], strict=True))
        self.starts[first:last] = [offset]
        self.ends[first:last] = [end]
        self.covered += end - offset

    @property
    def complete(self) -> bool:
        return self.covered >= self.size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


class _CachingReader(RangeReader):
    """A reading session (a restore, a lazy page server): each blob from its cached copy
    (the local backend's reader: mapped, sendfile) when there is one; a small blob not cached
    is downloaded whole first; a large one is read range by range from the remote store, and
    the ranges are put together into a copy that enters the cache once the session has read
    every byte of it (a restore reading a whole pack downloads it once, never twice)."""

    def __init__(self, cache: CachingBackend):
        super().__init__(cache)
        self._cache = cache
        self._remote = cache.inner.reader()
        self._local: dict[str, tuple[RangeReader, int]] = {}  # name: (its reader, drops seen)
        self._remote_only: set[str] = set()
        self._parts: dict[str, _Assembly] = {}

    def _from_cache(self, name: str) -> RangeReader | None:
        held = self._local.get(name)
        if held is not None:
            local, drops = held
            if drops == self._cache._drop_count(name):
                return local
            local.close()  # the copy was dropped (found damaged): the remote store from now on
            del self._local[name]
            self._remote_only.add(name)
            return None
        if name in self._remote_only or not _cached(name) or self._cache.max_bytes == 0:
            return None
        drops = self._cache._drop_count(name)
        if self._cache._use(name) is None:
            size = self._remote.size(name)
            if not self._cache._fits_whole(size) or self._cache._fetch(name) is None:
                return None
        local = self._cache._local.reader()
        try:
            local.size(name)  # opens it: from here on eviction cannot take it away
        except BlobNotFound:
            local.close()
            return None
        self._local[name] = (local, drops)
        part = self._parts.pop(name, None)
        if part is not None:
            part.discard()
        return local

    def size(self, name: str) -> int:
        local = self._from_cache(name)
        return local.size(name) if local is not None else self._remote.size(name)

    def read(self, name: str, offset: int, length: int) -> memoryview:
        local = self._from_cache(name)
        if local is not None:
            return local.read(name, offset, length)
        view = self._remote.read(name, offset, length)
        self._assemble(name, offset, view)
        return view

    def mapped(self, name: str) -> bool:
        local = self._from_cache(name)
        return local is not None and local.mapped(name)

    def copy_to(self, name: str, offset: int, length: int, fd: int) -> int:
        local = self._from_cache(name)
        if local is not None:
            return local.copy_to(name, offset, length, fd)
        with self._remote.read(name, offset, length) as view:
            write_all(fd, view)
            self._assemble(name, offset, view)
            return len(view)

    def read_again(self, name: str) -> bool:
        """The copy this session read (or the one in the cache) is dropped; the next read
        downloads the blob afresh (whole if small, else range by range). A range being put
        together from the remote store's bytes is kept: those did not come from a copy."""
        held = self._local.pop(name, None)
        if held is not None:
            held[0].close()
        return self._cache.drop_copy(name) or held is not None

    def read_again_intact(self, name: str) -> None:
        with self._cache._lock:
            self._cache._read_again.add(name)

    def _assemble(self, name: str, offset: int, view: memoryview) -> None:
        if name in self._remote_only or not _cached(name) or not len(view):
            return
        part = self._parts.get(name)
        try:
            if part is None:
                size = self._remote.size(name)
                if size > self._cache.max_bytes:
                    self._remote_only.add(name)
                    return
                path = self._cache._path(name)
                _copy_dir(path.parent)
                part = self._parts[name] = _Assembly(path, size)
            part.add(offset, view)
            if part.complete:
                del self._parts[name]
                part.close()
                self._cache._install(name, part.tmp)
        except OSError:
            part = self._parts.pop(name, None)
            if part is not None:
                part.discard()
            self._remote_only.add(name)

    def close(self) -> None:
        for local, _ in self._local.values():
            local.close()
        self._local.clear()
        for part in self._parts.values():
            part.discard()
        self._parts.clear()
        self._remote.close()
        super().close()
