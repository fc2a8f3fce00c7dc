"""A checkpoint's small objects in one blob, for a store far away (see "Bundles" in docs/design.md).

A restore reads every object of its checkpoint before the tree runs: the image files (six or
so per process) and the page lists (one per process). From S3 each is a request: a 101-process
tree's 513 took 1.6 s of its 3.1 s restore from a server on this very host, 16 at a time, the
cost of the requests themselves (botocore, the server) rather than of their 5 MiB. A dump into
a remote store therefore also writes bundles/<checkpoint id>: the content of each of the
checkpoint's small objects, once, one after the other, compressed as one zstd frame, and its
manifest's `bundle` says where each one is. A restore downloads it in one request and takes
from it each object whose bytes match the BLAKE3 that names it. An object the bundle lacks,
or whose bytes do not match, or the whole bundle missing or damaged: read from objects/ as
before. The bundle is a copy for speed, never the only copy of anything.
"""

from __future__ import annotations

import threading
from typing import Sequence

import blake3
import zstandard

from ckpt.errors import CkptError
from ckpt.store.backends import Backend

BUNDLES_PREFIX = "bundles/"
# A larger object is one request's worth of bytes on its own (a 1 GiB process's page list is
# 4 MiB), and would be uploaded again by every dump that stores it once already.
MAX_OBJECT = 256 << 10
MAX_BYTES = 64 << 20  # what a restore holds in memory (a 101-process tree's: about 5 MiB)
# Fewer objects are one round of the restore's parallel requests (16 in flight): nothing won.
MIN_OBJECTS = 16
ZSTD_LEVEL = 3


def bundle_name(checkpoint_id: str) -> str:
    return f"{BUNDLES_PREFIX}{checkpoint_id}"


class BundleContents:
    """What a dump gathers for its bundle as it stores its objects (from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contents: dict[str, bytes] = {}  # by BLAKE3 of the content
        self.bytes = 0

    def wants(self, size: int) -> bool:
        return size <= MAX_OBJECT and self.bytes + size <= MAX_BYTES

    def add(self, digest: str, data: bytes) -> None:
        with self._lock:
            if digest in self.contents or not self.wants(len(data)):
                return
            self.contents[digest] = data
            self.bytes += len(data)


def write_bundle(backend: Backend, checkpoint_id: str, contents: dict[str, bytes],
                 hashes: Sequence[str]) -> tuple[dict | None, int]:
    """Writes the bundle of a checkpoint, those of contents its manifest's entries name (by
    hashes, in their order), durable once this returns: before its manifest. Returns the
    manifest's `bundle` and the bytes stored, or (None, 0) when a bundle would win nothing
    or could not be written (it is only a copy: the checkpoint is committed without it, and
    what a failed upload left is pruned)."""
    wanted = [digest for digest in dict.fromkeys(hashes) if digest in contents]
    if len(wanted) < MIN_OBJECTS:
        return None, 0
    spans: dict[str, list[int]] = {}
    at = 0
    for digest in wanted:
        spans[digest] = [at, len(contents[digest])]
        at += len(contents[digest])
    blob = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(contents[digest] for digest in wanted))
    name = bundle_name(checkpoint_id)
    try:
        backend.put(name, blob)
    except (CkptError, OSError):
        return None, 0
    return {"blob": name, "size": at, "spans": spans}, len(blob)


def read_bundle(backend: Backend, bundle: dict) -> dict[str, memoryview]:
    """The objects of a manifest's bundle whose bytes match their BLAKE3, by it; none when the
    bundle is missing, damaged, too large to hold or not a bundle (the objects are then read
    one by one: the bundle is only ever a copy)."""
    try:
        size, spans = int(bundle["size"]), bundle["spans"]
        if not 0 <= size <= MAX_BYTES or not isinstance(spans, dict):
            return {}
        blob = backend.get(str(bundle["blob"]))
        # (zstd takes a frame's own size over any limit: checked first, or a forged frame of a
        # few KiB could ask for gigabytes)
        if zstandard.frame_content_size(blob) != size:
            return {}
        content = memoryview(zstandard.ZstdDecompressor().decompress(blob))
    except Exception:  # noqa: BLE001 - only a copy: whatever is wrong with it, the objects are read
        return {}
    if len(content) != size:
        return {}
    found: dict[str, memoryview] = {}
    for digest, span in spans.items():
        try:
            offset, length = int(span[0]), int(span[1])
        except (TypeError, ValueError, IndexError):
            continue
        data = content[offset:offset + length]
        if offset >= 0 and len(data) == length and blake3.blake3(data).hexdigest() == digest:
            found[digest] = data
    return found
