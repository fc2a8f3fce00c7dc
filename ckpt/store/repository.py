"""The store: objects named by hash, manifests committed last, staging that is never shown.

See docs/design.md for the format and its invariants. Everything the store holds is read and
written through its backend (ckpt/store/backends/) by blob name; only what is local by nature
is a path here: the staging and restore directories CRIU works in, and CRIU's logs.

Store is the facade: manifests, names, the commit point, locks, staging areas and leftovers
are its own. The rest is reached through it, not by it: opening a location is
ckpt/store/opening.py (the backend stack: find_encryption, past_the_cache, local_dir), objects
store.objects (ckpt/store/objects.py), a dump's images into the store ingest.ingest(store.objects,
...), laying images out materialize.materialize(store.objects, store.staging_area(), ...),
checking them verify.verify(store.objects, ...), passwords keys.Keyring.
"""

from __future__ import annotations

import difflib
import json
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ckpt.errors import CheckpointNotFound, DamagedCheckpoint, StoreBusy, StoreError, UsageError
from ckpt.settings import Settings, StoreLocation, is_remote
from ckpt.store import ids, opening
from ckpt.store.backends import Backend, BlobExists, LocalBackend
from ckpt.store.blocks.blockstore import BlockStore
from ckpt.store.fsutil import translate_os_error
from ckpt.store.migrations import Decisions
from ckpt.store.groups import GroupManifest, Groups, Visibility, group_of, listed_ids, read_blob, read_json
from ckpt.store.manifest import FORMAT, FileEntry, Manifest, Origin
from ckpt.store.objects import OBJECTS_PREFIX, Objects, hash_file
from ckpt.store.opening import STORE_META, OpenedStore
from ckpt.store.password import PasswordSource
from ckpt.store.staging import DumpStaging, StagingArea
from ckpt.system.files import make_private_dir

# What other modules import from here (the facade's vocabulary).
__all__ = ["FORMAT", "MANIFESTS_PREFIX", "OBJECTS_PREFIX", "STORE_META", "FileEntry", "Manifest", "Origin", "Store",
           "did_you_mean", "hash_file"]

