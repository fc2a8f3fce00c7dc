"""Backend conformance: the same tests against every implementation of the storage backend
interface (ckpt/store/backends): the local directory, S3 (a real SeaweedFS server,
tests/s3server.py), each also under the encryption wrapper (encrypted.py, "enc:<spec>"), and
S3 behind the local cache (CachingBackend, "cached:<dir>|<url>"). What the store relies on:
whole blobs appear atomically, ranged reads, listing by prefix across pages, deletion,
create-if-absent with one winner, streamed writes visible only on commit, and a lock that
excludes and goes stale with its holder."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.errors import StoreBusy
from ckpt.store.backends import BlobExists, BlobNotFound, LocalBackend

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

OPEN = """
import sys
def open_backend(spec, **options):
    if spec.startswith("memory:"):
        from ckpt.store.backends.memory import MemoryBackend
        return MemoryBackend(spec)
    if spec.startswith("enc:"):
        from ckpt.store.backends.encrypted import EncryptedBackend
        return EncryptedBackend(open_backend(spec[4:], **options), bytes(range(32)))
    if spec.startswith("cached:"):  # cached:<cache dir>|s3://...
        from pathlib import Path
        from ckpt.store.backends.cache import CachingBackend
        directory, _, url = spec[len("cached:"):].partition("|")
        return CachingBackend(open_backend(url, **options), Path(directory), url, 1 << 30)
    if spec.startswith("s3://"):
        from ckpt.store.backends.s3 import S3Backend
        return S3Backend.from_url(spec, **options)
    from pathlib import Path
    from ckpt.store.backends import LocalBackend
    return LocalBackend(Path(spec))
