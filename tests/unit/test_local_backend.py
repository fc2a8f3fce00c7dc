"""The local directory backend (ckpt/store/backends/local.py): atomic and durable writes,
ranged reads, listing, deletion, and create-if-absent, the commit point of a checkpoint."""

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.store.backends import BlobExists, BlobNotFound, LocalBackend
from ckpt.store.backends import local as local_module


@pytest.fixture
def backend(tmp_path):
    return LocalBackend(tmp_path / "store")


def test_put_get_stat_and_ranges(backend):
    data = os.urandom(10000)
    backend.put("objects/ab/abcdef", data)
    path = backend.root / "objects" / "ab" / "abcdef"
    assert path.read_bytes() == data, "a blob is the file at its name (the on-disk format)"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert backend.get("objects/ab/abcdef") == data
    assert backend.get("objects/ab/abcdef", 100, 50) == data[100:150]
    assert backend.get("objects/ab/abcdef", 9990, 50) == data[9990:], "short where the blob ends"
    assert backend.stat("objects/ab/abcdef").size == 10000
    with backend.reader() as reader:
        assert reader.size("objects/ab/abcdef") == 10000
        with reader.read("objects/ab/abcdef", 4096, 100) as view:
            assert bytes(view) == data[4096:4196]
        out = os.open(backend.root / "copy", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            assert reader.copy_to("objects/ab/abcdef", 5000, 6000, out) == 5000
        finally:
            os.close(out)
    assert (backend.root / "copy").read_bytes() == data[5000:]
    with pytest.raises(BlobNotFound):
        backend.get("objects/ab/missing")
    with pytest.raises(BlobNotFound):
        backend.stat("objects/ab/missing")
    with backend.reader() as reader, pytest.raises(BlobNotFound):
        reader.size("packs/ab/missing")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a//b", "objects/.hidden", "", "a/../b", "./a"])
def test_names_that_are_not_blob_names_are_refused(backend, name):
    with pytest.raises(ValueError, match="invalid blob name"):
        backend.put(name, b"x")


def test_put_is_atomic_and_durable(backend, monkeypatch):
    """The bytes are fsynced before the rename, and the directory after it; a write that
    fails leaves neither a partial blob under the name nor a temp file."""
    calls = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", str(b))), real_rename(a, b))[1])
    backend.put("index/" + "a" * 64, b"index data")
    target = str(backend.root / "index" / ("a" * 64))
    kinds = [(kind, os.path.basename(path) if kind == "fsync" else path) for kind, path in calls]
    rename_at = kinds.index(("rename", target))
    assert any(kind == "fsync" and name.endswith(".tmp") for kind, name in kinds[:rename_at]), kinds
    assert ("fsync", "index") in kinds[rename_at:], "the directory is fsynced after the rename"

    def no_space(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    with pytest.raises(OSError, match="No space"):
        backend.put("index/" + "b" * 64, b"x" * 100)
    assert sorted(p.name for p in (backend.root / "index").iterdir()) == ["a" * 64]


def test_a_streamed_blob_appears_only_on_commit(backend):
    writer = backend.writer("packs/ab/abcd")
    writer.write(b"x" * (9 << 20))  # past the writeback stretch (8 MiB)
    writer.write(b"y" * 10)
    assert not backend.exists("packs/ab/abcd") and backend.list("packs/") == []
    assert [info.name.startswith("packs/ab/.abcd.") for info in backend.list("packs/", incomplete=True)] == [True]
    writer.commit()
    assert backend.stat("packs/ab/abcd").size == (9 << 20) + 10
    assert backend.list("packs/", incomplete=True) == []
    with backend.writer("packs/ab/other") as aborted:
        aborted.write(b"z" * 100)
        aborted.abort()
    with pytest.raises(RuntimeError), backend.writer("packs/ab/third") as failed:
        failed.write(b"z" * 100)
        raise RuntimeError("the dump failed")
    assert [info.name for info in backend.list("packs/")] == ["packs/ab/abcd"]
    assert backend.list("packs/", incomplete=True) == [], "an aborted writer leaves no temp file"


def test_list_by_prefix_names_and_sizes_and_leftovers(backend):
    backend.put("checkpoints/b.json", b"bb")
    backend.put("checkpoints/a.json", b"a")
    backend.put("objects/ab/abc.zst", b"xyz")
    backend.put("objects/cd/cde", b"")
    (backend.root / "objects" / "cd" / ".cdf.123-abc.tmp").write_bytes(b"partial")
    (backend.root / "tmp").mkdir()
    (backend.root / "tmp" / "checkpoints-like").write_bytes(b"not listed")
    assert [(i.name, i.size) for i in backend.list("checkpoints/")] == [("checkpoints/a.json", 1),
                                                                         ("checkpoints/b.json", 2)]
    assert [i.name for i in backend.list("objects/")] == ["objects/ab/abc.zst", "objects/cd/cde"]
    assert [i.name for i in backend.list("objects/c")] == ["objects/cd/cde"]
    assert [i.name for i in backend.list("index/")] == []
    leftovers = backend.list("objects/", incomplete=True)
    assert [(i.name, i.size) for i in leftovers] == [("objects/cd/.cdf.123-abc.tmp", 7)]
    backend.delete([i.name for i in leftovers] + ["checkpoints/a.json", "checkpoints/gone.json"])
    assert backend.list("objects/", incomplete=True) == []
    assert [i.name for i in backend.list("checkpoints/")] == ["checkpoints/b.json"]


def test_get_file_links_and_put_file_moves(backend, tmp_path):
    source = tmp_path / "core-1.img"
    source.write_bytes(b"core")
    assert backend.put_file("objects/aa/aabb", source) == 4
    assert not source.exists(), "the staged file was moved, not copied"
    dest = tmp_path / "restored.img"
    backend.get_file("objects/aa/aabb", dest)
    assert dest.read_bytes() == b"core"
    with pytest.raises(BlobNotFound):
        backend.get_file("objects/aa/missing", tmp_path / "other.img")


def test_put_if_absent_never_replaces(backend):
    backend.put_if_absent("checkpoints/x.json", b"first")
    with pytest.raises(BlobExists):
        backend.put_if_absent("checkpoints/x.json", b"second")
    assert backend.get("checkpoints/x.json") == b"first"
    assert [p.name for p in (backend.root / "checkpoints").iterdir()] == ["x.json"], "no temp file is left"


def test_a_lock_names_its_holder_and_goes_with_its_process(backend, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from ckpt.store.backends import LocalBackend\n"
         "with LocalBackend(Path(sys.argv[1])).lock(True, 5):\n"
         "    print('held', flush=True); time.sleep(60)\n", str(backend.root)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        heard = []
        from ckpt.errors import StoreBusy

        with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
            with backend.lock(False, 0.3, on_wait=heard.append):
                pass
        assert [[owner.pid for owner in owners] for owners in heard] == [[holder.pid]]
        assert heard[0][0].mode == "exclusive" and heard[0][0].host
    finally:
        holder.kill()
        holder.wait()
    with backend.lock(True, 5):  # the kernel released the flock of the dead process
        assert backend.lock_holders() == []
    assert list((backend.root / "holders").iterdir()) == [], "its stale record was removed"


def test_the_writer_hands_packs_to_writeback_as_it_goes(backend, monkeypatch):
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(local_module.os, "posix_fadvise",
                        lambda fd, offset, length, advice: (advised.append((offset, length)), real(fd, offset, length,
                                                                                                   advice))[1])
    with backend.writer("packs/ab/abcd") as writer:
        for _ in range(20):
            writer.write(b"p" * (1 << 20))
        writer.commit()
    assert advised == [(0, 8 << 20), (8 << 20, 8 << 20)]


def test_a_file_punched_out_and_moved_in_keeps_its_holes_only_on_the_stores_filesystem(backend, tmp_path):
    """keeps_holes: put_file renames a file of the store's filesystem in, holes and all (what
    a sparse adopted pack relies on); a file elsewhere (/dev/shm here) is copied, its holes
    read as zeros, so it is not one."""
    from ckpt.system.files import punch_out

    backend.put("objects/ab/first", b"x")  # the store's directory exists
    data = os.urandom(64 << 10)
    local = tmp_path / "pages.img"
    local.write_bytes(data)
    assert backend.keeps_holes(local)
    assert punch_out(local, [(4096, 8192), (32768, 4096)])
    assert backend.put_file("packs/ab/abcd", local) == len(data)
    stored = backend.root / "packs" / "ab" / "abcd"
    kept = stored.read_bytes()
    assert kept[4096:12288] == data[4096:12288] and kept[32768:36864] == data[32768:36864]
    assert kept[:4096] == bytes(4096) and kept[12288:32768] == bytes(20480) and kept[36864:] == bytes(len(data) - 36864)
    assert backend.stat("packs/ab/abcd").held <= 4 * 4096  # the 3 pages kept, and a block of slack at most
    if os.stat("/dev/shm").st_dev != os.stat(backend.root).st_dev:
        elsewhere = f"/dev/shm/ckpt-test-{os.getpid()}"
        try:
            with open(elsewhere, "wb") as f:
                f.write(data)
            assert not backend.keeps_holes(Path(elsewhere))
        finally:
            os.unlink(elsewhere)


def test_large_writes_reach_the_kernel_in_pieces(backend, monkeypatch):
    """A pack's segments, a cache copy's ranges, the spool: each write(2) takes at most
    WRITE_PIECE (the page cache builds a file of folios as large as its writes, and large
    ones cost 10-50 times more to fill here: ckpt/system/files.py), and the bytes arrive
    whole and in order, through the blob writer and through pwrite_all alike."""
    from ckpt.system import files

    sizes = []
    real_write, real_pwrite = os.write, os.pwrite

    def write(fd, data):
        sizes.append(len(data))
        return real_write(fd, data)

    def pwrite(fd, data, offset):
        sizes.append(len(data))
        return real_pwrite(fd, data, offset)

    class RecordedFile(io.FileIO):
        def write(self, data):
            sizes.append(len(data))
            return super().write(data)

    def recorded_open(fd, mode, buffering):  # the writer's buffered file, over a recorded one
        return io.BufferedWriter(RecordedFile(fd, mode), buffering)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(local_module, "open", recorded_open, raising=False)
    data = os.urandom(3 * files.WRITE_PIECE + 12345)
    with backend.writer("packs/ab/abcdef") as out:
        out.write(b"x" * 100)
        out.write(data)
        out.write(memoryview(data)[:5000])
        out.commit()
    assert backend.get("packs/ab/abcdef") == b"x" * 100 + data + data[:5000]
    fd = os.open(backend.root / "spool", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        files.pwrite_all(fd, data, 4096)
        files.write_all(fd, data)  # after the pwrite: at the file's own offset, 0
    finally:
        os.close(fd)
    # data at 4096 by pwrite_all, then data at 0 over it: data, then the last 4096 bytes of the first
    assert (backend.root / "spool").read_bytes() == data + data[-4096:]
    assert sizes and max(sizes) <= files.WRITE_PIECE, f"a write(2) of {max(sizes)} bytes"
    assert sum(sizes) == 100 + len(data) + 5000 + 2 * len(data), "every byte seen written once"
