"""The store: objects named by hash, manifests committed last, staging that is never shown.

See docs/design.md for the format and its invariants. Everything the store holds is read and
written through its backend (ckpt/store/backends/) by blob name; only what is local by nature
is a path here: the staging and restore directories CRIU works in, and CRIU's logs.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

import blake3
import zstandard

from ckpt import settings
from ckpt.errors import (CheckpointNotFound, DamagedCheckpoint, PermissionProblem, StoreBusy, StoreError, UsageError)
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import ids
from ckpt.store.backends import Backend, BlobExists, BlobNotFound, BlobStream, LocalBackend
from ckpt.store.blocks.blockstore import BlockStore, IngestStats, StreamedPages
from ckpt.store.blocks.segments import CODECS, ID_LEN as PAGE_ID_SIZE, PAGE
from ckpt.store.password import password_for
from ckpt.store.fsutil import check_safe_ancestors, check_trusted_dir, translate_os_error
from ckpt.store.staging import DumpStaging, StagingArea, discard
from ckpt.system.files import DIR_MODE, FILE_MODE, make_private_dir

FORMAT = 2
STORE_DIRS = ("checkpoints", "objects", "packs", "index", "logs", "tmp", "holders", "damaged", "schedules", "keys",
              "journal")
# The local side of a remote store (under the cache directory): what is local by nature.
LOCAL_SIDE_DIRS = ("tmp", "logs", "schedules")
# What an interrupted creation can have left (store.json comes last): a dump finishes it.
STORE_ENTRIES = (*STORE_DIRS, "lock")
# An object is kept compressed with zstd or not at all (a dump with lz4 keeps its objects as
# zstd): its codec is the suffix of its name, zstd looked for first.
OBJECT_SUFFIX = {"zstd": ".zst", "none": ""}
# Blob names (see "On-disk tree" and "Storage backends" in docs/design.md).
STORE_META = "store.json"
MANIFESTS_PREFIX = "checkpoints/"
OBJECTS_PREFIX = "objects/"
INDEX_AND_PACKS = ("packs/", "index/")
ZSTD_LEVEL = 1
CHUNK = 4 << 20
HASH_CHUNK = 64 << 20  # read at a time to hash a stored object (blake3 hashes it on every core)
SAMPLE = 1 << 20
SAMPLES = 16


@dataclass
class FileEntry:
    """One image file. kind "file": `hash` names an object holding the file. kind "pages": a
    pages-*.img kept in the block store; `hash` names the object holding its page list."""

    name: str
    size: int
    hash: str
    codec: str
    stored_size: int
    kind: str = "file"


@dataclass(frozen=True)
class Origin:
    """Who made a checkpoint (docs/design.md, "Origins"): `ckpt dump` by hand ("dump"), a
    program's ckpt.checkpoint() through a detached dumper ("api"), schedule NAME ("schedule"),
    or `ckpt run --name NAME` ("run"). The retention of a schedule or a run touches only its own."""

    kind: str
    name: str | None = None

    @classmethod
    def from_json(cls, data: object) -> Origin | None:
        """None for a manifest without one (taken before origins were recorded) or with one
        that cannot be read: either is nobody's, never forgotten by a schedule or a run."""
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            return None
        name = data.get("name")
        return cls(data["kind"], name if isinstance(name, str) else None)

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name}

    def describe(self) -> str:
        if self.kind == "dump":
            return "ckpt dump (by hand)"
        if self.kind == "api":
            return "ckpt.checkpoint() of the program"
        if self.kind == "schedule":
            return f"schedule '{self.name}'"
        if self.kind == "run":
            return f"ckpt run --name {self.name}"
        return f"{self.kind} {self.name or ''}".strip()  # a kind a newer ckpt wrote


@dataclass
class Manifest:
    id: str
    created: str
    pid: int
    command: str
    processes: list[dict]
    files: list[FileEntry]
    name: str | None = None
    # Who made it; None in checkpoints taken before it was recorded.
    origin: Origin | None = None
    host: str = ""
    # The system it was taken on: machine_id, kernel, arch (ckpt.system.procfs.host_facts);
    # empty in checkpoints taken before it was recorded.
    system: dict = field(default_factory=dict)
    criu: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    bytes_total: int = 0
    bytes_stored: int = 0
    format: int = FORMAT

    def to_json(self) -> dict:
        data = asdict(self)
        # Keep "format" and "id" first so the file reads well.
        return {"format": data.pop("format"), "id": data.pop("id"), **data}

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if int(data.get("format", 0)) > FORMAT:
            raise StoreError(f"checkpoint {data.get('id')} has format {data['format']}, newer than this ckpt "
                             f"understands ({FORMAT})", hint="upgrade ckpt")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        # Positional, not **kwargs per entry: `ckpt list` reads a thousand manifests of ~20 files.
        kwargs["files"] = [FileEntry(f["name"], f["size"], f["hash"], f["codec"], f["stored_size"],
                                     f.get("kind", "file")) for f in data["files"]]
        kwargs["origin"] = Origin.from_json(data.get("origin"))
        return cls(**kwargs)

    @property
    def created_at(self) -> datetime:
        return datetime.fromisoformat(self.created)

    @property
    def all_pids(self) -> list[int]:
        """Every PID and TID the tree needs on restore."""
        pids: set[int] = set()
        for proc in self.processes:
            pids.add(int(proc["pid"]))
            pids.update(int(t) for t in proc.get("threads", []))
        return sorted(pids)


