"""Copying checkpoints from one store to another, sending only what the destination lacks:
the store-level half of `ckpt copy` (ckpt/commands/copy.py holds the use case: locks, the
report, pending copies).

Objects go by name (content-hashed: one the destination has is skipped). Pages go by id: the
pages of each pages image that the destination's block index lacks are read out of the
source's packs (segment by segment, each checked against its checksum and every page against
its id) and written into one new pack and index file of the destination, by the dump's own
path (BlockStore.add_pages). The manifest is committed last, with put_if_absent: a checkpoint
whose ID the destination has is skipped, so a copy can run again after any failure and sends
only what is still missing. See docs/design.md, "Copying between stores". A group checkpoint's
manifest is copied after every member's (copy_group); an unfinished member is never copied.

Page ids are keyed with each store's seed (`key`). A destination that has none yet (new, or
never holding a page) gets the source's, so that the ids of both stores agree and copies
compare ids alone. Otherwise every page the copy cannot translate is read and hashed with the
destination's seed; the translation of a checkpoint's ids is learnt from the previous
checkpoint of the same process that both stores hold (same ID: a copy), so that a later copy
reads only the pages that changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass

import blake3
import zstandard

from ckpt.errors import CheckpointNotFound, CkptError, DamagedCheckpoint, StoreError
from ckpt.phases import phase
from ckpt.reporting import Reporter
from ckpt.store.backends import BlobExists, BlobNotFound, BlobStream
from ckpt.store.blocks.blockstore import KEY, PackWriter, page_ids
from ckpt.store.blocks.segments import ID_LEN, INDEX_PREFIX, PAGE
from ckpt.store.bundles import BundleContents, write_bundle
from ckpt.store.groups import Groups
from ckpt.store.manifest import FileEntry
from ckpt.store.objects import codecs_from, object_name
from ckpt.store.repository import STORE_META, Manifest, Store
from ckpt.store.staging import discard

BATCH_PAGES = 2048  # pages read, hashed and looked up at a time (8 MiB)
CHUNK = 4 << 20
EARLIER_CANDIDATES = 16  # checkpoints held by both stores looked at for a translation of ids

@dataclass
class CopyResult:
    """What copying one checkpoint did."""

    id: str
    status: str  # "copied", "present" (the destination had it) or "failed"
    bytes_sent: int = 0  # bytes written into the destination: objects, pack, index file, manifest
    pages: int = 0
    pages_sent: int = 0
    objects_sent: int = 0
    pages_read: int = 0  # pages read from the source (those sent, and those hashed anew)
    error: str | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "status": self.status, "bytes_sent": self.bytes_sent, "pages": self.pages,
                "pages_sent": self.pages_sent, "pages_read": self.pages_read, "objects_sent": self.objects_sent,
                "error": self.error}


@dataclass
class GroupCopyResult:
    """What copying one group manifest did (its members are CopyResults of their own)."""

    id: str
    status: str  # "copied", "present" (the destination had it) or "failed"
    bytes_sent: int = 0
    error: str | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "status": self.status, "bytes_sent": self.bytes_sent, "error": self.error}


def location_of(store: Store) -> str:
    """The store, as a path or a URL (for messages, and to tell two stores apart)."""
    return store.backend.where(STORE_META).removesuffix("/" + STORE_META)


def share_seed(source: Store, dest: Store) -> bool:
    """Gives a destination without a seed the source's (see the module's docstring); returns
    whether both stores now hash pages alike. Before dest.blocks: it would draw a seed."""
    try:
        seed = source.backend.get(KEY)
    except BlobNotFound:
        seed = None  # a source that never stored a page: its BlockStore draws one below
    if seed is not None and not dest.backend.exists(KEY):
        try:
            dest.backend.put_if_absent(KEY, seed)
        except BlobExists:
            pass  # a dump into the destination drew its own meanwhile
    return source.blocks.seed == dest.blocks.seed


class CheckpointCopier:
    """Copies checkpoints one at a time from source to dest (the caller holds both stores' locks)."""

    def __init__(self, source: Store, dest: Store, reporter: Reporter, codec: str, same_seed: bool):
        self.source, self.dest = source, dest
        self.reporter = reporter
        self.codec = codec
        self.same_seed = same_seed
        self.dest_ids: set[str] | None = None
        self.visibility = source.visibility()
        # Source id -> destination id of the pages of the last checkpoint copied (different seeds).
        self.last: tuple[int, dict[bytes, bytes]] | None = None

    def copy_one(self, checkpoint_id: str) -> CopyResult:
        name = Store.manifest_name(checkpoint_id)
        if self.dest.backend.exists(name):
            return CopyResult(checkpoint_id, "present")
        manifest = self.source.load(checkpoint_id)
        if not self.visibility.finished(manifest):
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} is a member of a group checkpoint that never "
                                     "committed (prune removes it): not copied")
        try:
            raw = json.loads(self.source.backend.get(name))
        except (BlobNotFound, ValueError) as exc:
            raise DamagedCheckpoint(f"checkpoint {checkpoint_id}: its manifest cannot be read ({exc})") from None
        self.reporter.step(f"copying {checkpoint_id} ({manifest.bytes_total // PAGE} pages of images)")
        result = CopyResult(checkpoint_id, "copied")
        translation = {} if self.same_seed else self._translation(manifest)
        pairs: dict[bytes, bytes] = {}  # this checkpoint's translation, for the next one
        pack = PackWriter(self.dest.backend)
        in_pack: set[bytes] = set()  # ids this pack holds (the destination's index learns them at commit)
        entries = {e["name"]: e for e in raw["files"]}  # the manifest as written: unknown keys kept
        bundled = BundleContents() if self.dest.remote else None  # (ckpt/store/bundles.py)
        total, done = manifest.bytes_total or 1, 0
        try:
            for entry in manifest.files:
                if entry.kind == "pages":
                    src_list = self.source.objects.load_page_list(entry)
                    dest_list = self._pages(entry.name, src_list, translation, pack, in_pack,
                                            result, lambda n, base=done: self.reporter.progress(
                                                base + n * PAGE, total, f"copying {checkpoint_id}"))
                    if not self.same_seed:
                        pairs.update(zip(_ids(src_list), _ids(dest_list), strict=True))
                    entries[entry.name].update(self._page_list(dest_list, result, bundled))
                else:
                    self._object(entry, result, bundled)
                done += entry.size
                self.reporter.progress(done, total, f"copying {checkpoint_id}")
            written = pack.commit()
            if written:
                result.bytes_sent += pack.offset + len(pack.index_data)
                # The destination's index learns the new file without reading every file again.
                self.dest.blocks.index().add_file(written[-1][len(INDEX_PREFIX):], pack.index_data)
        except BaseException:
            pack.abort()
            raise
        self._commit(name, raw, result, bundled)
        if not self.same_seed:
            self.last = (manifest.pid, pairs)
        return result

    def copy_group(self, group_id: str) -> GroupCopyResult:
        """A group manifest, as written, once every member is in the destination: the group's
        commit point there too (put_if_absent), so it is visible whole or not at all."""
        name = Groups.blob_name(group_id)
        if self.dest.backend.exists(name):
            return GroupCopyResult(group_id, "present")
        group = self.source.groups.load(group_id)
        missing = [i for i in group.checkpoint_ids if not self.dest.backend.exists(Store.manifest_name(i))]
        if missing:
            raise DamagedCheckpoint(f"group {group.label}: its member(s) {', '.join(missing)} are not in the "
                                    "destination: the group is not committed there")
        try:
            data = self.source.backend.get(name)
        except BlobNotFound:
            raise CheckpointNotFound(f"group {group_id} was removed from the source meanwhile") from None
        try:
            self.dest.backend.put_if_absent(name, data)
        except BlobExists:
            return GroupCopyResult(group_id, "present")  # another copy committed it meanwhile
        return GroupCopyResult(group_id, "copied", bytes_sent=len(data))

    def _page_list(self, dest_list: bytes, result: CopyResult, bundled: BundleContents | None) -> dict:
        """Stores the page list (in the destination's ids) unless the destination has it; returns
        what its manifest entry then says of it. A copy for the bundle, if one is made."""
        digest = blake3.blake3(dest_list).hexdigest()
        if bundled is not None:
            bundled.add(digest, dest_list)
        if self.dest.objects.find(digest, codecs=codecs_from("pages")) is None:
            self.dest.backend.put(object_name(digest, "none"), dest_list)
            result.bytes_sent += len(dest_list)
            result.objects_sent += 1
        return {"hash": digest, "stored_size": len(dest_list)}

    def _commit(self, name: str, raw: dict, result: CopyResult, bundled: BundleContents | None) -> None:
        """The manifest, last: the checkpoint exists in the destination from then on. Into a
        remote store, after a bundle of its own (ckpt/store/bundles.py): the source's names
        the source's page lists, which may be others (another seed)."""
        raw.pop("bundle", None)
        if bundled is not None:
            bundle, sent = write_bundle(self.dest.backend, raw["id"], bundled.contents,
                                        [entry["hash"] for entry in raw["files"]])
            if bundle is not None:
                raw["bundle"] = bundle
                result.bytes_sent += sent
        phase("copy.before-commit")
        data = json.dumps(raw, indent=2).encode() + b"\n"
        try:
            self.dest.backend.put_if_absent(name, data)
        except BlobExists:
            result.status = "present"  # another copy committed it meanwhile: the same checkpoint
        else:
            result.bytes_sent += len(data)
        phase("copy.committed")

    # ---- objects ----------------------------------------------------------------------------

    def _object(self, entry: FileEntry, result: CopyResult, bundled: BundleContents | None) -> None:
        """Copies one object, counted in result; a small one's content kept for the bundle, if
        one is made."""
        copied = self._object_once(entry.name, entry.hash, entry.codec)
        result.bytes_sent += copied
        result.objects_sent += copied > 0
        if bundled is not None and bundled.wants(entry.size) and entry.hash not in bundled.contents:
            for store in (self.source, self.dest):  # (the source's may be damaged: the copy is the destination's)
                try:
                    bundled.add(entry.hash, store.objects.content(entry))
                    break
                except (CkptError, OSError):
                    continue  # left out of the bundle: read on its own

    def _object_once(self, image: str, digest: str, codec: str) -> int:
        """Copies one object unless the destination has it (under either name, the manifest's
        codec's asked first); returns the bytes sent. Its content is checked against its hash
        on the way: damage is not spread to the copy. Read from the source under the
        manifest's codec's name first, and under the other if it is not there or damaged
        there (a dump may have healed it under that name)."""
        if self.dest.objects.find(digest, codecs=codecs_from(codec)) is not None:
            return 0
        damage: DamagedCheckpoint | None = None
        for source_codec in codecs_from(codec):
            try:
                return self._copy_object(image, digest, object_name(digest, source_codec), source_codec)
            except BlobNotFound:
                continue
            except DamagedCheckpoint as exc:
                damage = damage or exc
        raise damage or DamagedCheckpoint(f"image {image}: object {digest[:16]}… is missing from the source store")

    def _copy_object(self, image: str, digest: str, name: str, codec: str) -> int:
        """One source copy of an object into the destination, under its name (BlobNotFound if
        the source has none there)."""
        hasher = blake3.blake3()
        decompressor = zstandard.ZstdDecompressor().decompressobj() if codec == "zstd" else None
        sent = 0
        try:
            stream = BlobStream(self.source.backend, name, CHUNK)
            with self.dest.backend.writer(name) as out:
                while chunk := stream.read(CHUNK):
                    hasher.update(decompressor.decompress(chunk) if decompressor is not None else chunk)
                    out.write(chunk)
                    sent += len(chunk)
                if hasher.hexdigest() != digest:
                    raise DamagedCheckpoint(f"image {image}: object {self.source.backend.where(name)} is damaged "
                                            "(its content does not match its hash)")
                out.commit()
        except zstandard.ZstdError as exc:
            raise DamagedCheckpoint(f"image {image}: object {self.source.backend.where(name)} cannot be "
                                    f"decompressed ({exc})") from exc
        return sent

    # ---- pages ------------------------------------------------------------------------------

    def _translation(self, manifest: Manifest) -> dict[bytes, bytes]:
        """Source id -> destination id, from the newest earlier checkpoint of the same process
        that both stores hold (its page lists, row by row, name the same pages)."""
        if self.last is not None and self.last[0] == manifest.pid:
            return self.last[1]
        if self.dest_ids is None:
            self.dest_ids = set(self.dest.checkpoint_ids())
        common = [i for i in self.source.checkpoint_ids() if i < manifest.id and i in self.dest_ids]
        for earlier_id in reversed(common[-EARLIER_CANDIDATES:]):
            try:
                theirs, ours = self.source.load(earlier_id), self.dest.load(earlier_id)
                if theirs.pid != manifest.pid:
                    continue
                pairs: dict[bytes, bytes] = {}
                dest_files = {e.name: e for e in ours.files if e.kind == "pages"}
                for entry in theirs.files:
                    if entry.kind != "pages" or entry.name not in dest_files:
                        continue
                    src_list = self.source.objects.load_page_list(entry)
                    dest_list = self.dest.objects.load_page_list(dest_files[entry.name])
                    if len(src_list) == len(dest_list):
                        pairs.update(zip(_ids(src_list), _ids(dest_list), strict=True))
                return pairs
            except (DamagedCheckpoint, CheckpointNotFound, StoreError):
                continue  # only a shortcut: without it the pages are hashed anew
        return {}

    def _pages(self, image: str, src_list: bytes, translation: dict[bytes, bytes], pack: PackWriter,  # noqa: PLR0913
               sent: set[bytes], result: CopyResult, progress) -> bytes:
        """Writes the pages of one pages image that the destination lacks into the pack;
        returns the image's page list in the destination's ids."""
        n = len(src_list) // ID_LEN
        result.pages += n
        if n == 0:
            return b""
        pages = _ImagePages(self, image, src_list, pack, sent, result)
        try:
            if self.same_seed:
                return pages.copy_same_ids(progress)
            return pages.copy_translated(translation, progress)
        finally:
            pages.close()


