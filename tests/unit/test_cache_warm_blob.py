"""CachingBackend.warm (the one blob of `ckpt cache warm`) over a real S3 server: a copy
downloaded once, then only marked as used; a remote blob that fails its check and one larger
than the cap never enter the cache."""

import os

import blake3
import pytest

from ckpt.errors import DamagedCheckpoint
from ckpt.store.backends.cache import CachingBackend
from ckpt.store.backends.s3 import S3Backend

MiB = 1 << 20


@pytest.fixture
def remote(s3_url):
    backend = S3Backend.from_url(s3_url, part_size=5 * MiB)
    yield backend
    backend.close()


def cached(remote, tmp_path, max_bytes=1 << 30) -> CachingBackend:
    return CachingBackend(remote, tmp_path / "cache", "s3://test/store", max_bytes)


def test_a_blob_is_downloaded_once_then_only_marked_used(remote, tmp_path):
    data = os.urandom(300_000)
    name = f"index/{blake3.blake3(data).hexdigest()}"
    pack = os.urandom(11 * MiB)  # more than one part: the download is parallel
    remote.put(name, data)
    remote.put("packs/ab/abcdef", pack)
    cache = cached(remote, tmp_path)
    assert cache.warm(name) == len(data) and cache.warm("packs/ab/abcdef") == len(pack)
    assert (cache.directory / "packs/ab/abcdef").read_bytes() == pack
    assert cache.usage() == len(data) + len(pack)
    old = 1_000_000_000
    os.utime(cache.directory / name, (old, old))
    again = cached(remote, tmp_path)  # another process: checks the copy, downloads nothing
    assert again.warm(name) == 0 and os.stat(again.directory / name).st_mtime > old
    assert again.usage() == len(data) + len(pack)


def test_a_damaged_or_too_large_blob_is_not_kept(remote, tmp_path):
    name = f"index/{blake3.blake3(b'what the name says').hexdigest()}"
    remote.put(name, b"something else")
    remote.put("packs/cd/cdef01", os.urandom(2 * MiB))
    cache = cached(remote, tmp_path, max_bytes=MiB)
    with pytest.raises(DamagedCheckpoint, match="does not hold what its name says"):
        cache.warm(name)
    with pytest.raises(OSError, match="larger than the cache's cap.*packs/cd/cdef01"):
        cache.warm("packs/cd/cdef01")
    assert [p for p in cache.directory.rglob("*") if p.is_file()] == []
    with pytest.raises(ValueError):
        cache.warm("checkpoints/20261130-230102-123-3fa9c1.json")  # never cached
