"""Encryption at rest (ckpt/store/backends/encrypted.py, ckpt/store/keys.py): nothing readable
reaches the inner backend, tampering is refused naming the blob, key files, and a real store
(the dump's ingest-and-commit, materialize, verify, prune) working on top of it."""

import os
import time
from pathlib import Path

import pytest

from ckpt.errors import DamagedBlob, DamagedCheckpoint, ExitCode, KeyNotFound, StoreError, UsageError, WrongPassword
from ckpt.store import Store
from ckpt.store.backends import BlobNotFound, LocalBackend
from ckpt.store.backends.encrypted import CHUNK, HEADER_LEN, TAG_LEN, EncryptedBackend
from ckpt.store.keys import (KdfParams, add_key, change_password, initialize, is_encrypted, key_files, list_keys,
                             remove_key, unlock)
from ckpt.store.prune import collect_garbage
from ckpt.store.verify import verify
from tests.unit.test_store import PAGE, fake_dump, flip_byte, laid_out
from tests.helpers import env_settings

MASTER = bytes(range(32))
SMALL = 4096  # chunk size of most tests here: many chunks from little data
CHEAP = KdfParams(n=1 << 10, r=8, p=1)  # scrypt at the tests' pace; the default is measured in docs
MARKER = b"ckpt-secret-MARKER-7f3a"


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def enc(root) -> EncryptedBackend:
    return EncryptedBackend(LocalBackend(root), MASTER, chunk_size=SMALL)


def raw_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def inner_path(enc: EncryptedBackend, root: Path, name: str) -> Path:
    return Path(enc.where(name))


def test_nothing_readable_reaches_the_inner_backend(enc, root, tmp_path):
    content = os.urandom(3000) + MARKER * 500 + os.urandom(3000)
    enc.put(f"objects/ab/{MARKER.decode().lower()}", content)
    enc.put_if_absent("checkpoints/20260101-marker.json", b'{"name": "%s"}' % MARKER)
    with enc.writer("packs/cd/marker-pack") as out:
        for _ in range(20):
            out.write(MARKER * 100)
        out.commit()
    staged = tmp_path / "staged.img"
    staged.write_bytes(MARKER * 1000)
    enc.put_file("index/marker-index", staged)
    enc.put("store.json", MARKER)
    files = raw_files(root)
    assert len(files) == 5
    for name, data in files.items():
        assert MARKER not in data and MARKER.lower() not in data, name
        assert "marker" not in name.lower(), name
        assert name.split("/")[0] in {"objects", "checkpoints", "packs", "index", "store.json"}
    assert enc.get("packs/cd/marker-pack") == MARKER * 2000
    assert [i.name for i in enc.list("")] == ["checkpoints/20260101-marker.json", "index/marker-index",
                                               f"objects/ab/{MARKER.decode().lower()}", "packs/cd/marker-pack",
                                               "store.json"]


SIZES = [0, 1, SMALL - 1, SMALL, SMALL + 1, 3 * SMALL, 3 * SMALL + 17]


