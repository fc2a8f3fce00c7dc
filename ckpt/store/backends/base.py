"""The storage backend interface: every byte the store writes or reads goes through it.

A backend holds named, immutable blobs ("checkpoints/<id>.json", "packs/ab/<pack>", ...; see
"Storage backends" in docs/design.md) and the store's lock. It is shaped for object storage
(restic's internal/backend, kopia's blob.Storage): whole-blob writes that appear atomically
under their name, ranged reads, listing by prefix, deletion, and an atomic create-if-absent
that is the commit point of a checkpoint. The repository (manifests, packs, index files,
objects, damage markers, prune, verify) is written against this interface only.
"""

from __future__ import annotations

import abc
import builtins
import re
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ckpt.system.files import write_all

# A name is a relative path of lower-case words ("packs/ab/<pack>", "checkpoints/<id>.json"):
# nothing unvalidated becomes a path (or a key). A component starting with "." is the
# backend's own (a write in progress).
_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$")


def check_name(name: str) -> str:
    if not _NAME_RE.match(name) or len(name) > 512:
        raise ValueError(f"invalid blob name {name!r}")
    return name


class BlobNotFound(FileNotFoundError):
    """No blob of that name."""


class BlobExists(FileExistsError):
    """put_if_absent found a blob of that name already (another writer committed first)."""


@dataclass(frozen=True)
class BlobInfo:
    name: str
    size: int
    # When the blob (or the unfinished write) was last written, seconds since the epoch by the
    # backend's clock (local: mtime; S3: the server's LastModified or upload start): what a
    # safety margin of garbage collection is measured against. Not part of equality.
    modified: float | None = field(default=None, compare=False)
    # Bytes the backend keeps of it where that is fewer than its size: a local pack adopted
    # from a pages image with the ranges no segment names punched out (PackWriter.commit).
    allocated: int | None = field(default=None, compare=False)

    @property
    def held(self) -> int:
        """What the blob takes in the store."""
        return self.size if self.allocated is None else min(self.size, self.allocated)


@dataclass(frozen=True)
class LockOwner:
    """Who holds (or held) the store's lock: enough to say whom a waiting command waits for,
    and, for lock objects, to tell a stale one (its process is gone, or it has not been
    refreshed for too long) from a live one."""

    pid: int
    host: str
    command: str
    since: str  # ISO 8601, UTC
    mode: str  # "shared" or "exclusive"

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}, since {self.since})"


class BlobWriter(abc.ABC):
    """A blob written piece by piece (a pack of a few GiB). Nothing is visible under the name
    until commit() returns; abort() (or leaving a `with` block on an error) drops it all."""

    written: int = 0

    @abc.abstractmethod
    def write(self, data) -> None: ...

    @abc.abstractmethod
    def commit(self) -> None:
        """Makes the blob durable and visible under its name (replacing one of that name)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drops what was written; never raises (it runs on the way out of errors, a full disk)."""

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()


