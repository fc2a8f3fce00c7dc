"""Encryption at rest: a Backend wrapper that encrypts and authenticates every blob on the
client (AES-256-GCM) and hides what names say (AES-SIV), over any inner backend (a local
directory, an S3 bucket). See "Encryption" in docs/design.md for the format byte by byte.

A blob is a header (magic, version, chunk size, a random 16-byte salt) followed by its
plaintext cut in fixed chunks (CHUNK, 256 KiB), each sealed on its own, so that a ranged read
fetches and decrypts only the chunks covering the range (restores read segments of packs of
several GiB). Each blob has its own subkey (HKDF of the master key and the salt); a chunk's
nonce is its index with a flag on the last one, and its associated data is the header and the
blob's logical name: a flipped byte, chunks reordered, a blob cut short at a chunk boundary or
one blob's content moved under another name all fail authentication, which raises DamagedBlob
naming the blob (a DamagedCheckpoint: the store records and heals damage as for a bad checksum).

A name keeps its first component (the kind: "packs", "objects", ...) and has the rest
encrypted deterministically (AES-SIV, the kind as associated data) and written in lower-case
base32 under a two-character fan-out directory: "packs/ab/<pack>" is stored as
"packs/<xy>/<xy...>", and list() decrypts names back. A name that does not decrypt under the
key (not written through this wrapper, or a name damaged on the server) is left out of
listings: it is not a blob of this repository.
"""

from __future__ import annotations

import base64
import builtins
import os
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ckpt.errors import DamagedBlob
from ckpt.store.backends.base import (Backend, BlobInfo, BlobWriter, BufferedBlobWriter, LockOwner, RangeReader,
                                      check_name)
from ckpt.system.files import new_file, pwrite_all, write_all

MAGIC = b"ckpE"
VERSION = 1
SALT_LEN = 16
# magic (4), version (1), log2 of the chunk size (1), reserved zeros (2), salt (16)
HEADER_LEN = 4 + 1 + 1 + 2 + SALT_LEN
TAG_LEN = 16
KEY_LEN = 32
# Plaintext bytes per sealed chunk. AES-GCM runs at 7-9 GB/s here on any chunk of 64 KiB to
# 4 MiB (AES-NI, VAES); 256 KiB was the fastest (9.4 GB/s sealing), keeps the Python work per
# chunk (a few us) near 1%, and bounds what a read of one page decrypts (about 30 us).
CHUNK = 256 << 10
INNER_NAMES = 4096  # inner names remembered (see _inner_name)
# Names longer than this (after the kind) are refused: their encrypted form would not fit a
# file name (255 bytes) on a local inner backend. The store's longest is about 75.
MAX_REST = 140
# Kinds that belong to the inner backend and stay readable there: key files (keys.py) and
# lock objects (s3.py).
RESERVED_KINDS = frozenset({"keys", "locks"})
# How many blob headers (salt, subkey) a backend keeps: ranged reads of a blob read its
# header once, not once per range.
HEADER_CACHE = 256
# Ranged reads by a reader: decrypted chunks kept (LRU) and, for reads that follow each other
# through a blob, chunks fetched ahead (doubling up to this many).
READER_CHUNKS = 32
READ_AHEAD = 16
COPY_BATCH = 64  # chunks per read of get_file and put_file: 16 MiB
FIRST_CHUNKS = 4  # chunks get_file asks for with the header (1 MiB): a smaller blob in one request


def _hkdf(master: bytes, length: int, info: bytes, salt: bytes | None = None) -> bytes:
    return HKDF(hashes.SHA256(), length, salt, info).derive(master)


def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode().rstrip("=").lower()


def _unb32(text: str) -> bytes:
    return base64.b32decode(text.upper() + "=" * (-len(text) % 8))


def _nonce(index: int, final: bool) -> bytes:
    return index.to_bytes(11, "big") + (b"\x01" if final else b"\x00")