MANIFESTS_PREFIX = "checkpoints/"
MANIFESTS_KEPT = 8  # manifests a Store keeps read while it holds a lock (Store.load)


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
    blobs themselves. settings: the lock timeout and the staging mode (None: the defaults, for
    a store built by hand, as tests do; Store.open passes the caller's)."""

    def __init__(self, root: Path, backend: Backend | None = None, location: str | None = None, *,
                 settings: Settings | None = None):
        self.root = root
        self.backend: Backend = backend if backend is not None else LocalBackend(root)
        # How the user names the store: its directory, or its s3:// URL (root is then its
        # local side under the cache directory).
        self.location = location or str(root)
        self.logs_root = root / "logs"
        self.tmp_dir = root / "tmp"
        self.settings = settings if settings is not None else Settings()
        self._blocks: BlockStore | None = None
        self._blocks_ahead: threading.Thread | None = None  # read_index_ahead's
        self._objects: Objects | None = None
        self._held_locks: list[object] = []
        # The last MANIFESTS_KEPT manifests read while a lock is held, by ID: the lock keeps them
        # from being forgotten, and a restore from S3 read its manifest twice (resolving its ID,
        # then loading it).
        self._manifest_blobs: dict[str, bytes] = {}
        self._manifests_lock = threading.Lock()

    @property
    def blocks(self) -> BlockStore:
        ahead = self._blocks_ahead
        if ahead is not None and ahead is not threading.current_thread():
            # Waited for by whoever asks next (no thread of it outlives the lay-out, before a
            # page server is forked): it reads the key and starts the index's thread, no more.
            ahead.join()
            self._blocks_ahead = None
        if self._blocks is None:
            self._blocks = BlockStore(self.backend)
        return self._blocks

    def read_index_ahead(self) -> None:
        """The block store's key, then its index (BlockStore.preload_index, whose thread
        index() waits for), read from now on: from S3, while the manifest is read (the key and
        the index files were requests after it, one round trip after another)."""
        def read() -> None:
            try:
                self.blocks.preload_index()
            except Exception:  # noqa: BLE001 - read again, and its error told, where it is needed
                pass

        if self._blocks is None and self._blocks_ahead is None:
            self._blocks_ahead = threading.Thread(target=read, name="ckpt-blocks-ahead", daemon=True)
            self._blocks_ahead.start()

    @property
    def groups(self) -> Groups:
        """The store's group manifests (ckpt/store/groups.py)."""
        return Groups(self.backend)

    @property
    def migrations(self) -> Decisions:
        """The decisions of migrations in progress (ckpt/store/migrations.py)."""
        return Decisions(self.backend)

    @property
    def objects(self) -> Objects:
        """The store's objects (ckpt/store/objects.py)."""
        if self._objects is None:
            self._objects = Objects(self.backend, self.blocks, self.remote)
        return self._objects

    # ---- opening (ckpt/store/opening.py) ------------------------------------------------------

    @property
    def remote(self) -> bool:
        return self.location.startswith("s3://")

    @classmethod
    def open(cls, location: StoreLocation, create: bool = False, *, settings: Settings,
             passwords: PasswordSource | None = None) -> Store:
        """Opens the store at location: a directory, or an s3:// URL (see opening.open_local and
        opening.open_remote). An encrypted store (one with keys/) is unlocked with a password from
        passwords (by default the settings' own: CKPT_PASSWORD or CKPT_PASSWORD_FILE, no prompt)."""
        passwords = PasswordSource.passed_or_settings(passwords, settings)
        if not is_remote(location):
            return cls.open_local(Path(location), create, settings=settings, passwords=passwords)
        return cls.from_opened(opening.open_remote(str(location), settings, passwords), settings)

    @classmethod
    def open_local(cls, root: Path, create: bool = False, password: bytes | None = None, *,
                   settings: Settings, passwords: PasswordSource | None = None) -> Store:
        """Opens (create=True: makes) the local store at root; see opening.open_local."""
        source = PasswordSource.passed_or_settings(passwords, settings)
        return cls.from_opened(opening.open_local(root, source, create, password), settings)

    @classmethod
    def from_opened(cls, opened: OpenedStore, settings: Settings) -> Store:
        return cls(opened.root, opened.backend, location=opened.location, settings=settings)

    def uncached(self) -> Store:
        """The same store read past the local cache: what `verify` checks is the remote copy."""
        inner = opening.past_the_cache(self.backend)
        if inner is self.backend:
            return self
        return Store(self.root, inner, location=self.location, settings=self.settings)

    # ---- locks ------------------------------------------------------------------------------

    @contextmanager
    def lock(self, exclusive: bool = False, on_wait=None, timeout: float | None = None) -> Iterator[object]:
        """The store's lock for a `with` block: shared by commands that add or read checkpoints,
        exclusive by those that delete. on_wait(holders) hears once if it has to wait."""
        timeout = self.settings.lock_timeout if timeout is None else timeout
        with self.backend.lock(exclusive, timeout, on_wait) as held:
            self._held_locks.append(held)
            try:
                yield held
            finally:
                self._held_locks.remove(held)
                if not self._held_locks:
                    with self._manifests_lock:
                        self._manifest_blobs.clear()

    def check_lock(self, what: str) -> None:
        """Before a commit point: the locks this store holds are still held. A lock object can
        be lost (not refreshed in time, the server unreachable for minutes, taken for stale by
        another host); a flock cannot."""
        for held in self._held_locks:
            still_held = getattr(held, "still_held", None)
            if still_held is not None and not still_held():
                raise StoreBusy(f"lost the lock of the store at {self.location} before {what}; nothing was "
                                "committed", hint="run the command again (check the server's reachability)")

    # ---- manifests and names ----------------------------------------------------------------------

    @staticmethod
    def manifest_name(checkpoint_id: str) -> str:
        return f"{MANIFESTS_PREFIX}{ids.check_id(checkpoint_id)}.json"

    def checkpoint_ids(self) -> list[str]:
        """Every manifest's ID, oldest first: one listing, nothing read, so unfinished members
        too (what a reader sees: manifests(), resolve())."""
        return listed_ids(self.backend, MANIFESTS_PREFIX)

    def load(self, checkpoint_id: str) -> Manifest:
        name = self.manifest_name(checkpoint_id)
        path = self.backend.where(name)
        blob = self._manifest_blobs.get(checkpoint_id)
        if blob is None:
            blob = read_blob(self.backend, name, f"checkpoint with ID {checkpoint_id}")
            if self._held_locks:
                self._keep_manifest(checkpoint_id, blob)
        data = read_json(self.backend, name, "", f"checkpoint {checkpoint_id}: manifest", blob)
        try:
            return Manifest.from_json(data)
        except KeyError as exc:
            raise DamagedCheckpoint(f"checkpoint {checkpoint_id}: manifest {path} lacks {exc}") from exc
        except (TypeError, ValueError) as exc:  # valid JSON, but not a manifest ([], 3, a field of the wrong type)
            raise DamagedCheckpoint(f"checkpoint {checkpoint_id}: manifest {path} is not a manifest ({exc})") from exc

    def _keep_manifest(self, checkpoint_id: str, blob: bytes) -> None:
        with self._manifests_lock:  # (one store's loads may come from several threads)
            while len(self._manifest_blobs) >= MANIFESTS_KEPT:  # (a listing reads them all)
                del self._manifest_blobs[next(iter(self._manifest_blobs))]
            self._manifest_blobs[checkpoint_id] = blob

    def manifests(self, on_damaged=None) -> list[Manifest]:
        """Every readable manifest a reader sees, oldest first: not those of unfinished members
        (docs/design.md, "Visibility"). on_damaged(id, error) hears of those that cannot be read."""
        return self.manifests_by_visibility(on_damaged)[0]

    def manifests_by_visibility(self, on_damaged=None) -> tuple[list[Manifest], list[Manifest]]:
        """Every readable manifest, oldest first, split in two: those a reader sees, and those of
        unfinished members (their group manifest does not exist), which only prune looks at."""
        visibility = self.visibility()
        finished: list[Manifest] = []
        unfinished: list[Manifest] = []
        for checkpoint_id in self.checkpoint_ids():
            try:
                manifest = self.load(checkpoint_id)
            except (DamagedCheckpoint, StoreError, CheckpointNotFound) as exc:
                if on_damaged:
                    on_damaged(checkpoint_id, exc)
                continue
            (finished if visibility.finished(manifest) else unfinished).append(manifest)
        return finished, unfinished

    def visibility(self) -> Visibility:
        """Which members a reader sees (groups/ listed at most once for the whole answer)."""
        return Visibility(self.groups)

    def _visible(self, checkpoint_id: str, visibility: Visibility) -> bool:
        """Whether a reader sees the checkpoint. One that cannot be read is seen: whoever loads
        it next says what is wrong with it (a reference to it must not just vanish)."""
        try:
            return visibility.finished(self.load(checkpoint_id))
        except CheckpointNotFound:
            return False
        except (DamagedCheckpoint, StoreError):
            return True

    def _visible_ids(self, ref: str, kind: str, all_ids: list[str]) -> list[str]:
        """The IDs a reader sees that an ID or a prefix names (a member is read to know)."""
        candidates = ([ref] if ref in all_ids else []) if kind == "id" else [i for i in all_ids if i.startswith(ref)]
        visibility = self.visibility()
        return [i for i in candidates if self._visible(i, visibility)]

    def resolve(self, ref: str) -> str:
        """An ID, a unique ID prefix, a name (newest with it) or 'latest' -> checkpoint ID. An
        unfinished member is never the answer (docs/design.md, "Visibility")."""
        kind = ids.classify_reference(ref)
        all_ids = self.checkpoint_ids()
        if kind == "latest":
            visibility = self.visibility()
            newest = next((i for i in reversed(all_ids) if self._visible(i, visibility)), None)
            if newest is None:
                raise CheckpointNotFound("the store has no checkpoints yet", hint="create one with 'ckpt dump PID'")
            return newest
        if kind in ("id", "prefix"):
            matches = self._visible_ids(ref, kind, all_ids)
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise CheckpointNotFound(f"'{ref}' matches {len(matches)} checkpoints", hint="give more of the ID")
            if kind == "id":
                raise CheckpointNotFound(f"no checkpoint with ID {ref}", hint=did_you_mean(ref, [], all_ids))
        manifests = self.manifests()
        named = [m.id for m in manifests if m.name == ref]
        if not named:
            names = list(dict.fromkeys(m.name for m in manifests if m.name))
            raise CheckpointNotFound(f"no checkpoint with ID or name '{ref}'", hint=did_you_mean(ref, names, all_ids))
        return named[-1]

    def resolve_group(self, ref: str) -> str | None:
        """The group checkpoint ref names (its ID, a unique prefix, its name: the newest group of
        that name), or None when it names none (then ref may name a checkpoint: resolve). A ref
        that names a group and a checkpoint is refused: only an ID says which. A member that
        bears its group's name does not count: it is reached through its group."""
        group_id = self.groups.resolve(ref)
        if group_id is None:
            return None
        kind = ids.classify_reference(ref)
        if kind in ("id", "prefix"):
            also = self._visible_ids(ref, kind, self.checkpoint_ids())
        else:
            also = [m.id for m in self.manifests() if m.name == ref and group_of(m) is None]
        if also:
            raise UsageError(f"'{ref}' names group checkpoint {group_id} and checkpoint {also[-1]}: "
                             "give the ID of the one you mean")
        return group_id

    def group_of_checkpoint(self, checkpoint_id: str) -> GroupManifest | None:
        """The group manifest of the group a checkpoint is a member of, or None (not a member);
        CheckpointNotFound for an unfinished member (callers pass what resolve() found)."""
        group_id = group_of(self.load(checkpoint_id))
        return self.groups.load(group_id) if group_id is not None else None

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

    def staging_area(self) -> StagingArea:
        """Where images are written before they enter the store, or before CRIU restores them
        (ckpt/store/materialize.py lays a checkpoint out in it); the store's tmp/ is made here.

        <store>/tmp by default (CKPT_STAGING=disk or auto): CRIU writes and reads a disk
        filesystem's page cache (large folios) faster than tmpfs (4 KiB pages). Measured here,
        2 GiB target, medians of 4: frozen 1440 ms staging on disk against 1828 ms in
        /dev/shm (raw `criu dump` to disk: 1381 ms), whole dump 3.8 s against 4.7 s; restores
        5.9 s against 7.2 s. Staging files live a few seconds and are deleted before the kernel
        writes most of them back; page cache, unlike tmpfs, can also be written back under
        memory pressure. CKPT_STAGING=ram stages in /dev/shm instead (see ckpt/store/staging.py
        for how ckpt stays safe in a directory every user can write).
        """
        if self.settings.staging == "ram":
            return StagingArea.in_ram(self.root)
        make_private_dir(self.tmp_dir)
        return StagingArea(self.tmp_dir)

    def begin_dump(self, checkpoint_id: str) -> DumpStaging:
        try:
            return self.staging_area().begin_dump(ids.check_id(checkpoint_id))
        except OSError as exc:
            raise translate_os_error(exc, "creating the staging directory") from exc

    def logs_dir(self, checkpoint_id: str) -> Path:
        path = self.logs_root / ids.check_id(checkpoint_id)
        make_private_dir(path)
        return path

    # ---- the newest checkpoint of a target -------------------------------------------------

    def newest_of(self, pid: int, limit: int = 64) -> Manifest | None:
        """The newest checkpoint of a PID among the `limit` newest of the store (a dump uses
        it to skip looking up unchanged pages; scheduled dumps of one target follow each
        other closely), or None."""
        visibility = self.visibility()
        for checkpoint_id in reversed(self.checkpoint_ids()[-limit:]):
            try:
                manifest = self.load(checkpoint_id)
            except (DamagedCheckpoint, StoreError, CheckpointNotFound):
                continue
            if manifest.pid == pid and visibility.finished(manifest):
                return manifest
        return None

    # ---- removal and clean-up (callers hold the exclusive lock) -----------------------------------

    def remove(self, checkpoint_ids: list[str], on_removed: Callable[[str], None] | None = None) -> None:
        """Removes the checkpoints' manifests (each durably, one after the other), then their
        logs. Their objects stay until a prune (ckpt/store/prune.py)."""
        for checkpoint_id in checkpoint_ids:
            with self._manifests_lock:
                self._manifest_blobs.pop(checkpoint_id, None)
            self.backend.delete([self.manifest_name(checkpoint_id)])
            shutil.rmtree(self.logs_root / ids.check_id(checkpoint_id), ignore_errors=True)
            if on_removed is not None:
                on_removed(checkpoint_id)

    def members_of(self, group: GroupManifest) -> list[str]:
        """The checkpoints of a group's members that are there and belong to it: those whose
        manifest names it, or cannot be read (a checkpoint the group lists as its member). A
        manifest naming another group, or none, is never counted: it is not this group's."""
        found = set(self.checkpoint_ids())
        members = []
        for checkpoint_id in [i for i in group.checkpoint_ids if i in found]:
            try:
                belongs = group_of(self.load(checkpoint_id)) == group.id
            except CheckpointNotFound:
                continue
            except (DamagedCheckpoint, StoreError):
                belongs = True
            if belongs:
                members.append(checkpoint_id)
        return members

    def remove_group(self, group: GroupManifest, on_removed: Callable[[str], None] | None = None) -> list[str]:
        """Removes a group checkpoint: its group manifest first, so that the group and every
        member disappear at once, then its members' manifests (a kill in between leaves them
        unfinished: prune removes them). Returns the members removed. The caller holds the
        exclusive lock; objects stay until a prune."""
        members = self.members_of(group)
        self.groups.remove(group.id)
        self.remove(members, on_removed)
        return members

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
