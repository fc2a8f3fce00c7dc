"""The store's objects: image files (all but the pages images) and page lists, each kept once,
named by the BLAKE3 of its content, compressed with zstd or not at all (see "Objects" in
docs/design.md). The pages themselves are in the block store (ckpt/store/blocks/).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import CancelledError, Executor, Future
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import blake3
import zstandard

from ckpt.errors import DamagedCheckpoint
from ckpt.store import bundles
from ckpt.store.backends import Backend, BlobNotFound, BlobStream
from ckpt.store.blocks.blockstore import ENCODED_AT_MOST, BlockStore, DecodedSegments
from ckpt.store.blocks.segments import ID_LEN
from ckpt.store.manifest import FileEntry
from ckpt.system.files import FILE_MODE, write_all

# An object is kept compressed with zstd or not at all (a dump with lz4 keeps its objects as
# zstd): its codec is the suffix of its name, zstd looked for first.
OBJECT_SUFFIX = {"zstd": ".zst", "none": ""}
OBJECTS_PREFIX = "objects/"
INDEX_AND_PACKS = ("packs/", "index/")
ZSTD_LEVEL = 1
CHUNK = 4 << 20
HASH_CHUNK = 64 << 20  # read at a time to hash a stored object (blake3 hashes it on every core)
SAMPLE = 1 << 20
SAMPLES = 16
PAGE_SAMPLE = 4096
SMALL_FILE = 8 << 20  # compressed by the calling thread alone (a multithreaded compressor starts threads)
_local = threading.local()


class Found(NamedTuple):
    """A stored object: its blob's name, its codec and the size of the blob."""

    name: str
    codec: str
    size: int


def codecs_from(codec: str) -> tuple[str, ...]:
    """Both codecs, in the order an object a manifest entry names is looked for: the codec it
    records first (a page list's entry records "pages": stored as none)."""
    first = codec if codec in OBJECT_SUFFIX else "none"
    return (first, *(other for other in OBJECT_SUFFIX if other != first))


