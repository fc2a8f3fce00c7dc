"""Large pages images are hashed by two processes; the ids must be those of one."""

import os
import subprocess

import pytest
import xxhash

from ckpt.store import blocks
from ckpt.store.blocks import PAGE, BlockStore

SIZE = blocks.PARALLEL_HASH_MIN + 3 * PAGE  # an odd number of pages: the halves differ in size


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "pages-1.img"
    with open(path, "wb") as f:
        for _ in range(SIZE // (1 << 20)):
            f.write(os.urandom(1 << 20))
        f.write(os.urandom(SIZE % (1 << 20)))
    return path


def serial_ids(path, seed) -> bytes:
    data = path.read_bytes()
    return b"".join(xxhash.xxh3_128_digest(data[i:i + PAGE], seed) for i in range(0, len(data), PAGE))


def test_two_processes_hash_like_one(tmp_path, image, monkeypatch):
    forked = []
    real_fork = os.fork

    def recording_fork():
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(blocks.os, "fork", recording_fork)
    store = BlockStore(tmp_path / "blocks")
    page_lists, stats, _ = store.ingest([image], lambda _: "none")
    assert len(forked) == 1, "the second half was not hashed by a helper"
    assert page_lists[image.name] == serial_ids(image, store.seed)
    assert stats.new_pages == SIZE // PAGE
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # reaped by ingest


def test_a_failed_helper_is_replaced(tmp_path, image, monkeypatch):
    """A helper that dies without answering: this process hashes its half itself."""
    started = []

    def fork_that_fails():
        child = subprocess.Popen(["false"])
        started.append(child)  # kept: a collected Popen would reap its child itself
        return child.pid

    monkeypatch.setattr(blocks.os, "fork", fork_that_fails)
    store = BlockStore(tmp_path / "blocks")
    page_lists, _, _ = store.ingest([image], lambda _: "none")
    assert started, "the helper was not started"
    assert page_lists[image.name] == serial_ids(image, store.seed)
    with pytest.raises(ChildProcessError):
        os.waitpid(started[0].pid, os.WNOHANG)  # reaped by ingest



def compressible(pages: int) -> bytes:
    """Pages that zstd shrinks, each unlike the others (so none is deduplicated)."""
    return b"".join(k.to_bytes(8, "little") + os.urandom(24) + b"\0" * (PAGE - 32) for k in range(pages))


def test_segments_compressed_by_two_threads_read_back(tmp_path):
    image = tmp_path / "pages-1.img"
    image.write_bytes(compressible(256 * 20))  # 20 segments: compressed in two threads
    store = BlockStore(tmp_path / "blocks")
    page_lists, stats, _ = store.ingest([image], lambda _: "zstd")
    assert stats.new_pages == 256 * 20 and stats.bytes_new < image.stat().st_size // 10
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == image.read_bytes()


def test_a_next_dumps_scattered_pages_are_stored_in_one_thread(tmp_path, monkeypatch):
    """Every third page rewritten: 30 one-page segments, encoded here (a thread per segment
    costs more than compressing a page), read back byte for byte."""
    first = bytearray(compressible(90))
    store = BlockStore(tmp_path / "blocks")
    image = tmp_path / "pages-1.img"
    image.write_bytes(first)
    store.ingest([image], lambda _: "zstd")
    for page in range(0, 90, 3):
        first[page * PAGE:page * PAGE + 32] = os.urandom(32)
    image.write_bytes(first)

    def no_threads(*args, **kwargs):
        raise AssertionError("small segments were handed to threads")

    monkeypatch.setattr(blocks, "ThreadPoolExecutor", no_threads)
    page_lists, stats, _ = store.ingest([image], lambda _: "zstd")
    assert stats.new_pages == 30
    out = tmp_path / "out.img"
    store.write_image(image.name, page_lists[image.name], out, check_ids=True)
    assert out.read_bytes() == bytes(first)


def test_a_write_that_fails_midway_leaves_no_pack(tmp_path, monkeypatch):
    """A full disk while the segments are compressed ahead: the error comes out whole (the
    image's mapping still closes: no view of it is left in a thread), and no pack is left."""
    image = tmp_path / "pages-1.img"
    image.write_bytes(compressible(256 * 20))
    store = BlockStore(tmp_path / "blocks")
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

    monkeypatch.setattr(blocks, "open", opening, raising=False)
    with pytest.raises(OSError, match="No space left"):
        store.ingest([image], lambda _: "zstd")
    assert not list((tmp_path / "blocks").rglob("packs/*/*"))


def test_a_helper_reaped_by_someone_else_is_replaced(tmp_path, image, monkeypatch):
    """Its status cannot be known: this process hashes its half itself."""
    def fork_reaped_at_once():
        child = subprocess.Popen(["true"])
        child.wait()  # reaped here, as a SIGCHLD handler of an embedding program might
        return child.pid

    monkeypatch.setattr(blocks.os, "fork", fork_reaped_at_once)
    store = BlockStore(tmp_path / "blocks")
    page_lists, _, _ = store.ingest([image], lambda _: "none")
    assert page_lists[image.name] == serial_ids(image, store.seed)