class EncryptedBackend(Backend):
    """Blobs of `inner`, encrypted and authenticated under `master` (32 bytes; keys.py keeps it
    wrapped by passwords). key_id names the key file that unlocked it (None if the master key
    was given directly). chunk_size is for tests (small chunks exercise chunk boundaries); a
    repository is written and read with one chunk size (the header records it)."""

    def __init__(self, inner: Backend, master: bytes, *, key_id: str | None = None, chunk_size: int = CHUNK):
        if len(master) != KEY_LEN:
            raise ValueError("the master key is 32 bytes")
        if chunk_size < 1 or chunk_size & (chunk_size - 1) or chunk_size > 1 << 30:
            raise ValueError("the chunk size is a power of two")
        self.inner = inner
        self.master_key = master
        self.key_id = key_id
        self.chunk = chunk_size
        self._chunk_log2 = chunk_size.bit_length() - 1
        self._sealed = chunk_size + TAG_LEN
        self._names = AESSIV(_hkdf(master, 64, b"ckpt names v1"))
        self._headers: OrderedDict[str, tuple[bytes, AESGCM]] = OrderedDict()
        self._headers_lock = threading.Lock()
        self._inner_names: dict[str, str] = {}  # see _inner_name

    # ---- names -----------------------------------------------------------------------------

    def _inner_name(self, name: str) -> str:
        # Remembered (AES-SIV per call): a lazy restore's prefetch plan asks for a pack's twice
        # per segment (stored_span), 14 ms for a GiB's segments without this.
        known = self._inner_names.get(name)
        if known is not None:
            return known
        if len(self._inner_names) > INNER_NAMES:
            self._inner_names.clear()
        inner = self._inner_names[name] = self._encrypt_name(name)
        return inner

    def _encrypt_name(self, name: str) -> str:
        check_name(name)
        kind, _, rest = name.partition("/")
        if kind in RESERVED_KINDS:
            raise ValueError(f"invalid blob name {name!r}: {kind}/ belongs to the inner backend")
        if not rest:
            return name  # store.json, key: the kind alone says what they are
        if len(rest) > MAX_REST:
            raise ValueError(f"invalid blob name {name!r}: too long to encrypt")
        encoded = _b32(self._names.encrypt(rest.encode(), [kind.encode()]))
        return f"{kind}/{encoded[:2]}/{encoded}"

    def _logical_name(self, inner_name: str) -> str | None:
        """The name an inner name stands for; None if it is not one of ours."""
        parts = inner_name.split("/")
        if len(parts) == 1:
            return inner_name if inner_name not in RESERVED_KINDS else None
        if len(parts) != 3 or parts[0] in RESERVED_KINDS or parts[1] != parts[2][:2]:
            return None
        try:
            rest = self._names.decrypt(_unb32(parts[2]), [parts[0].encode()]).decode()
        except (InvalidTag, ValueError, UnicodeDecodeError):
            return None
        return f"{parts[0]}/{rest}"

    def where(self, name: str) -> str:
        head, _, last = name.rpartition("/")
        if last.startswith("."):
            try:
                return self.inner.where(self._inner_incomplete(name))
            except ValueError:
                return name
        return self.inner.where(self._inner_name(name))

    # ---- sizes -----------------------------------------------------------------------------

    def plain_size(self, stored: int) -> int:
        """The plaintext size of a blob of `stored` bytes. Lenient: a blob cut short gets the
        size of what is left (its reads fail authentication where it was cut)."""
        body = stored - HEADER_LEN
        if body < TAG_LEN:
            return 0
        full, rest = divmod(body, self._sealed)
        return full * self.chunk + max(0, rest - TAG_LEN)

    def stored_size(self, plain: int) -> int:
        return HEADER_LEN + plain + TAG_LEN * max(1, -(-plain // self.chunk))

    # ---- sealing ---------------------------------------------------------------------------

    def _new_header(self) -> tuple[bytes, AESGCM]:
        salt = os.urandom(SALT_LEN)
        header = MAGIC + bytes([VERSION, self._chunk_log2, 0, 0]) + salt
        return header, AESGCM(_hkdf(self.master_key, KEY_LEN, b"ckpt blob v1", salt))

    def _damaged(self, name: str, what: str) -> DamagedBlob:
        return DamagedBlob(f"blob {name} ({self.inner.where(self._inner_name(name))}) is damaged: {what}", name=name,
                           hint="run `ckpt verify`; a blob that fails authentication was changed, cut short or "
                                "moved from another name on the storage, or belongs to another repository")

    def _open_header(self, name: str, header: bytes) -> AESGCM:
        if len(header) < HEADER_LEN:
            raise self._damaged(name, "shorter than its header")
        if header[:4] != MAGIC:
            raise self._damaged(name, "not an encrypted blob of ckpt (bad magic)")
        if header[4] != VERSION:
            raise self._damaged(name, f"written in encryption format {header[4]}, which this ckpt does not read")
        if header[5] != self._chunk_log2:
            raise self._damaged(name, f"written with chunks of 2^{header[5]} bytes, not 2^{self._chunk_log2}")
        return AESGCM(_hkdf(self.master_key, KEY_LEN, b"ckpt blob v1", bytes(header[8:HEADER_LEN])))

    def _cached_header(self, name: str) -> tuple[bytes, AESGCM] | None:
        with self._headers_lock:
            found = self._headers.get(name)
            if found is not None:
                self._headers.move_to_end(name)
            return found

    def _remember_header(self, name: str, header: bytes, aead: AESGCM) -> None:
        with self._headers_lock:
            self._headers[name] = (header, aead)
            while len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)

    def _forget_header(self, name: str) -> None:
        with self._headers_lock:
            self._headers.pop(name, None)

    def _seal_all(self, name: str, data) -> bytes:
        header, aead = self._new_header()
        aad = header + name.encode()
        view = memoryview(data).cast("B")
        count = max(1, -(-len(view) // self.chunk))
        pieces = [header]
        for index in range(count):
            pieces.append(aead.encrypt(_nonce(index, index == count - 1),
                                       view[index * self.chunk:(index + 1) * self.chunk], aad))
        return b"".join(pieces)

    def _open_chunks(self, name: str, aead: AESGCM, aad: bytes, sealed, first: int, ends: bool) -> list[bytes]:
        """Decrypts consecutive sealed chunks, the first of index `first`; `ends`: the last of
        them is the blob's last (sealed as final)."""
        out = []
        # Views released on every way out: a traceback keeping one alive would keep a local
        # reader's mapping from closing.
        with memoryview(sealed) as view:
            count = -(-len(view) // self._sealed)
            for i in range(count):
                index = first + i
                with view[i * self._sealed:(i + 1) * self._sealed] as piece:
                    if len(piece) < TAG_LEN:
                        raise self._damaged(name, f"cut short in chunk {index} (at byte {index * self.chunk})")
                    try:
                        out.append(aead.decrypt(_nonce(index, ends and i == count - 1), piece, aad))
                    except InvalidTag:
                        pass
                    else:
                        continue
                cut = " or the blob was cut short there" if ends and i == count - 1 else ""
                raise self._damaged(name, f"chunk {index} (at byte {index * self.chunk}) fails authentication{cut}")
        return out

    # ---- writing ---------------------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        inner_name = self._inner_name(name)
        self._forget_header(name)
        self.inner.put(inner_name, self._seal_all(name, data))

    def put_if_absent(self, name: str, data: bytes) -> None:
        inner_name = self._inner_name(name)
        self.inner.put_if_absent(inner_name, self._seal_all(name, data))

    def put_file(self, name: str, source: Path) -> int:
        with open(source, "rb") as src, self.writer(name) as out:
            while piece := src.read(COPY_BATCH * self.chunk):
                out.write(piece)
            out.commit()
        os.unlink(source)  # consumed, as the other backends consume it
        return out.written

    def writer(self, name: str) -> BlobWriter:
        inner_name = self._inner_name(name)
        self._forget_header(name)
        return _EncryptedWriter(self, name, self.inner.writer(inner_name))

    # ---- reading ---------------------------------------------------------------------------

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        inner_name = self._inner_name(name)
        if length is not None and length <= 0:
            self.inner.stat(inner_name)  # BlobNotFound as for any other read
            return b""
        if offset == 0 and length is None:
            return self._get_whole(name, inner_name)
        try:
            return self._get_range(name, inner_name, offset, length, self._cached_header(name))
        except DamagedBlob:
            # A header remembered from a blob written again since (an object healed by
            # another process): read it afresh once before calling the blob damaged.
            if self._cached_header(name) is None:
                raise
            self._forget_header(name)
            return self._get_range(name, inner_name, offset, length, None)

    def _get_whole(self, name: str, inner_name: str) -> bytes:
        sealed = memoryview(self.inner.get(inner_name))
        header = bytes(sealed[:HEADER_LEN])
        aead = self._open_header(name, header)
        body = sealed[HEADER_LEN:]
        if not body:
            raise self._damaged(name, "it has no chunk (cut short after its header)")
        return b"".join(self._open_chunks(name, aead, header + name.encode(), body, 0, True))

    def _get_range(self, name: str, inner_name: str, offset: int, length: int | None,
                   cached: tuple[bytes, AESGCM] | None) -> bytes:
        first = offset // self.chunk
        start = HEADER_LEN + first * self._sealed
        # One byte past the last chunk asked: whether anything follows tells whether that
        # chunk must be the blob's final one.
        want = None if length is None else (((offset + length - 1) // self.chunk - first + 1) * self._sealed + 1)
        if cached is None and first == 0:
            data = memoryview(self.inner.get(inner_name, 0, None if want is None else want + HEADER_LEN))
            if len(data) == 0:
                raise self._damaged(name, "it is empty")
            header = bytes(data[:HEADER_LEN])
            aead = self._open_header(name, header)
            self._remember_header(name, header, aead)
            data = data[HEADER_LEN:]
        else:
            header, aead = self._header(name, inner_name, cached)
            data = memoryview(self.inner.get(inner_name, start, want))
        if not data:
            if first == 0:
                raise self._damaged(name, "it has no chunk (cut short after its header)")
            return b""  # at or past the end
        ends = want is None or len(data) < want
        if not ends:
            data = data[:-1]
        plain = self._open_chunks(name, aead, header + name.encode(), data, first, ends)
        joined = plain[0] if len(plain) == 1 else b"".join(plain)
        skip = offset - first * self.chunk
        return joined[skip:] if length is None else joined[skip:skip + length]

    def _header(self, name: str, inner_name: str, cached: tuple[bytes, AESGCM] | None) -> tuple[bytes, AESGCM]:
        """The blob's header and its key's cipher: as remembered, or read (and remembered)."""
        if cached is not None:
            return cached
        header = self.inner.get(inner_name, 0, HEADER_LEN)
        aead = self._open_header(name, header)
        self._remember_header(name, header, aead)
        return header, aead

    def get_view(self, name: str, offset: int, length: int,
                 allocate: Callable[[int], memoryview] | None = None) -> memoryview:
        """As get, the chunks decrypted straight into one buffer (no join, no slice copied):
        a lazy restore's prefetch reads a GiB this way, range by range, on several threads.
        allocate: as Backend.get_view (the chunks are decrypted into the buffer it returns)."""
        inner_name = self._inner_name(name)
        if length <= 0:
            return memoryview(self.get(name, offset, length))
        try:
            return self._get_view(name, inner_name, offset, length, self._cached_header(name), allocate)
        except DamagedBlob:
            if self._cached_header(name) is None:  # as in get: a header remembered from an older blob
                raise
            self._forget_header(name)
            return self._get_view(name, inner_name, offset, length, None, allocate)

    def stored_span(self, name: str, offset: int, length: int) -> tuple[int, int]:
        first = offset // self.chunk
        want = ((offset + length - 1) // self.chunk - first + 1) * self._sealed + 1  # as _get_view
        return self.inner.stored_span(self._inner_name(name), HEADER_LEN + first * self._sealed, want)

    def _get_view(self, name: str, inner_name: str, offset: int, length: int,  # noqa: PLR0913
                  cached: tuple[bytes, AESGCM] | None,
                  allocate: Callable[[int], memoryview] | None) -> memoryview:
        header, aead = self._header(name, inner_name, cached)
        first = offset // self.chunk
        want = ((offset + length - 1) // self.chunk - first + 1) * self._sealed + 1  # one byte more: see _get_range
        sealed = memoryview(self.inner.get(inner_name, HEADER_LEN + first * self._sealed, want))
        if not sealed:
            if first == 0:
                raise self._damaged(name, "it has no chunk (cut short after its header)")
            return memoryview(b"")
        ends = len(sealed) < want
        if not ends:
            sealed = sealed[:-1]
        plain = memoryview(bytearray(len(sealed))) if allocate is None else allocate(len(sealed))
        aad = header + name.encode()
        size = 0
        with sealed, plain[:len(sealed)] as out:
            count = -(-len(sealed) // self._sealed)
            for i in range(count):
                index, final = first + i, ends and i == count - 1
                with sealed[i * self._sealed:(i + 1) * self._sealed] as piece:
                    if len(piece) < TAG_LEN:
                        raise self._damaged(name, f"cut short in chunk {index} (at byte {index * self.chunk})")
                    try:
                        aead.decrypt_into(_nonce(index, final), piece, aad, out[size:size + len(piece) - TAG_LEN])
                    except InvalidTag:
                        cut = " or the blob was cut short there" if final else ""
                        raise self._damaged(
                            name, f"chunk {index} (at byte {index * self.chunk}) fails authentication{cut}") from None
                    size += len(piece) - TAG_LEN
        skip = offset - first * self.chunk
        return plain[skip:min(size, skip + length)]

    def get_file(self, name: str, dest: Path) -> None:
        """The ciphertext is read in parts of whole sealed chunks (S3: ranged GETs in parallel),
        each decrypted as it arrives and written at its place in dest: no sealed copy on disk
        and no second pass (through a sealed temp file it reached 0.6-0.85 of bare boto3's
        download_file from SeaweedFS; now about as fast: docs/design.md, "Cost"). The first
        request asks for the header and FIRST_CHUNKS chunks: a blob no larger (an image's
        object, most index files) comes in that one request, and a larger one's size with it
        (get_sized: a restore from S3 asked for each object its size, its header, then its
        chunks; then for a larger blob its size after its first chunks)."""
        inner_name = self._inner_name(name)
        first_end = HEADER_LEN + FIRST_CHUNKS * self._sealed
        # (its size told with it: a larger blob's next requests are planned without a HEAD)
        head_bytes, stored = self.inner.get_sized(inner_name, 0, first_end + 1)  # BlobNotFound before dest is made
        head = memoryview(head_bytes)
        header = bytes(head[:HEADER_LEN])
        aead = self._open_header(name, header)
        aad = header + name.encode()
        if len(head) <= first_end:  # the whole blob
            if len(head) - HEADER_LEN < TAG_LEN:
                raise self._damaged(name, "it has no chunk (cut short after its header)")
            with new_file(dest) as fd:
                for piece in self._open_chunks(name, aead, aad, head[HEADER_LEN:], 0, True):
                    write_all(fd, piece)
            return
        decrypt = self._chunk_writer(name, aead, aad, -(-(stored - HEADER_LEN) // self._sealed))
        with new_file(dest) as fd:
            decrypt(fd, HEADER_LEN, head[HEADER_LEN:first_end])
            got = self.inner.get_parts(inner_name, COPY_BATCH * self._sealed,
                                       lambda offset, sealed: decrypt(fd, offset, sealed), first_end)
            if got != stored - first_end:  # immutable: a blob changed in between is damaged
                raise self._damaged(name, f"{first_end + got} bytes read, {stored} expected")

    def _chunk_writer(self, name: str, aead: AESGCM, aad: bytes, count: int) -> Callable[[int, int, object], None]:
        """writer(fd, offset, sealed): decrypts whole sealed chunks read at offset of the blob
        (of count chunks) and writes them at their place in fd; safe from several threads."""
        buffers = threading.local()  # a plaintext buffer per reading thread, reused

        def decrypt(fd: int, offset: int, sealed) -> None:
            first = (offset - HEADER_LEN) // self._sealed
            plain = getattr(buffers, "plain", None)
            if plain is None:
                plain = buffers.plain = bytearray(COPY_BATCH * self.chunk)
            size = 0
            with memoryview(sealed) as view, memoryview(plain) as out:
                for at in range(0, len(view), self._sealed):
                    index = first + at // self._sealed
                    piece = view[at:at + self._sealed]
                    if len(piece) < TAG_LEN:
                        raise self._damaged(name, f"cut short in chunk {index} (at byte {index * self.chunk})")
                    try:
                        aead.decrypt_into(_nonce(index, index == count - 1), piece, aad,
                                          out[size:size + len(piece) - TAG_LEN])
                    except InvalidTag:
                        cut = " or the blob was cut short there" if index == count - 1 else ""
                        raise self._damaged(
                            name, f"chunk {index} (at byte {index * self.chunk}) fails authentication{cut}") from None
                    size += len(piece) - TAG_LEN
                pwrite_all(fd, out[:size], first * self.chunk)

        return decrypt

    def held_locally(self, name: str) -> bool:
        return self.inner.held_locally(self._inner_name(name))

    def stat(self, name: str) -> BlobInfo:
        info = self.inner.stat(self._inner_name(name))
        return BlobInfo(name, self.plain_size(info.size), info.modified)

    def exists(self, name: str) -> bool:
        return self.inner.exists(self._inner_name(name))

    def list(self, prefix: str, incomplete: bool = False) -> builtins.list[BlobInfo]:
        kind, slash, _ = prefix.partition("/")
        if kind in RESERVED_KINDS and slash:
            return []
        found = []
        for info in self.inner.list(f"{kind}/" if slash else prefix, incomplete):
            if incomplete:
                name = self._logical_incomplete(info.name)
            else:
                name = self._logical_name(info.name)
                if name is not None and "/" not in name and self.plain_size(info.size) == 0 \
                        and info.size != self.stored_size(0):
                    name = None  # a top-level file of the inner backend's own (local: lock)
            if name is not None and name.startswith(prefix):
                found.append(BlobInfo(name, self.plain_size(info.size), info.modified))
        return sorted(found, key=lambda info: info.name)

    # An unfinished write of the inner backend is "<kind>/<xy>/.<encrypted name>.<suffix>"
    # (local: "<pid>-<rand>.tmp"; S3: "<upload id>.upload"). It is listed as
    # "<logical dir>/.<logical last>.<suffix in base32>", which delete() turns back.

    def _logical_incomplete(self, inner_name: str) -> str | None:
        head, _, last = inner_name.rpartition("/")
        if not last.startswith("."):
            return None
        encoded, dot, suffix = last[1:].partition(".")
        name = self._logical_name(f"{head}/{encoded}") if dot else None
        if name is None:
            return None
        logical_head, _, logical_last = name.rpartition("/")
        return f"{logical_head}/.{logical_last}.{_b32(suffix.encode())}"

    def _inner_incomplete(self, name: str) -> str:
        head, _, last = name.rpartition("/")
        blob, _, token = last[1:].rpartition(".")
        if not head or not blob:
            raise ValueError(f"invalid blob name {name!r}")
        try:
            suffix = _unb32(token).decode()
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"invalid blob name {name!r}") from None
        inner_head, _, encoded = self._inner_name(f"{head}/{blob}").rpartition("/")
        return f"{inner_head}/.{encoded}.{suffix}"

    def reader(self) -> RangeReader:
        return _EncryptedReader(self)

    # ---- deleting --------------------------------------------------------------------------

    def delete(self, names: builtins.list[str]) -> None:
        inner_names = []
        for name in names:
            if name.rpartition("/")[2].startswith("."):
                inner_names.append(self._inner_incomplete(name))
            else:
                inner_names.append(self._inner_name(name))
                self._forget_header(name)
        self.inner.delete(inner_names)

    # ---- locking: the inner backend's ------------------------------------------------------

    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> AbstractContextManager:
        return self.inner.lock(exclusive, timeout, on_wait)

    def lock_holders(self) -> builtins.list[LockOwner]:
        return self.inner.lock_holders()

    def requests_in_flight(self) -> int:
        return self.inner.requests_in_flight()

    def gc_margin(self) -> float:
        return self.inner.gc_margin()

    def now(self) -> float:
        return self.inner.now()

    def close(self) -> None:
        closer = getattr(self.inner, "close", None)
        if closer is not None:
            closer()


class _EncryptedWriter(BufferedBlobWriter):
    """Seals the plaintext chunk by chunk into the inner writer (memory: one chunk). The last
    whole chunk is held back until more data comes or commit() says it is the final one."""

    def __init__(self, backend: EncryptedBackend, name: str, inner: BlobWriter):
        super().__init__()
        self._backend = backend
        self._inner = inner
        self._header, self._aead = backend._new_header()
        self._aad = self._header + name.encode()
        self._index = 0
        try:
            inner.write(self._header)
        except BaseException:
            inner.abort()
            raise

    def _seal(self, data, final: bool) -> None:
        self._inner.write(self._aead.encrypt(_nonce(self._index, final), data, self._aad))
        self._index += 1

    def write(self, data) -> None:
        if self._finished:
            raise ValueError("write to a finished blob writer")
        view = memoryview(data).cast("B")
        self.written += len(view)
        chunk = self._backend.chunk
        if self._buffer:
            need = chunk - len(self._buffer)
            self._buffer += view[:need]
            view = view[need:]
            if not view:
                return
            self._seal(self._buffer, False)
            self._buffer.clear()
        while len(view) > chunk:
            self._seal(view[:chunk], False)
            view = view[chunk:]
        self._buffer += view

    def _complete(self) -> None:
        self._seal(self._buffer, True)
        self._inner.commit()

    def _drop(self) -> None:
        self._inner.abort()


class _EncryptedReader(RangeReader):
    """Ranged reads through the inner backend's reader (local: views of a mapping, decrypted
    without a copy), chunks decrypted once and kept (LRU), and chunks fetched ahead when reads
    follow each other through a blob (a restore reading a pack's segments in order)."""

    def __init__(self, backend: EncryptedBackend):
        super().__init__(backend)
        self._enc = backend
        self._inner = backend.inner.reader()
        self._stored: dict[str, int] = {}
        self._aeads: dict[str, tuple[bytes, AESGCM]] = {}
        self._chunks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._next: dict[str, tuple[int, int]] = {}  # name -> (the chunk after the last read, run)

    def _stored_size(self, name: str) -> int:
        if name not in self._stored:
            self._stored[name] = self._inner.size(self._enc._inner_name(name))
        return self._stored[name]

    def size(self, name: str) -> int:
        return self._enc.plain_size(self._stored_size(name))

    def _aead(self, name: str) -> tuple[bytes, AESGCM]:
        found = self._aeads.get(name)
        if found is None:
            with self._inner.read(self._enc._inner_name(name), 0, HEADER_LEN) as view:
                header = bytes(view)
            found = self._aeads[name] = (header, self._enc._open_header(name, header))
        return found

    def _fetch(self, name: str, first: int, last: int) -> dict[int, bytes]:
        """Decrypts chunks first..last (within the blob), keeping the last ones in the cache."""
        enc = self._enc
        stored = self._stored_size(name)
        count = max(1, -(-(stored - HEADER_LEN) // enc._sealed))  # chunks in the blob
        header, aead = self._aead(name)
        start = HEADER_LEN + first * enc._sealed
        end = min(stored, HEADER_LEN + (last + 1) * enc._sealed)
        with self._inner.read(enc._inner_name(name), start, end - start) as view:
            plain = enc._open_chunks(name, aead, header + name.encode(), view, first, last >= count - 1)
        fetched = {first + i: data for i, data in enumerate(plain)}
        for index in list(fetched)[-READER_CHUNKS:]:
            self._chunks[(name, index)] = fetched[index]
            self._chunks.move_to_end((name, index))
        while len(self._chunks) > READER_CHUNKS:
            self._chunks.popitem(last=False)
        return fetched

    def read(self, name: str, offset: int, length: int) -> memoryview:
        enc = self._enc
        end = min(offset + length, self.size(name))
        if end <= offset:
            return memoryview(b"")
        first, last = offset // enc.chunk, (end - 1) // enc.chunk
        cached = {i: self._chunks.get((name, i)) for i in range(first, last + 1)}
        missing = [i for i, data in cached.items() if data is None]
        have = {i: data for i, data in cached.items() if data is not None}
        expected, run = self._next.get(name, (-1, 0))
        if missing:
            count = max(1, -(-(self._stored_size(name) - HEADER_LEN) // enc._sealed))
            run = min(run * 2 or 1, READ_AHEAD) if missing[0] == expected else 0
            fetched = self._fetch(name, missing[0], min(count - 1, max(missing[-1], missing[0] + run)))
            have.update((i, fetched[i]) for i in missing)
        self._next[name] = (last + 1, run)
        pieces = [have[i] for i in range(first, last + 1)]
        skip = offset - first * enc.chunk
        if len(pieces) == 1:
            return memoryview(pieces[0])[skip:skip + end - offset]
        return memoryview(b"".join(pieces))[skip:skip + end - offset]

    def copy_to(self, name: str, offset: int, length: int, fd: int) -> int:
        copied = 0
        chunk = self._enc.chunk
        while copied < length:
            # A chunk at a time: views of decrypted chunks, never joined.
            at = offset + copied
            step = min(length - copied, chunk - at % chunk)
            with self.read(name, at, step) as view:
                write_all(fd, view)
                got = len(view)
            copied += got
            if got < step:
                break  # the blob ends
        return copied

    def close(self) -> None:
        self._inner.close()
        self._chunks.clear()
        self._aeads.clear()
        self._stored.clear()
        super().close()