def _worth_compressing(path: Path) -> bool:
    """Samples the file: data that does not shrink by 10% is stored as it is. Compressing it
    would cost a pass over it on every dump and every restore for nothing."""
    size = path.stat().st_size
    if size < SAMPLE:
        return True
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    with open(path, "rb") as f:
        raw = packed = 0
        for k in range(SAMPLES):
            f.seek((size - SAMPLE // SAMPLES) * k // (SAMPLES - 1))
            chunk = f.read(SAMPLE // SAMPLES)
            raw += len(chunk)
            packed += len(compressor.compress(chunk))
    return packed < 0.9 * raw


def hash_file(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


def did_you_mean(ref: str, names: Sequence[str], checkpoint_ids: Sequence[str] = ()) -> str:
    """The hint of a reference that names no checkpoint: the names, then the IDs, that look like
    it (a typo), and where to see them all."""
    close = difflib.get_close_matches(ref, names, n=3, cutoff=0.6)
    # IDs share their date and time with their neighbours: only one a character or two away.
    close += difflib.get_close_matches(ref, checkpoint_ids, n=1, cutoff=0.9)
    if not close:
        return "see 'ckpt list'"
    return f"did you mean {' or '.join(repr(c) for c in close)}? (see 'ckpt list')"


class Store:
    """A store: its blobs, through backend; root is its local directory, which holds what is
    local by nature (tmp/ for staging, logs/ for CRIU's logs) and, for the local backend, the
    blobs themselves."""

    def __init__(self, root: Path, backend: Backend | None = None, location: str | None = None):
        self.root = root
        self.backend: Backend = backend if backend is not None else LocalBackend(root)
        # How the user names the store: its directory, or its s3:// URL (root is then its
        # local side under the cache directory).
        self.location = location or str(root)
        self.logs_root = root / "logs"
        self.tmp_dir = root / "tmp"
        self._blocks: BlockStore | None = None
        self._held_locks: list[object] = []

    @property
    def blocks(self) -> BlockStore:
        if self._blocks is None:
            self._blocks = BlockStore(self.backend)
        return self._blocks

    # ---- opening -------------------------------------------------------------------------

    @property
    def remote(self) -> bool:
        return self.location.startswith("s3://")

    @classmethod
    def open(cls, location: settings.StoreLocation, create: bool = False) -> Store:
        """Opens the store at location: a directory, or an s3:// URL (see open_remote). An
        encrypted store (one with keys/) is unlocked with the password (ckpt/store/keys.py)."""
        if settings.is_remote(location):
            return cls.open_remote(str(location), create=create)
        return cls.open_local(Path(location), create=create)

    @classmethod
    def open_remote(cls, url: str, create: bool = False) -> Store:
        """A store in an S3 bucket: its blobs there, encrypted (a remote store is always
        created encrypted, by `ckpt init`), read through the local cache; its local side
        (staging, CRIU's logs, schedules) in the cache directory. create=True (a dump) does
        not create one: that needs a password, which `ckpt init` asks for."""
        from ckpt.store import keys
        from ckpt.store.backends.s3 import S3Backend

        current = settings.current()
        remote = S3Backend.from_url(url, lock_ttl=current.lock_ttl, timeout=current.s3_timeout)
        if not keys.is_encrypted(remote):
            if remote.exists(STORE_META):
                keys.check_keys_not_lost(remote)
                raise StoreError(f"the store at {url} is not encrypted; ckpt keeps remote stores encrypted only",
                                 hint="copy its checkpoints into a store made by `ckpt init` (ckpt copy)")
            raise CheckpointNotFound(f"no ckpt store at {url}",
                                     hint=f"create one with `ckpt init {url}`, or pass the right --store")
        local_side = cls.local_side(url)
        backend = cls._cached(keys.unlock(remote, password_for(url)), url)
        store = cls(local_side, backend, location=url)
        store._check_format(backend, url)
        return store

    @classmethod
    def local_dir(cls, location: settings.StoreLocation) -> Path:
        """Where the store at location keeps what is local by nature: its directory, or the
        local side of a remote store."""
        return cls.local_side(location) if isinstance(location, str) else location

    @staticmethod
    def local_side(url: str) -> Path:
        """The local directory of the remote store at url: <cache>/stores/<tag>/{tmp,logs,schedules}."""
        base = settings.current().cache
        from ckpt.store.backends.cache import store_cache_dir

        root = store_cache_dir(base / "stores", url)  # the cache's blobs/ go beside tmp/ and logs/
        try:
            check_safe_ancestors(base)
            # The cache root may be a directory the user chose (CKPT_CACHE): made 0700 when
            # missing, only checked when it exists (never chmod'ed: a 0777 one is refused, as a
            # store others can write is). What is below it is ckpt's own, and made 0700.
            if not os.path.isdir(base):
                make_private_dir(base)
            check_trusted_dir(base, "the cache directory", follow=True, elsewhere="choose another CKPT_CACHE")
            for directory in (base / "stores", root, *(root / sub for sub in LOCAL_SIDE_DIRS)):
                make_private_dir(directory)
                check_trusted_dir(directory, "the cache directory")
            marker = root / "url"
            if not marker.exists():
                marker.write_text(url + "\n")  # for whoever looks into the cache
        except OSError as exc:
            raise translate_os_error(exc, f"preparing the cache directory {root}") from exc
        return root

    @staticmethod
    def _cached(remote: Backend, url: str) -> Backend:
        """The remote (decrypted) store behind the local cache of its immutable blobs
        (ckpt/store/backends/cache.py), which shares the local side's directory: staged files
        are hard-linked into it. CKPT_CACHE_SIZE=0: no cache."""
        from ckpt.store.backends.cache import CachingBackend, cache_bytes

        current = settings.current()
        cap = cache_bytes(current.cache_size, current.cache)
        if cap == 0:
            return remote
        return CachingBackend(remote, current.cache / "stores", url, cap)

    def copies_read_again(self) -> list[str]:
        """The blobs whose copy in the local cache failed its check during this command and
        were read again from the store itself (which was intact)."""
        return self.backend.copies_read_again()

    def uncached(self) -> Store:
        """The same store read past the local cache: what `verify` checks is the remote copy."""
        from ckpt.store.backends.cache import CachingBackend

        if not isinstance(self.backend, CachingBackend):
            return self
        return Store(self.root, self.backend.inner, location=self.location)

    @property
    def encryption(self):
        """The store's EncryptedBackend (behind the cache, for a remote store), or None."""
        from ckpt.store.backends.encrypted import EncryptedBackend

        backend: object = self.backend
        while backend is not None and not isinstance(backend, EncryptedBackend):
            backend = getattr(backend, "inner", None)
        return backend

    @staticmethod
    def _check_format(backend: Backend, where: str) -> None:
        try:
            info = json.loads(backend.get(STORE_META))
        except BlobNotFound:
            raise CheckpointNotFound(f"no ckpt store at {where} (no store.json there)",
                                     hint="pass the right --store") from None
        except ValueError as exc:
            raise StoreError(f"store.json of {where} is not valid JSON: {exc}") from exc
        if not isinstance(info, dict):
            raise StoreError(f"store.json of {where} is not a ckpt store description", hint="pass the right --store")
        if int(info.get("format", 0)) > FORMAT:
            raise StoreError(f"the store at {where} has format {info['format']}, newer than this ckpt "
                             f"understands ({FORMAT})", hint="upgrade ckpt")

    @classmethod
    def open_local(cls, root: Path, create: bool = False, password: bytes | None = None) -> Store:  # noqa: C901
        """Opens the store at root. Only create=True (a dump) makes one, and only where nothing or
        an empty directory is; it never changes the mode of a directory it did not make. With
        a password (ckpt init --encrypt), the store it creates is encrypted.

        A store that another user owns or others may write (the root, a directory in it, or a
        directory above it that someone else could rename it out of) is refused: whoever can
        write a store can plant a checkpoint that its owner restores, and so run code as root
        for root's store."""
        if not str(root).strip():
            raise UsageError("the store path is empty", hint="pass --store DIR, or unset an empty CKPT_STORE")
        root = Path(os.path.abspath(root))
        try:
            check_safe_ancestors(root)
            if not os.path.lexists(root):
                if not create:
                    raise CheckpointNotFound(f"no ckpt store at {root}, so no checkpoints",
                                             hint="dump a process first, or pass the right --store")
                os.makedirs(root.parent, mode=DIR_MODE, exist_ok=True)
                try:
                    os.mkdir(root, DIR_MODE)
                except FileExistsError:
                    pass  # another dump made it meanwhile: checked below like any directory
            real = root.resolve()
            if real != root:
                check_safe_ancestors(real)  # an administrator's link to the store's real place
            meta = real / STORE_META
            backend: Backend = LocalBackend(real)
            if not create and not os.path.lexists(meta):
                raise CheckpointNotFound(f"no ckpt store at {root} (no store.json there)",
                                         hint="pass the right --store; `ckpt init DIR` or a first `ckpt dump` "
                                              "creates a store")
            check_trusted_dir(real, "the store")
            if not os.path.lexists(meta):
                foreign = sorted(n for n in os.listdir(real)
                                 if n not in STORE_ENTRIES and not n.startswith(".store.json."))
                if foreign:
                    raise UsageError(f"{root} is not a ckpt store and is not empty (it holds {foreign[0]}"
                                     f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''})",
                                     hint="choose a new or empty directory with --store")
                for sub in STORE_DIRS:
                    make_private_dir(real / sub)
                if password is not None or os.listdir(real / "keys"):
                    from ckpt.store import keys

                    if password is None:
                        raise UsageError(f"an interrupted `ckpt init --encrypt` left keys in {root}",
                                         hint=f"remove {root} and run `ckpt init --encrypt` again")
                    backend, _ = keys.initialize(backend, password)
                    password = b""  # unlocked: not again below
                # Written last: a directory without it, holding only these, is a store whose
                # creation was interrupted, and the next dump finishes it.
                backend.put_if_absent(STORE_META, json.dumps(
                    {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat()}).encode())
            for sub in STORE_DIRS:
                if os.path.lexists(real / sub):
                    check_trusted_dir(real / sub, "the store directory")
            if password is None and os.path.isdir(real / "keys") and os.listdir(real / "keys"):
                from ckpt.store import keys

                backend = keys.unlock(backend, password_for(str(root)))
            cls._check_format(backend, str(root))
        except FileExistsError:
            return cls.open_local(root, create=False)  # another dump finished creating it first
        except OSError as exc:
            raise translate_os_error(exc, f"opening the store at {root}") from exc
        if create and not os.access(real, os.W_OK):
            raise PermissionProblem(f"the store at {root} is not writable",
                                    hint="run as its owner (root) or choose another store with --store")
        return cls(real, backend)

    @contextmanager
    def lock(self, exclusive: bool = False, on_wait=None, timeout: float | None = None) -> Iterator[object]:
        """The store's lock for a `with` block: shared by commands that add or read checkpoints,
        exclusive by those that delete. on_wait(holders) hears once if it has to wait."""
        timeout = settings.current().lock_timeout if timeout is None else timeout
        with self.backend.lock(exclusive, timeout, on_wait) as held:
            self._held_locks.append(held)
            try:
                yield held
            finally:
                self._held_locks.remove(held)

    def check_lock(self, what: str) -> None:
        """Before a commit point: the locks this store holds are still held. A lock object can
        be lost (not refreshed in time, the server unreachable for minutes, taken for stale by
        another host); a flock cannot."""
        for held in self._held_locks:
            still_held = getattr(held, "still_held", None)
            if still_held is not None and not still_held():
                raise StoreBusy(f"lost the lock of the store at {self.location} before {what}; nothing was "
                                "committed", hint="run the command again (check the server's reachability)")

    # ---- manifests ----------------------------------------------------------------------

    @staticmethod
    def manifest_name(checkpoint_id: str) -> str:
        return f"{MANIFESTS_PREFIX}{ids.check_id(checkpoint_id)}.json"

    def checkpoint_ids(self) -> list[str]:
        found = (info.name[len(MANIFESTS_PREFIX):-5] for info in self.backend.list(MANIFESTS_PREFIX)
                 if info.name.endswith(".json"))
        return sorted(i for i in found if ids.is_id(i))

    def load(self, checkpoint_id: str) -> Manifest:
        name = self.manifest_name(checkpoint_id)
        path = self.backend.where(name)
        try:
            data = json.loads(self.backend.get(name))
        except BlobNotFound:
            raise CheckpointNotFound(f"no checkpoint with ID {checkpoint_id}", hint="see 'ckpt list'") from None
        except ValueError as exc:
            raise DamagedCheckpoint(f"checkpoint {checkpoint_id}: manifest {path} is not valid JSON ({exc})") from exc
        try:
            return Manifest.from_json(data)
        except (KeyError, TypeError) as exc:
            raise DamagedCheckpoint(f"checkpoint {checkpoint_id}: manifest {path} lacks {exc}") from exc

    def manifests(self, on_damaged=None) -> list[Manifest]:
        """Every readable manifest, oldest first. on_damaged(id, error) hears of the others."""
        result = []
        for checkpoint_id in self.checkpoint_ids():
            try:
                result.append(self.load(checkpoint_id))
            except (DamagedCheckpoint, StoreError, CheckpointNotFound) as exc:
                if on_damaged:
                    on_damaged(checkpoint_id, exc)
        return result

    def resolve(self, ref: str) -> str:
        """An ID, a unique ID prefix, a name (newest with it) or 'latest' -> checkpoint ID."""
        kind = ids.classify_reference(ref)
        all_ids = self.checkpoint_ids()
        if kind == "id":
            if ref not in all_ids:
                raise CheckpointNotFound(f"no checkpoint with ID {ref}", hint=did_you_mean(ref, [], all_ids))
            return ref
        if kind == "latest":
            if not all_ids:
                raise CheckpointNotFound("the store has no checkpoints yet", hint="create one with 'ckpt dump PID'")
            return all_ids[-1]
        if kind == "prefix":
            matches = [i for i in all_ids if i.startswith(ref)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise CheckpointNotFound(f"'{ref}' matches {len(matches)} checkpoints",
                                         hint="give more of the ID")
        manifests = self.manifests()
        named = [m.id for m in manifests if m.name == ref]
        if not named:
            names = list(dict.fromkeys(m.name for m in manifests if m.name))
            raise CheckpointNotFound(f"no checkpoint with ID or name '{ref}'", hint=did_you_mean(ref, names, all_ids))
        return named[-1]

    def commit(self, manifest: Manifest) -> None:
        """The commit point: the manifest appears atomically, after all its objects are durable."""
        data = json.dumps(manifest.to_json(), indent=2).encode() + b"\n"
        self.check_lock(f"committing checkpoint {manifest.id}")
        try:
            # Never replaces: two dumps in the same millisecond drawing the same 24 random bits
            # must not lose a checkpoint (their staging directories collide first, in practice).
            self.backend.put_if_absent(self.manifest_name(manifest.id), data)
        except BlobExists:
            raise StoreError(f"a checkpoint with ID {manifest.id} already exists (two dumps drew the same ID)",
                             hint="dump again: the new dump gets another ID") from None
        except OSError as exc:
            raise translate_os_error(exc, "writing the manifest") from exc

    # ---- staging and objects ---------------------------------------------------------------

    def staging_area(self) -> StagingArea:
        """Where images are written before they enter the store, or before CRIU restores them.

        <store>/tmp by default (CKPT_STAGING=disk or auto): CRIU writes and reads a disk
        filesystem's page cache (large folios) faster than tmpfs (4 KiB pages). Measured here,
        2 GiB target, medians of 4: frozen 1440 ms staging on disk against 1828 ms in
        /dev/shm (raw `criu dump` to disk: 1381 ms), whole dump 3.8 s against 4.7 s; restores
        5.9 s against 7.2 s. Staging files live a few seconds and are deleted before the kernel
        writes most of them back; page cache, unlike tmpfs, can also be written back under
        memory pressure. CKPT_STAGING=ram stages in /dev/shm instead (see ckpt/store/staging.py
        for how ckpt stays safe in a directory every user can write).
        """
        if settings.current().staging == "ram":
            return StagingArea.in_ram(self.root)
        return StagingArea(self.tmp_dir)

    def begin_dump(self, checkpoint_id: str) -> DumpStaging:
        try:
            area = self.staging_area()
            if area.base == self.tmp_dir:
                make_private_dir(area.base)
            return area.begin_dump(ids.check_id(checkpoint_id))
        except OSError as exc:
            raise translate_os_error(exc, "creating the staging directory") from exc

    def logs_dir(self, checkpoint_id: str) -> Path:
        path = self.logs_root / ids.check_id(checkpoint_id)
        make_private_dir(path)
        return path

    @staticmethod
    def object_name(digest: str, codec: str) -> str:
        return f"{OBJECTS_PREFIX}{digest[:2]}/{digest}{OBJECT_SUFFIX[codec]}"

    def find_object(self, digest: str) -> tuple[str, str] | None:
        """(blob name, codec) of the object holding that content, or None."""
        for codec in OBJECT_SUFFIX:
            name = self.object_name(digest, codec)
            if self.backend.exists(name):
                return name, codec
        return None

    def ingest(self, staging: DumpStaging, codec: str, reporter: Reporter = NullReporter(),
               complete_page_lists=None, earlier: dict | None = None) -> tuple[list[FileEntry], int, IngestStats]:
        """Moves every image file of the staging area into the store, durably.

        pages-*.img go to the block store (only pages the store lacks are written); every other
        file becomes an object. complete_page_lists, when given, is called with the page lists
        before anything else is stored: it may lengthen them with pages the store already
        holds (dirty-page tracking) and returns how many pages it added. Returns the file
        entries, the bytes this added to the store and the block figures. earlier, when given,
        comes from a checkpoint of the same target (ckpt/dump/unchanged.py): it spares looking up
        the pages that have not changed since (see BlockStore.ingest).
        """
        if codec not in CODECS:
            raise StoreError(f"unknown compression '{codec}'", hint=f"use one of: {', '.join(CODECS)}")
        object_codec = "none" if codec == "none" else "zstd"
        files = staging.image_files()
        pages_files = [p for p in files if p.name.startswith("pages-") and p.name.endswith(".img")]
        other_files = [p for p in files if p not in pages_files]
        # Pages images CRIU streamed to ckpt instead of writing them (ckpt/dump/pagestream.py).
        page_images: list[Path | StreamedPages] = [*pages_files, *staging.streamed.values()]
        entries: list[FileEntry] = []
        added = 0
        superseded: list[str] = []  # damaged copies under another codec's name, deleted last
        # Writing the small images back to disk runs in a thread while the pages are hashed.
        fds = [os.open(p, os.O_RDONLY) for p in other_files]
        with ThreadPoolExecutor(max_workers=1) as pool:
            flushed = pool.submit(lambda: list(map(os.fsync, fds)))
            try:
                sizes = {p.name: p.size if isinstance(p, StreamedPages) else p.stat().st_size for p in page_images}
                reporter.step(f"storing {sum(sizes.values()) // 4096} pages")
                page_lists, block_stats, _ = self.blocks.ingest(
                    page_images, lambda image: codec if codec == "none" or _worth_compressing(image) else "none",
                    earlier, lambda done, total: reporter.progress(done, total, "storing pages"))
                added += block_stats.bytes_new
                if complete_page_lists is not None:
                    from_parent = complete_page_lists(page_lists)
                    block_stats.pages_from_parent = from_parent
                    block_stats.pages += from_parent
                    block_stats.bytes_dedup += from_parent * PAGE
                    # The pagemaps were rewritten: take their sizes again.
                    sizes = {name: len(page_list) // PAGE_ID_SIZE * PAGE for name, page_list in page_lists.items()}
                for name in sorted(page_lists):  # completion may name a pages image CRIU left empty
                    digest, stored, new = self._put_bytes(page_lists[name], superseded)
                    added += new
                    entries.append(FileEntry(name, sizes[name], digest, "pages", stored, kind="pages"))
                for path in other_files:
                    size = path.stat().st_size
                    digest = hash_file(path)
                    existing = self.find_object(digest)
                    if existing and self._object_intact(*existing, digest):
                        stored_name, stored_codec = existing
                        entries.append(FileEntry(path.name, size, digest, stored_codec,
                                                 self.backend.stat(stored_name).size))
                        continue
                    # New, or damaged: a damaged object is replaced, which heals every older
                    # checkpoint naming it (see "Damage and healing" in docs/design.md).
                    stored_codec, stored_size = self._store_object(path, digest, object_codec)
                    if existing and existing[1] != stored_codec:
                        superseded.append(existing[0])
                    added += stored_size
                    entries.append(FileEntry(path.name, size, digest, stored_codec, stored_size))
                flushed.result()
                self.backend.delete(superseded)  # only now that the fresh copies are durable
            except OSError as exc:
                raise translate_os_error(exc, "storing the images") from exc
            finally:
                flushed.exception()  # never leave the thread running past the descriptors
                for fd in fds:
                    os.close(fd)
        entries.sort(key=lambda e: e.name)
        return entries, added, block_stats

    def newest_of(self, pid: int, limit: int = 64) -> Manifest | None:
        """The newest checkpoint of a PID among the `limit` newest of the store (a dump uses
        it to skip looking up unchanged pages; scheduled dumps of one target follow each
        other closely), or None."""
        for checkpoint_id in reversed(self.checkpoint_ids()[-limit:]):
            try:
                manifest = self.load(checkpoint_id)
            except (DamagedCheckpoint, StoreError, CheckpointNotFound):
                continue
            if manifest.pid == pid:
                return manifest
        return None

    def _put_bytes(self, data: bytes, superseded: list[str]) -> tuple[str, int, int]:
        """Stores bytes as an object (codec none); returns (hash, stored size, bytes added).
        A damaged existing copy is replaced (one under another codec's name goes to superseded)."""
        digest = blake3.blake3(data).hexdigest()
        existing = self.find_object(digest)
        if existing and self._object_intact(*existing, digest):
            return digest, len(data), 0
        name = self.object_name(digest, "none")
        self.backend.put(name, data)
        if existing and existing[0] != name:
            superseded.append(existing[0])
        return digest, len(data), len(data)

    def _object_intact(self, name: str, codec: str, digest: str) -> bool:
        """Whether a stored object still holds the content its name promises."""
        try:
            return self._read_object_into(FileEntry(name.rpartition("/")[2], 0, digest, codec, 0), None) == digest
        except (DamagedCheckpoint, OSError):
            return False

    def load_page_list(self, entry: FileEntry) -> bytes:
        found = self.find_object(entry.hash)
        try:
            data = self.backend.get(found[0]) if found is not None else None
        except BlobNotFound:
            data = None
        if data is None:
            raise DamagedCheckpoint(f"image {entry.name}: its page list is missing from the store")
        if blake3.blake3(data).hexdigest() != entry.hash:
            raise DamagedCheckpoint(f"image {entry.name}: its page list is damaged")
        return data

    def _store_object(self, source: Path, digest: str, codec: str) -> tuple[str, int]:
        """Stores one file under its hash; returns the codec used and the stored size."""
        if codec == "zstd" and not _worth_compressing(source):
            codec = "none"
        name = self.object_name(digest, codec)
        if codec == "none":
            return codec, self.backend.put_file(name, source)  # locally a rename: no copy
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1, write_content_size=True)
        with open(source, "rb") as src, self.backend.writer(name) as dst:
            compressor.copy_stream(src, dst, size=source.stat().st_size,  # type: ignore[arg-type]  # only write()
                                   read_size=CHUNK, write_size=CHUNK)
            dst.commit()
        source.unlink()
        return codec, dst.written

    def _read_object_into(self, entry: FileEntry, dest: Path | None) -> str:
        """Streams an object (decompressed) into dest, or nowhere; returns the content's hash."""
        found = self.find_object(entry.hash)
        missing = DamagedCheckpoint(f"image {entry.name}: object {entry.hash[:16]}… is missing from the store")
        if found is None:
            raise missing
        name, codec = found
        try:
            if codec == "none":
                if dest is not None:
                    self.backend.get_file(name, dest)  # locally a hard link: no copy
                    return hash_file(dest)
                return self._hash_blob(name)
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            out = open(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") if dest else None
            try:
                reader = zstandard.ZstdDecompressor().stream_reader(BlobStream(self.backend, name, CHUNK),  # type: ignore[arg-type]
                                                                   read_size=CHUNK)
                while chunk := reader.read(CHUNK):
                    hasher.update(chunk)
                    if out:
                        out.write(chunk)
            except zstandard.ZstdError as exc:
                raise DamagedCheckpoint(f"image {entry.name}: object {self.backend.where(name)} cannot be "
                                        f"decompressed ({exc})") from exc
            finally:
                if out:
                    out.close()
        except BlobNotFound:
            raise missing from None
        return hasher.hexdigest()

    def _hash_blob(self, name: str) -> str:
        """The BLAKE3 of a stored blob, read in ranges (locally, views of a mapping: no copy)."""
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with self.backend.reader() as reader:
            size = reader.size(name)
            for offset in range(0, size, HASH_CHUNK):
                with reader.read(name, offset, HASH_CHUNK) as view:
                    hasher.update(view)
        return hasher.hexdigest()

    def check_entry(self, entry: FileEntry, dest: Path | None = None, thorough: bool = False,
                    holes: Sequence[tuple[int, int]] = ()) -> list[int] | None:
        """Checks one image (writing it to dest if given). For a pages image, returns the
        location of each of its pages; holes are page ranges checked but not written."""
        if entry.kind == "pages":
            return self.blocks.write_image(entry.name, self.load_page_list(entry), dest, check_ids=thorough,
                                           holes=holes, check_holes=not self.remote)
        digest = self._read_object_into(entry, dest)
        if digest != entry.hash:
            raise DamagedCheckpoint(f"image {entry.name} is damaged: its content hash is {digest[:16]}…, "
                                    f"the manifest says {entry.hash[:16]}…")
        return None

    def materialize_parent(self, manifest: Manifest, dest: Path) -> None:
        """Lays out a checkpoint as the parent images of a dirty-tracking dump: CRIU reads only
        the parent's inventory and pagemaps, so its pages images are left as sparse files of
        their size (no page is read or written)."""
        if self.blocks.damage_markers():
            # CRIU would take pages from the parent without reading them: none may be damaged.
            index = self.blocks.index()
            for entry in manifest.files:
                if entry.kind == "pages":
                    page_list = self.load_page_list(entry)
                    self.blocks.check_suspect(page_list)
                    if not index.held(page_list).all():
                        raise DamagedCheckpoint(f"checkpoint {manifest.id}: image {entry.name} holds pages "
                                                "recorded as damaged")
        make_private_dir(dest)
        for entry in manifest.files:
            if entry.kind == "pages":
                with open(os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
                    f.truncate(entry.size)
            elif entry.name == "inventory.img" or entry.name.startswith("pagemap-"):
                self.check_entry(entry, dest / entry.name)

    def materialize(self, manifest: Manifest, reporter: Reporter = NullReporter(), skip_pages: bool = False,
                    before_pages: Callable[[Path], None] | None = None) -> Path:
        """Writes the checkpoint's images into a fresh restore-* directory, verifying each.

        skip_pages leaves out the page data (for inspection, which needs only the metadata).
        before_pages(directory) is called once every other image is written, before the pages
        images (the bulk): a restore checks the host there, and what it raises ends the layout."""
        def no_holes(directory: Path) -> dict[str, list[tuple[int, int]]]:
            if before_pages is not None:
                before_pages(directory)
            return {}

        return self._materialize(manifest, reporter, skip_pages, no_holes)[0]

    def materialize_lazily(self, manifest: Manifest, holes_for: Callable[[Path], dict[str, list[tuple[int, int]]]],
                           reporter: Reporter = NullReporter()) -> tuple[Path, dict[str, list[int]]]:
        """Like materialize, for a lazy restore: holes_for(directory), called once every image
        but the pages images is written, names per pages image the page ranges a page server
        is to serve; they are verified but left out. Returns the directory and, per pages
        image, the location of each page (what the page server reads)."""
        return self._materialize(manifest, reporter, False, holes_for)

    def _materialize(self, manifest: Manifest, reporter: Reporter, skip_pages: bool,
                     holes_for: Callable[[Path], dict[str, list[tuple[int, int]]]] | None
                     ) -> tuple[Path, dict[str, list[int]]]:
        area = self.staging_area()
        if area.base == self.tmp_dir:
            make_private_dir(area.base)
        dest = area.new_dir("restore")
        total = manifest.bytes_total or 1
        done = 0
        locations: dict[str, list[int]] = {}
        holes: dict[str, list[tuple[int, int]]] | None = None
        try:
            # Pages images last: which of their pages a lazy restore leaves out depends on the pagemaps.
            for entry in sorted(manifest.files, key=lambda e: e.kind == "pages"):
                if entry.kind == "pages":
                    if skip_pages:
                        continue
                    if holes is None:
                        holes = holes_for(dest) if holes_for is not None else {}
                    found = self.check_entry(entry, dest / entry.name, holes=holes.get(entry.name, ()))
                    if holes.get(entry.name) and found is not None:
                        locations[entry.name] = found
                else:
                    self.check_entry(entry, dest / entry.name)
                done += entry.size
                reporter.progress(done, total, "verifying images")
        except BaseException:
            discard(dest)
            raise
        return dest, locations

    def verify(self, manifest: Manifest, reporter: Reporter = NullReporter()) -> list[str]:
        """Recomputes every file's hash. Returns the problems found (empty: the checkpoint is intact)."""
        problems = []
        total = manifest.bytes_total or 1
        done = 0
        for entry in manifest.files:
            try:
                self.check_entry(entry, thorough=True)
            except DamagedCheckpoint as exc:
                problems.append(exc.message)
            done += entry.size
            reporter.progress(done, total, f"verifying {manifest.id}")
        return problems

    # ---- removal and clean-up (callers hold the exclusive lock) -----------------------------------

    def remove(self, checkpoint_ids: list[str], on_removed: Callable[[str], None] | None = None) -> None:
        """Removes the checkpoints' manifests (each durably, one after the other), then their
        logs. Their objects stay until a prune (ckpt/store/prune.py)."""
        for checkpoint_id in checkpoint_ids:
            self.backend.delete([self.manifest_name(checkpoint_id)])
            shutil.rmtree(self.logs_root / ids.check_id(checkpoint_id), ignore_errors=True)
            if on_removed is not None:
                on_removed(checkpoint_id)

    def _staging_areas(self) -> list[StagingArea]:
        """The store's tmp/ and its names in /dev/shm (swept whatever CKPT_STAGING says now:
        a dump staged in RAM earlier may have left something there)."""
        areas = [StagingArea(self.tmp_dir)]
        try:
            areas.append(StagingArea.in_ram(self.root))
        except StoreError:
            pass  # no safe /dev/shm here: nothing of ours can be in it
        return areas

    def remove_leftovers(self) -> int:
        """Removes the staging directories of dumps that are gone (never a live dump's)."""
        return sum(area.sweep(restores=False) for area in self._staging_areas())

    def remove_restore_leftovers(self) -> None:
        """Removes restore directories too: only under the exclusive lock (restores hold the shared one)."""
        for area in self._staging_areas():
            area.sweep(restores=True)

    def iter_object_bytes(self) -> Iterator[int]:
        """The size of each object, pack and index file."""
        for prefix in (OBJECTS_PREFIX, *INDEX_AND_PACKS):
            for info in self.backend.list(prefix):
                yield info.size

    def total_bytes(self) -> int:
        return sum(self.iter_object_bytes())