class BufferedBlobWriter(BlobWriter):
    """A writer that holds the tail of what was written in a buffer until commit(), which hands
    it on once (_complete); abort() drops it (_drop). Both run at most once: a commit that fails
    aborts, and an abort after a commit or an abort does nothing."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._finished = False
        self.written = 0

    @abc.abstractmethod
    def _complete(self) -> None:
        """Sends the buffer and makes the blob visible (commit's own part)."""

    @abc.abstractmethod
    def _drop(self) -> None:
        """Drops what was sent so far; never raises (abort's own part)."""

    def commit(self) -> None:
        if self._finished:
            raise ValueError("commit of a finished blob writer")
        try:
            self._complete()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._buffer = bytearray()

    def abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._buffer = bytearray()
        self._drop()


# Bytes lent in place (RangeReader.lend): the view, and what to call once done with it.
Lent = tuple[memoryview, Callable[[], None]]


class RangeReader:
    """A reading session: ranged reads of a few blobs, many times each (a restore reads
    thousands of segments out of a few packs). This default asks the backend for each range;
    a backend may keep descriptors or mappings open until close()."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._sizes: dict[str, int] = {}

    def size(self, name: str) -> int:
        """The blob's size (BlobNotFound if there is none)."""
        if name not in self._sizes:
            self._sizes[name] = self._backend.stat(name).size
        return self._sizes[name]

    def read(self, name: str, offset: int, length: int) -> memoryview:
        """length bytes from offset (fewer where the blob ends). Release the view (use it in
        a `with` block) before close()."""
        return memoryview(self._backend.get(name, offset, length))

    def mapped(self, name: str) -> bool:
        """Whether read() gives a view of a local mapping of the blob: reading a range again
        costs nothing, and copy_to() copies without passing the bytes through Python."""
        return False

    def checked(self, name: str, offset: int, checksum: bytes) -> bool:
        """Whether this session already checked the bytes at offset of the blob against that
        checksum (a lazy restore's prefetch checks segments on its fetching threads)."""
        return False

    def lend(self, name: str, offset: int, length: int, checksum: bytes, pages: int) -> Lent | None:
        """The bytes at offset of the blob (a segment of a pack), already checked against that
        checksum, in place in a buffer of this session's (no copy), and the function to call
        once done with them (release the view first, and keep no other); or None: read()
        them. pages: how many of its pages the caller reads of them. This default has no
        such buffer."""
        return None

    def read_again(self, name: str) -> bool:
        """Called when bytes read from the blob failed their check: drops any local copy the
        session read them from (the cache of a remote store), so that its next reads come
        from the store itself. Whether there was one: only then can reading again tell damage
        in the copy from damage in the store. This default reads the store itself: False."""
        return False

    def read_again_intact(self, name: str) -> None:
        """Called when what read_again made read from the store passed its check: the damage
        was the local copy's alone (a cache tells the command, which tells the user)."""

    def copy_to(self, name: str, offset: int, length: int, fd: int) -> int:
        """Writes length bytes from offset to the file descriptor; returns how many there
        were (fewer where the blob ends)."""
        with self.read(name, offset, length) as view:
            write_all(fd, view)
            return len(view)

    def close(self) -> None:
        self._sizes.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BlobStream:
    """A blob as a readable binary stream, read range by range (decompressors read from it).
    Its end is where a read comes back short: its size is never asked (from S3, a request per
    object of a restore's layout)."""

    def __init__(self, backend: Backend, name: str, chunk: int = 4 << 20):
        self._backend, self._name, self._chunk = backend, name, chunk
        self._offset = 0
        self._ended = False

    def read(self, size: int = -1) -> bytes:
        if self._ended or size == 0:
            return b""
        if size is None or size < 0:
            data = self._backend.get(self._name, self._offset)
            self._ended = True
        else:
            data = self._backend.get(self._name, self._offset, size)
            self._ended = len(data) < size
        self._offset += len(data)
        return data

    def readable(self) -> bool:
        return True


class Backend(abc.ABC):
    """Named immutable blobs, and the store's lock.

    Blobs are written whole (put, put_file, writer) and appear atomically: a reader sees the
    complete blob under its name or nothing. Every write is durable when it returns. A name
    written again gets the same content (an object healed after damage) or, for the few
    mutable names (none today), a complete new content, never a mix. Errors: BlobNotFound,
    BlobExists, and OSError (a full disk: ENOSPC) for everything else; a remote backend
    raises the typed store errors of ckpt/errors.py instead (StoreUnreachable,
    StoreAccessDenied, StoreNotFound, DiskFull, StoreError)."""

    # ---- writing ---------------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Writes the blob, replacing any of that name, atomically and durably."""

    @abc.abstractmethod
    def put_if_absent(self, name: str, data: bytes) -> None:
        """Creates the blob atomically and durably, or raises BlobExists if one of that name
        exists: of two writers racing for a name, exactly one wins. The commit point of a
        checkpoint (local: link(2), which never replaces; S3: PutObject with If-None-Match: *)."""

    @abc.abstractmethod
    def put_file(self, name: str, source: Path) -> int:
        """Stores a local file as the blob (replacing any of that name) and returns its size.
        The file is consumed: the backend may move it instead of copying it (local: rename)."""

    def keeps_holes(self, source: Path) -> bool:
        """Whether put_file would take this file in as it is, holes and all (local: a rename
        within a filesystem that can punch holes), so that bytes punched out of it before
        are not in the blob either. Elsewhere it is copied (uploaded, encrypted), holes read
        as zeros."""
        return False

    @abc.abstractmethod
    def writer(self, name: str) -> BlobWriter:
        """A writer for a large blob, written in pieces (local: a temp file handed to
        writeback as it grows; S3: a multipart upload)."""

    # ---- reading ---------------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """The blob, or length bytes of it from offset (fewer where it ends)."""

    def get_view(self, name: str, offset: int, length: int,
                 allocate: Callable[[int], memoryview] | None = None) -> memoryview:
        """As get(name, offset, length), as a view: a backend may spare copies (the encrypted
        one decrypts into one buffer). With allocate(size) (a writable buffer of at least size
        bytes: a lazy restore's prefetch hands out buffers it uses again), the view is of the
        buffer it returned (here a copy into it: an encrypting backend decrypts into it)."""
        data = self.get(name, offset, length)
        if allocate is None:
            return memoryview(data)
        buffer = allocate(len(data))
        buffer[:len(data)] = data
        return buffer[:len(data)]

    def stored_span(self, name: str, offset: int, length: int) -> tuple[int, int]:
        """The bytes [start, end) of the store that get_view(name, offset, length) requests:
        the same bytes, unless the backend stores blobs transformed (EncryptedBackend reads
        whole sealed chunks). A lazy restore's prefetch ends its ranges where the store's
        parts end (see prefetch.plan_ranges)."""
        return offset, offset + length

    @abc.abstractmethod
    def get_file(self, name: str, dest: Path) -> None:
        """Writes the whole blob to a new local file dest (local: a hard link where it can)."""

    def get_sized(self, name: str, offset: int, length: int) -> tuple[bytes, int]:
        """get(name, offset, length), and the blob's whole size: known where the range was cut
        short by the blob's end, else asked (stat). A backend whose answer tells the size with
        the bytes (S3's Content-Range) overrides this to save that request."""
        data = self.get(name, offset, length)
        if 0 < len(data) < length:
            return data, offset + len(data)
        return data, self.stat(name).size

    def get_parts(self, name: str, part: int, sink: Callable[[int, bytes], None], offset: int = 0) -> int:
        """Reads the blob from offset to its end in consecutive parts of `part` bytes (the last
        one shorter), handing each to sink(its offset, its bytes); returns how many bytes it
        handed over (BlobNotFound if there is no blob). A backend may read several parts at
        once and call sink from several threads, in any order (S3: ranged GETs in parallel);
        it returns (or raises) only once no call of sink is running. This default reads the
        parts one after the other."""
        done = 0
        while True:
            data = self.get(name, offset + done, part)
            if data:
                sink(offset + done, data)
            done += len(data)
            if len(data) < part:
                return done

    @abc.abstractmethod
    def stat(self, name: str) -> BlobInfo: ...

    def exists(self, name: str) -> bool:
        try:
            self.stat(name)
        except BlobNotFound:
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str, incomplete: bool = False) -> list[BlobInfo]:
        """The blobs whose name starts with prefix, sorted by name. incomplete=True lists
        instead what writes that never finished left behind (temp files, unfinished uploads),
        which delete() accepts: only a caller holding the exclusive lock may delete them."""

    def reader(self) -> RangeReader:
        return RangeReader(self)

    def held_locally(self, name: str) -> bool:
        """Whether reading the blob costs no request to a remote store (a local directory, a
        cached copy): a lazy restore fetches ahead only the packs that are not."""
        return True

    def without_copies(self) -> Backend:
        """The store itself, past any local copies kept in front of it (a cache)."""
        return self

    def copy_room(self) -> int:
        """How large a blob's local copy may be for keep_copy to take it (a cache's cap; 0: none kept)."""
        return 0

    def keep_copy(self, name: str, path: Path) -> bool:
        """Takes a whole local copy of the blob made by the caller (a lazy restore's spool of a
        pack once every byte is down) as the copy kept in front of the store, moving it (the
        same filesystem); whether it did. This default keeps no copies."""
        return False

    def keep_whole(self, name: str) -> int:
        """Makes sure a whole local copy of the blob is kept in front of the store (a cache),
        downloading it whole (in parallel parts) if there is none: for a reader that is about
        to read most of it in many ranges (an eager restore from S3). Returns the bytes
        downloaded: 0 where the copy was there, or where no copies are kept (this default).
        Errors as for get; DamagedCheckpoint if the download fails its check; OSError if the
        copy cannot be kept."""
        return 0

    def drop_copy(self, name: str) -> bool:
        """Drops a local copy of the blob kept in front of the store (a cache) whose bytes
        failed their check, so that the next reads come from the store itself; whether there
        was one. The store's own blob is never touched. This default keeps no copies."""
        return False

    def copies_read_again(self) -> builtins.list[str]:
        """The blobs whose local copy this backend dropped as damaged and whose store bytes
        then passed the check, for the command to tell the user (RangeReader.read_again_intact)."""
        return []

    def where(self, name: str) -> str:
        """Where the blob lives, for messages (a path, a URL)."""
        return name

    # ---- deleting --------------------------------------------------------------------------

    @abc.abstractmethod
    def delete(self, names: builtins.list[str]) -> None:
        """Deletes the blobs (a missing one is not an error); durable when it returns, so a
        caller may order deletions (an index file before the packs it names)."""

    # ---- locking ---------------------------------------------------------------------------

    @abc.abstractmethod
    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> AbstractContextManager:
        """Holds the store's lock (shared or exclusive) for a `with` block; waits up to timeout
        seconds, calling on_wait(holders) once if it has to wait, then raises StoreBusy. A
        lock whose holder is gone never blocks anyone (local: flock dies with its process;
        lock objects: stale once their process is gone or they are not refreshed)."""

    def requests_in_flight(self) -> int:
        """How many requests for separate blobs are worth having in flight at once (callers
        reading or storing many small blobs, or small ranges of many, size their thread pools
        by it): 1 here, a local disk or page cache answers at once and the callers' own few
        threads suffice; more for a store a round trip away, whose requests mostly wait."""
        return 1

    def gc_margin(self) -> float:
        """Seconds during which an unreferenced blob may still be part of a write in progress
        and prune keeps it: 0 where locks cannot be lost (flock), more for lock objects."""
        return 0.0

    def now(self) -> float:
        """The backend's clock, which BlobInfo.modified is measured by."""
        return time.time()

    @abc.abstractmethod
    def lock_holders(self) -> builtins.list[LockOwner]:
        """The live holders of the lock (stale ones left out), this process excepted."""