"""
namespace: dict = {}
exec(OPEN, namespace)
open_backend = namespace["open_backend"]


def run_script(body: str, *args: str, **popen) -> subprocess.Popen:
    if args and args[0].startswith("memory:"):
        pytest.skip("a memory backend lives in one process: another process cannot open it by its spec")
    return subprocess.Popen([sys.executable, "-c", OPEN + body, *args], cwd=REPO, **popen)


@pytest.fixture(params=["local", "s3", "enc-local", "enc-s3", "cached", "memory"])
def spec(request, tmp_path):
    if request.param == "memory":
        return f"memory://{tmp_path.name}"
    if request.param == "cached":
        return f"cached:{tmp_path / 'cache'}|{request.getfixturevalue('s3_url')}"
    encrypted = "enc:" if request.param.startswith("enc-") else ""
    if request.param.endswith("local"):
        return encrypted + str(tmp_path / "store")
    return encrypted + request.getfixturevalue("s3_url")


def remote(spec: str) -> bool:
    return "s3://" in spec


@pytest.fixture
def backend(spec):
    # Small parts: a few MiB exercise multipart uploads and parallel ranged reads.
    opened = open_backend(spec, part_size=5 * MiB) if remote(spec) else open_backend(spec)
    yield opened
    if hasattr(opened, "close"):
        opened.close()


def raw(backend):
    """The backend under the encryption wrapper, if any."""
    return getattr(backend, "inner", backend)


def is_s3(backend) -> bool:
    return not isinstance(raw(backend), LocalBackend)


def test_put_get_stat_and_ranges(backend, tmp_path):
    data = os.urandom(10000)
    backend.put("objects/ab/abcdef", data)
    assert backend.get("objects/ab/abcdef") == data
    assert backend.get("objects/ab/abcdef", 100, 50) == data[100:150]
    assert backend.get("objects/ab/abcdef", 9990, 50) == data[9990:], "short where the blob ends"
    assert backend.get("objects/ab/abcdef", 10000, 50) == b"", "nothing past the end"
    assert backend.get("objects/ab/abcdef", 20000) == b""
    assert backend.get("objects/ab/abcdef", 5000) == data[5000:]
    assert backend.get("objects/ab/abcdef", 0, 0) == b""
    info = backend.stat("objects/ab/abcdef")
    assert info.size == 10000 and abs(info.modified - time.time()) < 120
    assert backend.exists("objects/ab/abcdef") and not backend.exists("objects/ab/missing")
    for read in (lambda: backend.get("objects/ab/missing"), lambda: backend.get("objects/ab/missing", 5, 5),
                 lambda: backend.stat("objects/ab/missing"),
                 lambda: backend.get_file("objects/ab/missing", tmp_path / "x.img")):
        with pytest.raises(BlobNotFound):
            read()
    assert not (tmp_path / "x.img").exists()
    backend.put("objects/ab/empty", b"")
    assert backend.get("objects/ab/empty") == b"" and backend.stat("objects/ab/empty").size == 0
    backend.put("objects/ab/abcdef", b"replaced")
    assert backend.get("objects/ab/abcdef") == b"replaced"


def test_large_blobs_round_trip(backend, tmp_path):
    """Above a part (S3: parts uploaded and ranges read in parallel) the bytes come back in order."""
    data = os.urandom(12 * MiB + 12345)
    backend.put("packs/ab/big", data)
    assert backend.get("packs/ab/big") == data
    assert backend.get("packs/ab/big", 3 * MiB, 7 * MiB) == data[3 * MiB:10 * MiB]
    backend.get_file("packs/ab/big", tmp_path / "big.img")
    assert (tmp_path / "big.img").read_bytes() == data
    source = tmp_path / "pages-1.img"
    source.write_bytes(data[:6 * MiB])
    assert backend.put_file("packs/cd/file", source) == 6 * MiB
    assert not source.exists(), "put_file consumes the staged file"
    assert backend.get("packs/cd/file") == data[:6 * MiB]


def test_get_parts_hands_every_byte_once(backend):
    """get_parts (what the encryption wrapper's get_file decrypts as it arrives): parts start
    at offset + k * part, each whole, together the blob from offset, over several S3 ranges."""
    data = os.urandom(12 * MiB + 12345)
    backend.put("packs/ab/parts", data)
    part = 3 * MiB + 7
    got: dict[int, bytes] = {}
    assert backend.get_parts("packs/ab/parts", part, lambda at, piece: got.setdefault(at, bytes(piece)),
                             100) == len(data) - 100
    assert sorted(got) == list(range(100, len(data), part))
    assert all(len(piece) == part for at, piece in got.items() if at + part < len(data))
    assert b"".join(got[at] for at in sorted(got)) == data[100:]
    assert backend.get_parts("packs/ab/parts", part, got.setdefault, len(data)) == 0
    with pytest.raises(BlobNotFound):
        backend.get_parts("packs/ab/missing", part, got.setdefault)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a//b", "objects/.hidden", "", "a/../b", "./a"])
def test_names_that_are_not_blob_names_are_refused(backend, name):
    with pytest.raises(ValueError, match="invalid blob name"):
        backend.put(name, b"x")


def test_list_by_prefix_names_and_sizes(backend):
    backend.put("checkpoints/b.json", b"bb")
    backend.put("checkpoints/a.json", b"a")
    backend.put("objects/ab/abc.zst", b"xyz")
    backend.put("objects/cd/cde", b"")
    assert [(i.name, i.size) for i in backend.list("checkpoints/")] == [("checkpoints/a.json", 1),
                                                                         ("checkpoints/b.json", 2)]
    assert [i.name for i in backend.list("objects/")] == ["objects/ab/abc.zst", "objects/cd/cde"]
    assert [i.name for i in backend.list("objects/c")] == ["objects/cd/cde"]
    assert backend.list("index/") == [] and backend.list("objects/", incomplete=True) == []
    backend.delete(["checkpoints/a.json", "checkpoints/gone.json"])
    assert [i.name for i in backend.list("checkpoints/")] == ["checkpoints/b.json"]


def test_listing_and_deleting_more_than_a_page(backend):
    """1,001 blobs: two pages of S3's 1,000 keys, two DeleteObjects batches."""
    names = [f"objects/{i % 7:02x}/{i:06d}" for i in range(1001)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda name: backend.put(name, name.encode()), names))
    listed = backend.list("objects/")
    assert [i.name for i in listed] == sorted(names)
    assert all(i.size == len(i.name) for i in listed)
    backend.delete(names + ["objects/00/missing"])
    assert backend.list("objects/") == []


def test_put_if_absent_never_replaces(backend):
    backend.put_if_absent("checkpoints/x.json", b"first")
    with pytest.raises(BlobExists):
        backend.put_if_absent("checkpoints/x.json", b"second")
    assert backend.get("checkpoints/x.json") == b"first"
    assert [i.name for i in backend.list("checkpoints/")] == ["checkpoints/x.json"]
    assert backend.list("checkpoints/", incomplete=True) == []


RACER = """
import time
backend = open_backend(sys.argv[1])
backend.exists("checkpoints/other.json")  # connected before the start
while time.time() < float(sys.argv[2]):
    pass
from ckpt.store.backends import BlobExists
try:
    backend.put_if_absent("checkpoints/same.json", sys.argv[3].encode() * 100000)
except BlobExists:
    print("lost")
else:
    print("won")
"""