@pytest.mark.parametrize("size", SIZES)
def test_ranged_reads_at_chunk_boundaries_and_plaintext_sizes(enc, root, size):
    data = os.urandom(size)
    enc.put("packs/ab/blob", data)
    stored = inner_path(enc, root, "packs/ab/blob").stat().st_size
    assert stored == HEADER_LEN + size + TAG_LEN * max(1, -(-size // SMALL)) == enc.stored_size(size)
    assert enc.stat("packs/ab/blob").size == size and [i.size for i in enc.list("packs/")] == [size]
    edges = sorted({0, 1, SMALL - 1, SMALL, SMALL + 1, 2 * SMALL - 1, 2 * SMALL, size - 1, size, size + 1} - {-1})
    with enc.reader() as reader:
        assert reader.size("packs/ab/blob") == size
        for offset in edges:
            for length in (1, 2, SMALL - 1, SMALL, SMALL + 1, 2 * SMALL + 1):
                want = data[offset:offset + length]
                assert enc.get("packs/ab/blob", offset, length) == want, (offset, length)
                with reader.read("packs/ab/blob", offset, length) as view:
                    assert bytes(view) == want, (offset, length)
            assert enc.get("packs/ab/blob", offset) == data[offset:]
    assert enc.get("packs/ab/blob") == data


class _RecordingBackend(LocalBackend):
    def __init__(self, root: Path):
        super().__init__(root)
        self.requested: list[tuple[int, int]] = []

    def get(self, name, offset=0, length=None):
        self.requested.append((offset, offset + (length or 0)))
        return super().get(name, offset, length)


def test_stored_span_is_what_a_ranged_read_asks_the_inner_store_for(root):
    # The prefetch ends its ranges by it where the S3 upload's parts end.
    inner = _RecordingBackend(root)
    enc = EncryptedBackend(inner, MASTER, chunk_size=SMALL)
    enc.put("packs/ab/blob", os.urandom(10 * SMALL + 5))
    enc.get_view("packs/ab/blob", 0, 1)  # the header is read (and kept) once
    for offset, length in [(0, 1), (SMALL - 1, 2), (3 * SMALL, 2 * SMALL), (3 * SMALL + 7, SMALL), (9 * SMALL, 99)]:
        inner.requested.clear()
        enc.get_view("packs/ab/blob", offset, length)
        assert inner.requested == [enc.stored_span("packs/ab/blob", offset, length)], (offset, length)


def test_a_view_decrypted_into_a_buffer_given_is_the_blobs_bytes_and_lies_in_that_buffer(enc):
    # The lazy restore's prefetch hands each range a buffer it uses again (prefetch.BufferPool).
    data = os.urandom(10 * SMALL + 5)
    enc.put("packs/ab/blob", data)
    for offset, length in [(0, 1), (SMALL - 1, 2), (3 * SMALL, 2 * SMALL), (3 * SMALL + 7, SMALL), (9 * SMALL, 99),
                           (10 * SMALL, 50)]:
        given = []

        def allocate(size):
            # larger than asked and full of other bytes, as a slab of the pool may be
            given.append(memoryview(bytearray(os.urandom(size + 3))))
            return given[-1]

        view = enc.get_view("packs/ab/blob", offset, length, allocate=allocate)
        assert bytes(view) == data[offset:offset + length], (offset, length)
        assert len(given) == 1 and view.obj is given[0].obj, "decrypted into the buffer given, not a copy"


def test_a_streamed_blob_is_sealed_chunk_by_chunk_whatever_the_writes(enc):
    data = os.urandom(5 * SMALL + 3)
    for step in (1, 7, SMALL - 1, SMALL, SMALL + 1, len(data)):
        with enc.writer("packs/ab/streamed") as out:
            for start in range(0, len(data), step):
                out.write(memoryview(data)[start:start + step])
            out.commit()
        assert out.written == len(data) and enc.get("packs/ab/streamed") == data, step
    with enc.writer("packs/ab/exact") as out:  # a whole last chunk is the final one
        out.write(data[:2 * SMALL])
        out.commit()
    assert enc.get("packs/ab/exact", SMALL, SMALL) == data[SMALL:2 * SMALL]


def test_the_default_chunk_size_round_trips_large_blobs(root, tmp_path):
    enc = EncryptedBackend(LocalBackend(root), MASTER)
    data = os.urandom(3 * CHUNK + 1000)
    enc.put("packs/ab/big", data)
    assert enc.get("packs/ab/big", CHUNK - 10, 20) == data[CHUNK - 10:CHUNK + 10]
    enc.get_file("packs/ab/big", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    with enc.reader() as reader:
        fd = os.open(tmp_path / "copy", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            assert reader.copy_to("packs/ab/big", 100, len(data), fd) == len(data) - 100
        finally:
            os.close(fd)
    assert (tmp_path / "copy").read_bytes() == data[100:]


def reads(enc: EncryptedBackend, name: str, tmp_path: Path):
    """Every way of reading a whole blob."""
    def through_reader():
        with enc.reader() as reader:
            with reader.read(name, 0, reader.size(name)) as view:
                return bytes(view)

    def to_file():
        dest = tmp_path / f"out-{time.monotonic_ns()}"
        enc.get_file(name, dest)
        return dest.read_bytes()

    return [lambda: enc.get(name), lambda: enc.get(name, 1, 10 ** 9), through_reader, to_file]


@pytest.mark.parametrize("where", ["header", "first chunk", "middle chunk", "last tag"])
def test_a_flipped_byte_is_refused_naming_the_blob(enc, root, tmp_path, where):
    data = os.urandom(3 * SMALL + 100)
    enc.put("packs/ab/victim", data)
    path = inner_path(enc, root, "packs/ab/victim")
    at = {"header": 10, "first chunk": HEADER_LEN + 5, "middle chunk": HEADER_LEN + (SMALL + TAG_LEN) + 7,
          "last tag": path.stat().st_size - 1}[where]
    flip_byte(path, at)
    for read in reads(enc, "packs/ab/victim", tmp_path):
        with pytest.raises(DamagedBlob, match="packs/ab/victim") as caught:
            read()
        assert caught.value.exit_code == ExitCode.DAMAGED and caught.value.name == "packs/ab/victim"
    assert not list(tmp_path.glob("out-*")), "get_file leaves nothing behind"
    if where == "middle chunk":  # the other chunks still read
        assert enc.get("packs/ab/victim", 0, SMALL) == data[:SMALL]
        assert enc.get("packs/ab/victim", 2 * SMALL, 100) == data[2 * SMALL:2 * SMALL + 100]


@pytest.mark.parametrize("cut", ["last chunk whole", "within the last chunk", "all chunks", "within the header"])
def test_a_truncated_blob_is_refused(enc, root, tmp_path, cut):
    data = os.urandom(3 * SMALL)
    enc.put("objects/ab/victim", data)
    path = inner_path(enc, root, "objects/ab/victim")
    size = path.stat().st_size
    os.truncate(path, {"last chunk whole": size - (SMALL + TAG_LEN), "within the last chunk": size - 5,
                       "all chunks": HEADER_LEN, "within the header": 10}[cut])
    for read in reads(enc, "objects/ab/victim", tmp_path)[:2]:
        with pytest.raises(DamagedBlob, match="objects/ab/victim"):
            read()
    if cut == "last chunk whole":  # the chunks before it are intact; the one now last was not sealed as final
        assert enc.get("objects/ab/victim", 0, SMALL) == data[:SMALL]
        with pytest.raises(DamagedBlob, match="cut short"):
            enc.get("objects/ab/victim", SMALL, SMALL)
        with enc.reader() as reader, pytest.raises(DamagedBlob, match="objects/ab/victim"):
            reader.read("objects/ab/victim", SMALL, SMALL)


def test_reordered_chunks_and_a_blob_moved_under_another_name_are_refused(enc, root, tmp_path):
    enc.put("objects/ab/one", b"1" * (3 * SMALL))
    enc.put("objects/ab/two", b"2" * (3 * SMALL))
    enc.put("checkpoints/b.json", b'{"old": true}')
    one, two = inner_path(enc, root, "objects/ab/one"), inner_path(enc, root, "objects/ab/two")
    two.write_bytes(one.read_bytes())  # one's content, with its own valid tags, under two's name
    with pytest.raises(DamagedBlob, match="objects/ab/two"):
        enc.get("objects/ab/two")
    sealed = SMALL + TAG_LEN
    data = bytearray(one.read_bytes())
    first, second = data[HEADER_LEN:HEADER_LEN + sealed], data[HEADER_LEN + sealed:HEADER_LEN + 2 * sealed]
    data[HEADER_LEN:HEADER_LEN + 2 * sealed] = second + first
    one.write_bytes(bytes(data))
    with pytest.raises(DamagedBlob, match="objects/ab/one"):
        enc.get("objects/ab/one", 0, SMALL)
    # A manifest moved to another id.
    moved = Path(enc.where("checkpoints/a.json"))
    moved.parent.mkdir()
    inner_path(enc, root, "checkpoints/b.json").rename(moved)
    assert [i.name for i in enc.list("checkpoints/")] == ["checkpoints/a.json"]
    with pytest.raises(DamagedBlob, match="checkpoints/a.json"):
        enc.get("checkpoints/a.json")


def test_another_master_key_reads_nothing_and_lists_nothing(enc, root):
    enc.put("objects/ab/x", b"secret")
    other = EncryptedBackend(LocalBackend(root), bytes(32), chunk_size=SMALL)
    assert other.list("objects/") == [], "names that do not decrypt are not this repository's"
    with pytest.raises(BlobNotFound):
        other.get("objects/ab/x")  # the same name is stored elsewhere under another key
    theirs = Path(other.where("objects/ab/x"))
    theirs.parent.mkdir()
    inner_path(enc, root, "objects/ab/x").rename(theirs)
    with pytest.raises(DamagedBlob, match="objects/ab/x"):
        other.get("objects/ab/x")


def test_foreign_names_are_left_out_and_unfinished_writes_are_listed_and_deleted(enc, root):
    enc.put("packs/ab/mine", b"x")
    (root / "packs" / "zz").mkdir()
    (root / "packs" / "zz" / "zzzz").write_bytes(b"planted")  # not a name of ours
    assert [i.name for i in enc.list("packs/")] == ["packs/ab/mine"]
    writer = enc.writer("packs/cd/unfinished.zst")
    writer.write(os.urandom(3 * SMALL))
    (left,) = enc.list("packs/", incomplete=True)
    assert left.name.startswith("packs/cd/.unfinished.zst.")
    assert Path(enc.where(left.name)).exists()
    enc.delete([left.name])
    assert enc.list("packs/", incomplete=True) == [] and not list((root / "packs").rglob(".*"))
    writer.abort()
    for reserved in ("keys/x.json", "locks/x.json"):
        with pytest.raises(ValueError, match="invalid blob name"):
            enc.put(reserved, b"")


# ---- key files ------------------------------------------------------------------------------

def test_a_wrong_password_is_one_clear_error(root):
    inner = LocalBackend(root)
    assert not is_encrypted(inner)
    enc, key_id = initialize(inner, b"right horse", CHEAP)
    assert is_encrypted(inner) and enc.key_id == key_id
    enc.put("checkpoints/x.json", b"data")
    with pytest.raises(WrongPassword) as caught:
        unlock(inner, b"wrong horse")
    assert caught.value.exit_code == ExitCode.PERMISSION
    assert "wrong password" in caught.value.message and "CKPT_PASSWORD" in caught.value.hint
    assert "horse" not in str(caught.value)
    opened = unlock(inner, b"right horse")
    assert opened.get("checkpoints/x.json") == b"data" and opened.key_id == key_id
    (key_file,) = (root / "keys").iterdir()
    assert enc.master_key not in key_file.read_bytes() and b"horse" not in key_file.read_bytes()
    with pytest.raises(UsageError, match="encrypted already"):
        initialize(inner, b"again", CHEAP)
    with pytest.raises(UsageError, match="empty"):
        unlock(inner, b"")


def test_a_plain_store_is_neither_unlocked_nor_encrypted_over(tmp_path):
    inner = LocalBackend(tmp_path / "plain")
    with pytest.raises(StoreError, match="not encrypted"):
        unlock(inner, b"pw")
    inner.put("store.json", b"{}")
    with pytest.raises(UsageError, match="not encrypted"):
        initialize(inner, b"pw", CHEAP)


def test_keys_are_added_listed_removed_and_changed_without_touching_data(root):
    inner = LocalBackend(root)
    enc, first = initialize(inner, b"one", CHEAP)
    enc.put("objects/ab/data", b"payload")
    data_before = raw_files(root / "objects")
    second = add_key(inner, enc.master_key, b"two", CHEAP)
    listed = list_keys(inner)
    assert {k.id for k in listed} == {first, second} and all(k.kdf == "scrypt" and k.n == CHEAP.n for k in listed)
    assert all(k.host and k.created for k in listed)
    by_two = unlock(inner, b"two")
    assert by_two.key_id == second and by_two.get("objects/ab/data") == b"payload"
    with pytest.raises(UsageError, match="opened the store with"):
        remove_key(inner, second, in_use=second)
    assert remove_key(inner, first[:6], in_use=second) == first  # a unique prefix will do
    with pytest.raises(WrongPassword):
        unlock(inner, b"one")
    with pytest.raises(UsageError, match="only key"):
        remove_key(inner, second)
    with pytest.raises(KeyNotFound):
        remove_key(inner, "feedfacefeedface")
    third = change_password(by_two, b"three", CHEAP)
    assert by_two.key_id == third and [k.id for k in list_keys(inner)] == [third]
    with pytest.raises(WrongPassword):
        unlock(inner, b"two")
    assert unlock(inner, b"three").get("objects/ab/data") == b"payload"
    assert raw_files(root / "objects") == data_before, "no data was encrypted again"


def test_a_key_added_after_the_listing_still_opens_the_store(root):
    """Opening a remote store lists its key files once, before a password is asked for: a key
    added while the user typed its password must still open it (a second listing, only then)."""
    inner = LocalBackend(root)
    enc, first = initialize(inner, b"one", CHEAP)
    listed = key_files(inner)
    second = add_key(inner, enc.master_key, b"two", CHEAP)
    assert unlock(inner, b"two", listed).key_id == second
    assert unlock(inner, b"one", listed).key_id == first
    with pytest.raises(WrongPassword):
        unlock(inner, b"three", listed)


def test_the_default_scrypt_cost_is_bearable(root):
    started = time.monotonic()
    initialize(LocalBackend(root), b"pw")
    unlock(LocalBackend(root), b"pw")
    assert time.monotonic() - started < 5  # about 0.26 s here: two derivations of N=2^15


# ---- a store on top of it -------------------------------------------------------------------

@pytest.fixture
def encrypted_store(tmp_path, monkeypatch) -> Store:
    """A store as the lead's Store.open will make an encrypted one: the directories, key files,
    then store.json written through the encryption."""
    monkeypatch.setenv("CKPT_STAGING", "disk")
    plain = Store.open(tmp_path / "store", create=True, settings=env_settings())
    os.unlink(plain.root / "store.json")
    enc, _ = initialize(LocalBackend(plain.root), b"pw", CHEAP)
    enc.put_if_absent("store.json", b'{"format": 2}')
    return Store(plain.root, unlock(LocalBackend(plain.root), b"pw"))


def test_a_store_ingests_restores_and_hides_its_data(encrypted_store):
    store = encrypted_store
    pages = os.urandom(PAGE * 100) + (MARKER + bytes(PAGE - len(MARKER))) * 50 + bytes(PAGE * 20)
    first = fake_dump(store, {"pages-1.img": pages, "core-1.img": MARKER * 40}, codec="zstd")
    second = fake_dump(store, {"pages-1.img": pages, "core-1.img": MARKER * 41}, codec="none")
    assert second.bytes_stored < PAGE, "pages dedup through the encryption"
    for m, core in ((first, MARKER * 40), (second, MARKER * 41)):
        assert verify(store.objects, m) == []
        dest = laid_out(store, m)
        assert (dest / "pages-1.img").read_bytes() == pages and (dest / "core-1.img").read_bytes() == core
    for name, data in raw_files(store.root).items():
        if not name.startswith(("tmp/", "logs/")):
            assert MARKER not in data, name
    store.remove([first.id])
    collect_garbage(store)
    assert verify(store.objects, second) == [] and (laid_out(store, second) / "pages-1.img").read_bytes() == pages


def test_a_tampered_pack_is_a_recorded_damaged_segment_not_a_crash(encrypted_store):
    store = encrypted_store
    pages = os.urandom(PAGE * 600)  # segments of 256, 256 and 88 pages
    first = fake_dump(store, {"pages-1.img": pages}, codec="none")
    (pack,) = [p for p in (store.root / "packs").rglob("*") if p.is_file()]
    flip_byte(pack, HEADER_LEN + 10)  # in the first segment
    (problem,) = verify(store.objects, first)
    assert "pages-1.img" in problem and "fails authentication" in problem
    assert [offset for _, offset in store.blocks.damage_markers()] == [0]
    with pytest.raises(DamagedCheckpoint, match="pages-1.img"):
        laid_out(store, first)
    second = fake_dump(store, {"pages-1.img": pages}, codec="none")
    assert second.bytes_stored >= 256 * PAGE, "the damaged segment's pages are stored again"
    assert verify(store.objects, first) == [] and (laid_out(store, first) / "pages-1.img").read_bytes() == pages
    collect_garbage(store)  # repacks past the damaged chunk
    assert verify(store.objects, second) == []


def test_a_swapped_object_is_damaged_and_healed_by_the_next_dump(encrypted_store):
    store = encrypted_store
    m = fake_dump(store, {"core-1.img": b"a" * 5000, "mm-1.img": b"b" * 5000}, codec="none")
    core, mm = (Path(store.backend.where(store.objects.find(e.hash)[0])) for e in m.files)
    mm.write_bytes(core.read_bytes())
    (problem,) = verify(store.objects, m)
    assert store.objects.find(m.files[1].hash)[0] in problem and "fails authentication" in problem
    fake_dump(store, {"core-1.img": b"a" * 5000, "mm-1.img": b"b" * 5000}, codec="none")
    assert verify(store.objects, m) == []


def test_prune_never_copies_a_live_tampered_segment_and_keeps_its_pack(encrypted_store):
    """Repacking reads a segment whose chunk fails authentication: nothing damaged is written
    into the store, so it stays where it is (recorded as damaged) and its pack is not deleted,
    as for a segment failing its checksum."""
    store = encrypted_store
    pages = [os.urandom(PAGE) for _ in range(300)]  # segments of 256 and 44 pages
    whole = fake_dump(store, {"pages-1.img": b"".join(pages)}, codec="none")
    tail = fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="none")
    (pack,) = [p for p in (store.root / "packs").rglob("*") if p.is_file()]
    flip_byte(pack, pack.stat().st_size - 10 * PAGE)
    assert verify(store.objects, tail)
    store.remove([whole.id])
    collect_garbage(store)
    assert pack.exists(), "the pack holding the only copy of a live segment was deleted"
    assert [p for p in (store.root / "packs").rglob("*") if p.is_file()] == [pack], "something was repacked"
    (marker,) = store.blocks.damage_markers()
    assert verify(store.objects, tail), "still damaged where it was"
    fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="none")
    assert verify(store.objects, tail) == [], "healed by a dump of the same pages"


# ---- opening an encrypted store, and its keyring ----------------------------------------------

def test_an_encrypted_store_opens_with_a_password_source_and_manages_its_keys(tmp_path):
    """The seams of ckpt/store/opening.py and Keyring: no CKPT_* variable steers them."""
    from ckpt.settings import Settings
    from ckpt.store import opening
    from ckpt.store.keys import Keyring
    from ckpt.store.password import PasswordSource

    root = tmp_path / "store"
    passed = Settings(store=root, cache=tmp_path / "cache")
    Store.open_local(root, create=True, password=b"one", settings=passed)
    opened = opening.open_store(root, passed, PasswordSource("one"))
    assert opened.location == str(root) and opened.root == root and not opened.remote and opened.cache is None
    assert isinstance(opened.encryption, EncryptedBackend) and opened.backend is opened.encryption
    with pytest.raises(WrongPassword):
        opening.open_store(root, passed, PasswordSource("two"))
    store = Store.open(root, settings=passed, passwords=PasswordSource("one"))
    keyring = Keyring(opening.find_encryption(store.backend))
    assert [key.id for key in keyring.list()] == [keyring.in_use]
    first = keyring.in_use
    second = keyring.add(b"two")
    assert {key.id for key in keyring.list()} == {first, second}
    with pytest.raises(UsageError, match="opened the store with"):
        keyring.remove(first)
    third = keyring.change_password(b"three")
    assert keyring.in_use == third and {key.id for key in keyring.list()} == {second, third}
    assert keyring.remove(second) == second
    reopened = Store.open(root, settings=passed, passwords=PasswordSource("three"))
    assert Keyring(opening.find_encryption(reopened.backend)).in_use == third
    plain = Store.open(tmp_path / "plain", create=True, settings=passed, passwords=PasswordSource())
    assert opening.find_encryption(plain.backend) is None