class _ImagePages:
    """The copy of one pages image's pages: read from the source (checked against their ids),
    sent into the pack when neither the destination nor this pack holds them yet."""

    def __init__(self, copier: CheckpointCopier, image: str, src_list: bytes, pack: PackWriter,
                 sent: set[bytes], result: CopyResult):
        self.copier, self.image, self.src_list, self.pack = copier, image, src_list, pack
        self.sent, self.result = sent, result  # sent: the ids this pack holds
        self.n = len(src_list) // ID_LEN
        self.index = copier.dest.blocks.index()
        self.locations = copier.source.blocks.locate(image, src_list)
        self.reader = copier.source.blocks.page_reader()
        self.spool: Path | None = None
        self.dest_seed = copier.dest.blocks.seed

    def read_ahead(self, rows: list[int]) -> None:
        """From a remote source, the pages of these rows are fetched ahead (large parallel
        requests, into a spool in the source's staging area) for the reads that follow."""
        if not self.copier.source.objects.remote or not rows:
            return
        self.spool = self.copier.source.staging_area().new_dir("copy")
        self.reader.close()
        self.reader = self.copier.source.blocks.page_reader([self.locations[i] for i in rows], self.spool / "spool")

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            if self.spool is not None:
                discard(self.spool)

    def read(self, rows: list[int]) -> bytes:
        pages = self.reader.read([self.locations[i] for i in rows])
        self.result.pages_read += len(rows)
        wanted = b"".join(self.src_list[i * ID_LEN:(i + 1) * ID_LEN] for i in rows)
        if page_ids(pages, self.copier.source.blocks.seed) != wanted:
            raise DamagedCheckpoint(f"image {self.image}: a page of the source store does not match its id")
        return pages

    def send(self, pages: bytes, ids: bytes) -> None:
        """The pages of ids the destination does not hold (and this pack does not yet)."""
        fresh: list[int] = []
        for j in [j for j, ok in enumerate(self.index.held(ids).tolist()) if not ok]:
            page_id = ids[j * ID_LEN:(j + 1) * ID_LEN]
            if page_id not in self.sent:  # twice in this batch: once
                self.sent.add(page_id)
                fresh.append(j)
        if not fresh:
            return
        data = b"".join(pages[j * PAGE:(j + 1) * PAGE] for j in fresh) if len(fresh) < len(ids) // ID_LEN \
            else pages
        self.copier.dest.blocks.add_pages(self.pack, data, b"".join(ids[j * ID_LEN:(j + 1) * ID_LEN] for j in fresh),
                                          self.copier.codec)
        self.result.pages_sent += len(fresh)
        phase("copy.packing")

    def copy_same_ids(self, progress) -> bytes:
        """Both stores name pages alike (the same seed): the page list is copied as it is."""
        rows = self.index.missing(self.src_list)
        self.read_ahead(rows)
        for start in range(0, len(rows), BATCH_PAGES):
            batch = rows[start:start + BATCH_PAGES]
            self.send(self.read(batch), b"".join(self.src_list[i * ID_LEN:(i + 1) * ID_LEN] for i in batch))
            progress(start + len(batch))
        return self.src_list

    def copy_translated(self, translation: dict[bytes, bytes], progress) -> bytes:
        """Different seeds: ids the translation knows are taken from it, the others learnt by
        hashing the pages with the destination's seed."""
        dest_list = bytearray(self.n * ID_LEN)
        unknown = []
        for i, page_id in enumerate(_ids(self.src_list)):
            mapped = translation.get(page_id)
            if mapped is None:
                unknown.append(i)
            else:
                dest_list[i * ID_LEN:(i + 1) * ID_LEN] = mapped
        # Pages not translated: read, hashed with the destination's seed, sent if it lacks them.
        self.read_ahead(unknown)
        for start in range(0, len(unknown), BATCH_PAGES):
            batch = unknown[start:start + BATCH_PAGES]
            pages = self.read(batch)
            ids = page_ids(pages, self.dest_seed)
            for j, i in enumerate(batch):
                dest_list[i * ID_LEN:(i + 1) * ID_LEN] = ids[j * ID_LEN:(j + 1) * ID_LEN]
            self.send(pages, ids)
            progress(start + len(batch))
        self._send_lacking(dest_list, unknown)
        return bytes(dest_list)

    def _send_lacking(self, dest_list: bytearray, unknown: list[int]) -> None:
        """Translated pages the destination lacks all the same (pruned there since): read, and
        checked against the translation before they are sent."""
        known = sorted(set(range(self.n)) - set(unknown))
        known_ids = b"".join(dest_list[i * ID_LEN:(i + 1) * ID_LEN] for i in known)
        lacking = [known[j] for j in self.index.missing(known_ids)
                   if bytes(dest_list[known[j] * ID_LEN:(known[j] + 1) * ID_LEN]) not in self.sent]
        for start in range(0, len(lacking), BATCH_PAGES):
            batch = lacking[start:start + BATCH_PAGES]
            pages = self.read(batch)
            ids = page_ids(pages, self.dest_seed)
            if ids != b"".join(dest_list[i * ID_LEN:(i + 1) * ID_LEN] for i in batch):
                raise DamagedCheckpoint(f"image {self.image}: the ids learnt from an earlier copy do not match")
            self.send(pages, ids)


def _ids(page_list: bytes) -> list[bytes]:
    return [page_list[i:i + ID_LEN] for i in range(0, len(page_list), ID_LEN)]