def test_put_if_absent_race_between_processes_has_one_winner(backend, spec):
    """Two processes commit the same name at the same moment: exactly one wins, the other is
    told, and the blob is the winner's whole content (never a mix, never replaced)."""
    backend.put("checkpoints/other.json", b"")
    for _attempt in range(3):
        backend.delete(["checkpoints/same.json"])
        start = time.time() + 1.5
        racers = [run_script(RACER, spec, str(start), letter, stdout=subprocess.PIPE, text=True) for letter in "ab"]
        results = [racer.communicate(timeout=60)[0].strip() for racer in racers]
        assert sorted(results) == ["lost", "won"], results
        winner = "ab"[results.index("won")]
        assert backend.get("checkpoints/same.json") == winner.encode() * 100000


def test_a_streamed_blob_appears_only_on_commit(backend):
    data = os.urandom(12 * MiB)
    writer = backend.writer("packs/ab/abcd")
    for start in range(0, len(data), MiB):
        writer.write(memoryview(data)[start:start + MiB])
    assert not backend.exists("packs/ab/abcd") and backend.list("packs/") == []
    unfinished = backend.list("packs/", incomplete=True)
    assert [info.name.startswith("packs/ab/.abcd.") for info in unfinished] == [True]
    writer.commit()
    assert writer.written == len(data) and backend.stat("packs/ab/abcd").size == len(data)
    assert backend.get("packs/ab/abcd") == data
    assert backend.list("packs/", incomplete=True) == []

    with backend.writer("packs/ab/small") as small:  # below a part: one PUT
        small.write(b"s" * 100)
        small.commit()
    assert backend.get("packs/ab/small") == b"s" * 100

    with backend.writer("packs/ab/other") as aborted:
        aborted.write(os.urandom(11 * MiB))
        aborted.abort()
    with pytest.raises(RuntimeError), backend.writer("packs/ab/third") as failed:
        failed.write(os.urandom(11 * MiB))
        raise RuntimeError("the dump failed")
    assert [info.name for info in backend.list("packs/")] == ["packs/ab/abcd", "packs/ab/small"]
    assert backend.list("packs/", incomplete=True) == [], "an aborted writer leaves nothing"


ABANDONER = """
import os
backend = open_backend(sys.argv[1], **({"part_size": 5 << 20} if "s3://" in sys.argv[1] else {}))
writer = backend.writer("packs/ab/crashed")
writer.write(os.urandom(6 << 20))
print("written", flush=True)
os._exit(0)  # as kill -9 would: no abort
"""


def test_what_a_dead_writer_left_is_listed_and_deleted(backend, spec):
    crashed = run_script(ABANDONER, spec, stdout=subprocess.PIPE, text=True)
    assert crashed.communicate(timeout=60)[0].strip() == "written"
    assert backend.list("packs/") == []
    leftovers = backend.list("packs/", incomplete=True)
    assert len(leftovers) == 1 and leftovers[0].name.startswith("packs/ab/.crashed.")
    assert leftovers[0].modified is not None and abs(leftovers[0].modified - time.time()) < 120
    backend.delete([info.name for info in leftovers])
    assert backend.list("packs/", incomplete=True) == []
    backend.delete([info.name for info in leftovers])  # already gone: not an error


