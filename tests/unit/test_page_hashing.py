"""Page ids: computed in C (ckpt/_pagehash.c) without the GIL, byte for byte xxhash's; and
segments compressed by threads."""

import os

import pytest
import xxhash

from ckpt.store.backends import LocalBackend
from ckpt.store.blocks import blockstore as blocks
from ckpt.store.blocks.blockstore import PAGE, BlockStore


def serial_ids(data: bytes, seed: int) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(data[i:i + PAGE], seed) for i in range(0, len(data), PAGE))


def test_page_hashing_in_c_is_built():
    """`make setup` builds it; without it dumps hash in Python, correctly but three times slower."""
    assert blocks._page_ids_in_c is not None


@pytest.mark.parametrize("pages", [1, 4095, 2 * 4096 + 3])  # one thread; threads with uneven shares
@pytest.mark.parametrize("seed", [0, 2**64 - 1, 0x0123456789ABCDEF])
def test_ids_are_xxhashs(pages, seed, monkeypatch):
    data = os.urandom(pages * PAGE)
    want = serial_ids(data, seed)
    assert blocks.page_ids(data, seed) == want
    monkeypatch.setattr(blocks, "HASH_THREADS", 5)  # more threads than shares of 4096 pages
    assert blocks.page_ids(memoryview(data), seed) == want
    assert blocks.page_ids(data, seed, in_c=False) == want  # the fallback in Python


def test_a_mapped_image_is_hashed_where_it_lies(tmp_path):
    """The dump's case: a mapping of the image, mapped in by the hashing threads."""
    image = tmp_path / "pages-1.img"
    data = os.urandom(20000 * PAGE)
    image.write_bytes(data)
    store = BlockStore(LocalBackend(tmp_path / "blocks"))
    page_lists, stats, _ = store.ingest([image], lambda _: "none")
    assert page_lists[image.name] == serial_ids(data, store.seed)
    assert stats.new_pages == 20000
    # 80 MB: the pack was handed to writeback in stretches as it was written (PackWriter)
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == data


def test_a_buffer_that_is_not_whole_pages_is_refused():
    with pytest.raises(ValueError, match="whole number of pages"):
        blocks.page_ids(b"x" * 100, 0)


def compressible(pages: int) -> bytes:
    """Pages that zstd shrinks, each unlike the others (so none is deduplicated)."""
    return b"".join(k.to_bytes(8, "little") + os.urandom(24) + b"\0" * (PAGE - 32) for k in range(pages))


def test_segments_compressed_by_two_threads_read_back(tmp_path):
    image = tmp_path / "pages-1.img"
    image.write_bytes(compressible(256 * 20))  # 20 segments: compressed in two threads
    store = BlockStore(LocalBackend(tmp_path / "blocks"))
    page_lists, stats, _ = store.ingest([image], lambda _: "zstd")
    assert stats.new_pages == 256 * 20 and stats.bytes_new < image.stat().st_size // 10
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == image.read_bytes()


def rewrite_every_third_page(tmp_path, pages: int):
    """A block store holding an image, and the image with every third page rewritten since."""
    first = bytearray(compressible(pages))
    store = BlockStore(LocalBackend(tmp_path / "blocks"))
    image = tmp_path / "pages-1.img"
    image.write_bytes(first)
    store.ingest([image], lambda _: "zstd")
    for page in range(0, pages, 3):
        first[page * PAGE:page * PAGE + 32] = os.urandom(32)
    image.write_bytes(first)
    return store, image


def test_a_few_scattered_pages_are_stored_in_one_thread(tmp_path, monkeypatch):
    """30 one-page segments, fewer pages than a batch: encoded here, read back byte for byte."""
    store, image = rewrite_every_third_page(tmp_path, 90)

    def no_threads(*args, **kwargs):
        raise AssertionError("a single batch was handed to threads")

    monkeypatch.setattr(blocks, "ThreadPoolExecutor", no_threads)
    page_lists, stats, _ = store.ingest([image], lambda _: "zstd")
    assert stats.new_pages == 30
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == image.read_bytes()


def test_a_next_dumps_scattered_pages_go_to_threads_by_the_batch(tmp_path, monkeypatch):
    """1,000 one-page segments: handed to the threads in batches of BATCH_PAGES pages (one task
    per page cost more than compressing it), written in order, read back byte for byte."""
    store, image = rewrite_every_third_page(tmp_path, 3000)
    tasks = []
    real_pool = blocks.ThreadPoolExecutor

    class CountingPool(real_pool):
        def submit(self, fn, *args, **kwargs):
            tasks.append(len(args[0]))
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(blocks, "ThreadPoolExecutor", CountingPool)
    page_lists, stats, _ = store.ingest([image], lambda _: "zstd")
    assert stats.new_pages == 1000
    assert tasks == [blocks.BATCH_PAGES] * (1000 // blocks.BATCH_PAGES) + [1000 % blocks.BATCH_PAGES]
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == image.read_bytes()


def test_a_write_that_fails_midway_leaves_no_pack(tmp_path, monkeypatch):
    """A full disk while the segments are compressed ahead: the error comes out whole (the
    image's mapping still closes: no view of it is left in a thread), and no pack is left."""
    image = tmp_path / "pages-1.img"
    image.write_bytes(compressible(256 * 20))
    store = BlockStore(LocalBackend(tmp_path / "blocks"))
    real_open = open

    class FullDisk:
        def __init__(self, file):
            self.file, self.writes = file, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 5:
                raise OSError(28, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    def opening(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        return FullDisk(opened) if mode == "wb" else opened

    from ckpt.store.backends import local

    monkeypatch.setattr(local, "open", opening, raising=False)  # the backend writes the pack
    with pytest.raises(OSError, match="No space left"):
        store.ingest([image], lambda _: "zstd")
    assert not list((tmp_path / "blocks").rglob("packs/*/*"))


def test_a_page_that_does_not_match_its_id_is_named(tmp_path, monkeypatch):
    """`ckpt verify` rehashes every page: a segment whose checksum holds but whose pages are
    not the ones named (an index entry pointing elsewhere) is caught, at the right page."""
    image = tmp_path / "pages-1.img"
    data = os.urandom(40 * PAGE)
    image.write_bytes(data)
    store = BlockStore(LocalBackend(tmp_path / "blocks"))
    page_lists, _, _ = store.ingest([image], lambda _: "none")
    real_view = blocks._SegmentReader.view

    def swapped_page(self, key, within, count):
        with real_view(self, key, within, count) as pages:
            chunk = bytearray(pages)
        if within <= 7 < within + count:
            k = 7 - within
            chunk[k * PAGE:(k + 1) * PAGE] = data[8 * PAGE:9 * PAGE]
        return memoryview(bytes(chunk))

    monkeypatch.setattr(blocks._SegmentReader, "view", swapped_page)
    with pytest.raises(blocks.DamagedCheckpoint, match="page 7 does not match its id"):
        store.write_image(image.name, page_lists[image.name], None, check_ids=True)
    monkeypatch.setattr(blocks._SegmentReader, "view", real_view)
    store.write_image(image.name, page_lists[image.name], tmp_path / "out.img", check_ids=True)
    assert (tmp_path / "out.img").read_bytes() == data