def object_codec(path: Path, codec: str) -> str:
    """The codec a file is stored with when a dump asks for codec ("zstd" or "none")."""
    return "zstd" if codec == "zstd" and worth_compressing(path) else "none"


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's single-threaded compressor: making one costs as much as compressing a
    page, and the image files of a tree of many processes are hundreds of a few KiB each."""
    compressor = getattr(_local, "zstd", None)
    if compressor is None:
        compressor = _local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return compressor


def worth_compressing(path: Path) -> bool:
    """Samples the file: data that does not shrink by 10% is stored as it is. Compressing it
    would cost a pass over it on every dump and every restore for nothing."""
    size = path.stat().st_size
    if size < SAMPLE:
        return True
    # At most a 32nd of the file: a 2 MiB pages image (a worker of a pool) was half read
    # and compressed to decide, 3 ms a process.
    piece = max(PAGE_SAMPLE, min(SAMPLE, size // 32) // SAMPLES)
    compressor = _compressor()
    with open(path, "rb") as f:
        raw = packed = 0
        for k in range(SAMPLES):
            f.seek((size - piece) * k // (SAMPLES - 1))
            chunk = f.read(piece)
            raw += len(chunk)
            packed += len(compressor.compress(chunk))
    return packed < ENCODED_AT_MOST * raw


def hash_file(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


def object_name(digest: str, codec: str) -> str:
    return f"{OBJECTS_PREFIX}{digest[:2]}/{digest}{OBJECT_SUFFIX[codec]}"


class Objects:
    """The objects of a store, through its backend; pages images are checked and written
    through its block store. remote: the store is remote (a hole's pages are then not read
    back to be checked: see BlockStore.write_image)."""

    def __init__(self, backend: Backend, blocks: BlockStore, remote: bool = False):
        self.backend = backend
        self.blocks = blocks
        self.remote = remote
        # A restore's copy of its checkpoint's small objects, each checked already (take_bundle).
        self.bundled: dict[str, memoryview] = {}
        self._page_lists_ahead: dict[str, Future[bytes]] = {}  # by hash (read_page_lists_ahead)

    def take_bundle(self, bundle: dict | None, entries: Sequence[FileEntry]) -> int:
        """From a remote store, a checkpoint's small objects read at once from its bundle
        (ckpt/store/bundles.py), unless this host's cache holds them (a standby warmed ahead
        then asks the bucket for nothing); returns how many it holds. Later reads of those
        objects take them from it; the others, or all when the bundle cannot be read, are
        read one by one as before."""
        self.bundled = {}
        if not self.remote or not isinstance(bundle, dict) or not isinstance(bundle.get("spans"), dict):
            return 0
        spans = bundle["spans"]
        names = {object_name(entry.hash, codecs_from(entry.codec)[0]) for entry in entries if entry.hash in spans}
        if sum(not self.backend.held_locally(name) for name in names) < bundles.MIN_OBJECTS:
            return 0
        self.bundled = bundles.read_bundle(self.backend, bundle)
        return len(self.bundled)

    def read_page_lists_ahead(self, entries: Sequence[FileEntry], pool: Executor) -> dict[str, Future[bytes]]:
        """The page lists of these pages images, each content once, by hash: read by pool's
        threads from now on (those in the bundle are there already); load_page_list waits for
        such a read instead of reading again. From S3, a 1 GiB process's page list (4 MiB) came
        down only once its other images were laid out, 0.08 s before its page server could start."""
        for entry in entries:
            if entry.hash in self._page_lists_ahead:
                continue
            if entry.hash in self.bundled:
                done: Future[bytes] = Future()
                done.set_result(bytes(self.bundled[entry.hash]))
                self._page_lists_ahead[entry.hash] = done
            else:
                self._page_lists_ahead[entry.hash] = pool.submit(self._read_page_list, entry)
        return dict(self._page_lists_ahead)

    def forget_read_ahead(self) -> None:
        """Once a restore's images are laid out: the bundle's memory let go, and the page lists
        read ahead (a member agent's store lives on, for other checkpoints)."""
        self.bundled = {}
        self._page_lists_ahead = {}

    def find(self, digest: str, besides: str | None = None, codecs: Sequence[str] = tuple(OBJECT_SUFFIX)
             ) -> Found | None:
        """The object holding that content, or None; besides: a name already read (missing or
        damaged there), not asked again. codecs: the names looked for, in order; a writer asks
        only for the codec it would store the content with (from S3 each name is a request: a
        dump of 100 processes asked twice for each of 300 new objects): a copy under the other
        codec's name (a dump with other settings) is then not found, and the content is stored
        again under this one (both are the object: see "Objects" in docs/design.md)."""
        for codec in codecs:
            name = object_name(digest, codec)
            if name == besides:
                continue
            try:
                return Found(name, codec, self.backend.stat(name).size)
            except BlobNotFound:
                pass
        return None

    def put_bytes(self, data: bytes) -> tuple[str, int, int]:
        """Stores bytes as an object (codec none); returns (hash, stored size, bytes added).
        A damaged existing copy is replaced."""
        digest = blake3.blake3(data).hexdigest()
        existing = self.find(digest, codecs=("none",))
        if existing and self.intact(existing.name, existing.codec, digest):
            return digest, len(data), 0
        self.backend.put(object_name(digest, "none"), data)
        return digest, len(data), len(data)

    def intact(self, name: str, codec: str, digest: str) -> bool:
        """Whether a stored object still holds the content its name promises."""
        try:  # (that copy alone: read_into would read the other codec's copy of a damaged one)
            entry = FileEntry(name.rpartition("/")[2], 0, digest, codec, 0)
            return self._read_object(entry, name, codec, None) == digest
        except (DamagedCheckpoint, OSError):
            return False

    def load_page_list(self, entry: FileEntry) -> bytes:
        if entry.hash in self.bundled:
            return bytes(self.bundled[entry.hash])
        ahead = self._page_lists_ahead.get(entry.hash)
        if ahead is not None and not ahead.cancelled():
            try:
                return ahead.result()
            except CancelledError:
                pass  # (let go between the look and the wait)
        return self._read_page_list(entry)

    def _read_page_list(self, entry: FileEntry) -> bytes:
        name = object_name(entry.hash, "none")  # as put_bytes stores it: read first, found if not there
        data: bytes | None = None
        damage: DamagedCheckpoint | None = None
        try:
            data = self.backend.get(name)
        except BlobNotFound:
            pass
        except DamagedCheckpoint as exc:  # (an encrypted store's blob failing authentication)
            damage = exc
        if data is None or blake3.blake3(data).hexdigest() != entry.hash:
            found = self.find(entry.hash, besides=name)
            if found is not None:
                try:
                    data, damage = self.backend.get(found.name), None
                except BlobNotFound:
                    pass
        if damage is not None:
            raise damage
        if data is None:
            raise DamagedCheckpoint(f"image {entry.name}: its page list is missing from the store")
        if blake3.blake3(data).hexdigest() != entry.hash:
            raise DamagedCheckpoint(f"image {entry.name}: its page list is damaged")
        return data

    def store_file(self, source: Path, digest: str, codec: str) -> tuple[str, int]:
        """Stores one file under its hash; returns the codec used and the stored size. codec:
        as object_codec decided it."""
        name = object_name(digest, codec)
        if codec == "none":
            return codec, self.backend.put_file(name, source)  # locally a rename: no copy
        size = source.stat().st_size
        compressor = _compressor() if size <= SMALL_FILE else zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, threads=-1, write_content_size=True)
        with open(source, "rb") as src, self.backend.writer(name) as dst:
            compressor.copy_stream(src, dst, size=size,  # type: ignore[arg-type]  # only write()
                                   read_size=CHUNK, write_size=CHUNK)
            dst.commit()
        source.unlink()
        return codec, dst.written

    def read_into(self, entry: FileEntry, dest: Path | None) -> str:
        """Streams an object (decompressed) into dest, or nowhere; returns the content's hash.
        It is read under the codec the manifest recorded (from S3: no request asking whether
        it is there first; a restore of 100 processes reads 400 objects), and under the other
        codec's name if it is not there, or damaged there (a dump healed it under that name,
        and may not have lived to delete the damaged copy, or stored it under the codec it
        would use without asking for the other name: see "Damage and healing")."""
        if entry.hash in self.bundled:
            if dest is not None:
                _write_new(dest, self.bundled[entry.hash])
            return entry.hash  # (checked against it as the bundle was read)
        missing = DamagedCheckpoint(f"image {entry.name}: object {entry.hash[:16]}… is missing from the store")
        codec = entry.codec if entry.codec in OBJECT_SUFFIX else "none"
        name = object_name(entry.hash, codec)
        digest: str | None = None
        damage: DamagedCheckpoint | None = None
        try:
            digest = self._read_object(entry, name, codec, dest)
        except BlobNotFound:
            pass
        except DamagedCheckpoint as exc:
            damage = exc
        if digest == entry.hash:
            return digest
        other = self.find(entry.hash, besides=name)
        if other is None:
            if damage is not None:
                raise damage
            if digest is None:
                raise missing
            return digest  # the caller names the damage
        if dest is not None:
            dest.unlink(missing_ok=True)
        try:
            return self._read_object(entry, other.name, other.codec, dest)
        except BlobNotFound:
            raise missing from None

    def _read_object(self, entry: FileEntry, name: str, codec: str, dest: Path | None) -> str:
        """read_into, the object's name and codec known (BlobNotFound if there is none)."""
        if codec == "none":
            if dest is not None:
                self.backend.get_file(name, dest)  # locally a hard link: no copy
                return hash_file(dest)
            return self.hash_blob(name)
        return self._decompress_into(entry, name, dest)

    def _decompress_into(self, entry: FileEntry, name: str, dest: Path | None) -> str:
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE) if dest else None
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(BlobStream(self.backend, name, CHUNK),  # type: ignore[arg-type]
                                                               read_size=CHUNK)
            while chunk := reader.read(CHUNK):
                hasher.update(chunk)
                if out is not None:
                    write_all(out, chunk)
        except zstandard.ZstdError as exc:
            raise DamagedCheckpoint(f"image {entry.name}: object {self.backend.where(name)} cannot be "
                                    f"decompressed ({exc})") from exc
        finally:
            if out is not None:
                os.close(out)
        return hasher.hexdigest()

    def content(self, entry: FileEntry) -> bytes:
        """A small object's content in memory (a bundle's copy of it), checked against its
        hash: read under the manifest's codec first, then under the other."""
        if entry.hash in self.bundled:
            return bytes(self.bundled[entry.hash])
        for codec in codecs_from(entry.codec):
            try:
                data = self.backend.get(object_name(entry.hash, codec))
                if codec == "zstd":
                    if zstandard.frame_content_size(data) not in (entry.size, -1):
                        continue  # (zstd would take the frame's size over the limit below)
                    data = zstandard.ZstdDecompressor().decompress(data, max_output_size=bundles.MAX_OBJECT)
            except (BlobNotFound, DamagedCheckpoint, zstandard.ZstdError):
                continue
            if blake3.blake3(data).hexdigest() == entry.hash:
                return data
        raise DamagedCheckpoint(f"image {entry.name}: object {entry.hash[:16]}… is missing from the store or damaged")

    def hash_blob(self, name: str) -> str:
        """The BLAKE3 of a stored blob, read in ranges (locally, views of a mapping: no copy)."""
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with self.backend.reader() as reader:
            size = reader.size(name)
            for offset in range(0, size, HASH_CHUNK):
                with reader.read(name, offset, HASH_CHUNK) as view:
                    hasher.update(view)
        return hasher.hexdigest()

    def check_entry(self, entry: FileEntry, dest: Path | None = None, thorough: bool = False,  # noqa: PLR0913
                    holes: Sequence[tuple[int, int]] = (), check_holes: bool = True,
                    spool_dir: Path | None = None, checked: set[int] | None = None,
                    located: tuple[bytes, list[int]] | None = None, decoded: DecodedSegments | None = None
                    ) -> list[int] | None:
        """Checks one image (writing it to dest if given). For a pages image, returns the
        location of each of its pages; holes are page ranges checked but not written
        (check_holes=False, or a remote store: not checked here, see BlockStore.write_image);
        checked holds the segments found intact by the other images of the same layout,
        decoded some of them decoded (BlockStore.write_image).
        located: the page list to write (image_page_list: perhaps without some pages) and its
        locations, found already (BlockStore.locate_images); holes and the locations returned
        count the pages of that list."""
        if entry.kind == "pages":
            page_list, locations = located if located is not None else (self.load_page_list(entry), None)
            return self.blocks.write_image(entry.name, page_list, dest, check_ids=thorough,
                                           holes=holes, check_holes=check_holes and not self.remote,
                                           spool_dir=spool_dir, checked=checked, locations=locations,
                                           decoded=decoded)
        digest = self.read_into(entry, dest)
        if digest != entry.hash:
            raise DamagedCheckpoint(f"image {entry.name} is damaged: its content hash is {digest[:16]}…, "
                                    f"the manifest says {entry.hash[:16]}…")
        return None

    def image_page_list(self, entry: FileEntry, left_out: Sequence[tuple[int, int]] = ()) -> bytes:
        """A pages image's page list, without the pages of the left_out ranges: those are left
        out of the image altogether, neither checked nor written (CRIU reads them from the
        parent images directory, ckpt/restore/treeshare.py), the others one after the other."""
        page_list = self.load_page_list(entry)
        return without_pages(page_list, left_out) if left_out else page_list

    def iter_sizes(self) -> Iterator[int]:
        """The size of each object, pack, index file and bundle."""
        for prefix in (OBJECTS_PREFIX, *INDEX_AND_PACKS, bundles.BUNDLES_PREFIX):
            for info in self.backend.list(prefix):
                # (a pack adopted from a pages image may have holes: what it holds on disk)
                yield info.held if prefix == INDEX_AND_PACKS[0] else info.size

    def total_bytes(self) -> int:
        return sum(self.iter_sizes())


def _write_new(dest: Path, data: memoryview) -> None:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        write_all(out, data)
    finally:
        os.close(out)


def without_pages(page_list: bytes, ranges: Sequence[tuple[int, int]]) -> bytes:
    """The page list without the pages of these (first, count) ranges."""
    kept, at = [], 0
    for first, count in sorted(ranges):
        kept.append(page_list[at * ID_LEN:first * ID_LEN])
        at = max(at, first + count)
    kept.append(page_list[at * ID_LEN:])
    return b"".join(kept)