def test_a_reader_reads_ranges_and_copies_them(backend, tmp_path):
    data = os.urandom(3 * MiB)
    backend.put("packs/ab/abcdef", data)
    with backend.reader() as reader:
        assert reader.size("packs/ab/abcdef") == len(data)
        with reader.read("packs/ab/abcdef", 4096, 100) as view:
            assert bytes(view) == data[4096:4196]
        with reader.read("packs/ab/abcdef", len(data) - 10, 100) as view:
            assert bytes(view) == data[-10:]
        out = os.open(tmp_path / "copy", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            assert reader.copy_to("packs/ab/abcdef", MiB, 3 * MiB, out) == 2 * MiB
        finally:
            os.close(out)
        with pytest.raises(BlobNotFound):
            reader.size("packs/ab/missing")
    assert (tmp_path / "copy").read_bytes() == data[MiB:]


HOLDER = """
import time
backend = open_backend(sys.argv[1], **({"lock_ttl": float(sys.argv[3])} if "s3://" in sys.argv[1] else {}))
with backend.lock(sys.argv[2] == "exclusive", 10):
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
"""


def hold_lock(spec: str, mode: str, ttl: float = 300, hold: float = 60) -> subprocess.Popen:
    holder = run_script(HOLDER, spec, mode, str(ttl), str(hold), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def end(holder: subprocess.Popen) -> None:
    if holder.poll() is None:
        holder.kill()
    holder.wait(30)


def test_an_exclusive_lock_excludes_others_and_names_its_holder(backend, spec):
    holder = hold_lock(spec, "exclusive")
    try:
        heard = []
        for exclusive in (False, True):
            started = time.monotonic()
            with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
                with backend.lock(exclusive, 0.5, on_wait=heard.append):
                    pass
            assert time.monotonic() - started < 10
        assert [[owner.pid for owner in owners] for owners in heard] == [[holder.pid]] * 2
        assert heard[0][0].mode == "exclusive" and heard[0][0].host
    finally:
        end(holder)


def test_shared_locks_coexist_and_keep_exclusive_out(backend, spec):
    holder = hold_lock(spec, "shared")
    try:
        with backend.lock(False, 0):
            pass
        with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
            with backend.lock(True, 0.5):
                pass
    finally:
        end(holder)
    with backend.lock(True, 5):
        pass


def test_the_lock_of_a_killed_holder_is_taken_over(backend, spec):
    holder = hold_lock(spec, "exclusive")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(30)
    started = time.monotonic()
    with backend.lock(True, 10):
        assert backend.lock_holders() == []
    assert time.monotonic() - started < 5, "a dead holder on this host is stale at once, not after the TTL"
    if is_s3(backend):
        assert raw(backend).list("locks/") == [], "the stale lock object and ours are gone"


def test_an_unrefreshed_lock_of_another_host_goes_stale_after_its_ttl(s3_url):
    """A holder on another host cannot be asked whether it lives: its lock object is stale once
    not refreshed for its TTL, by the server's clock."""
    backend = open_backend(s3_url)
    backend.put("locks/elsewhere.json", json.dumps({
        "pid": 4242, "host": "elsewhere", "command": "ckpt dump", "since": "2026-01-01T00:00:00+00:00",
        "mode": "exclusive", "boot_id": "x", "pidns": "pid:[1]", "start": "1", "ttl": 2}).encode())
    with pytest.raises(StoreBusy, match="pid 4242"):
        with backend.lock(False, 0):
            pass
    started = time.monotonic()
    with backend.lock(True, 10):
        waited = time.monotonic() - started
    assert 0.5 < waited < 6, waited
    assert not backend.exists("locks/elsewhere.json"), "the stale lock object was deleted"


def test_a_held_lock_is_refreshed_and_stays_live_past_its_ttl(s3_url):
    holder = hold_lock(s3_url, "exclusive", ttl=1.5, hold=30)
    try:
        with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
            with open_backend(s3_url).lock(False, 4):
                pass
    finally:
        end(holder)


def test_wrappers_pass_on_the_safety_margin_and_the_clock(s3_url):
    """prune's safety margin (design.md, "Pruning") must reach it through encryption and the
    cache: a wrapper answering the base class's 0 would let prune delete a dump's blobs."""
    from ckpt.store import keys
    from ckpt.store.backends.s3 import S3Backend

    remote = S3Backend.from_url(s3_url)
    wrapped, _ = keys.initialize(remote, b"pw")
    assert remote.gc_margin() == 2 * remote.lock_ttl > 0
    assert wrapped.gc_margin() == remote.gc_margin()
    assert abs(wrapped.now() - time.time()) < 60


def test_the_memory_backends_lock_excludes_between_threads_and_dies_with_its_holder():
    """The lock tests above hold the lock in another process, which a memory backend cannot
    share: here its holders are threads, and a holder that ends without releasing (as a
    killed process would) blocks no one."""
    import threading

    from ckpt.store.backends.memory import MemoryBackend

    backend = MemoryBackend()
    held, release = threading.Event(), threading.Event()

    def hold(exclusive: bool, until: threading.Event) -> None:
        with backend.lock(exclusive, 5):
            held.set()
            until.wait(10)

    holder = threading.Thread(target=hold, args=(True, release))
    holder.start()
    assert held.wait(5)
    heard = []
    for exclusive in (False, True):
        with pytest.raises(StoreBusy, match=f"pid {os.getpid()}"):
            with backend.lock(exclusive, 0.2, on_wait=heard.append):
                pass
    assert [[owner.mode for owner in owners] for owners in heard] == [["exclusive"]] * 2
    release.set()
    holder.join(5)
    with backend.lock(True, 1):
        assert backend.lock_holders() == []

    held.clear()
    release.clear()
    shared = threading.Thread(target=hold, args=(False, release))
    shared.start()
    assert held.wait(5)
    try:
        with backend.lock(False, 0):
            pass
        with pytest.raises(StoreBusy):
            with backend.lock(True, 0.2):
                pass
    finally:
        release.set()
        shared.join(5)

    # A holder gone without releasing: entered in a thread that then ends (the context kept,
    # or collecting it would release the lock).
    entered = []
    gone = threading.Thread(target=lambda: entered.append(backend.lock(True, 0)) or entered[0].__enter__())
    gone.start()
    gone.join(5)
    with backend.lock(True, 1):
        assert backend.lock_holders() == []
