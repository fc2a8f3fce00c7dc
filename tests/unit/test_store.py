"""The store's invariants, on real files (no CRIU): commit last, dedup, gc, leftovers, damage."""

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from ckpt.dump.commit import DumpRecord, ingest_and_commit
from ckpt.errors import CheckpointNotFound, DamagedCheckpoint, DiskFull, StoreBusy, StoreError
from ckpt.store import Manifest, Store, ids
from ckpt.store.materialize import materialize, materialize_parent
from ckpt.store.prune import collect_garbage
from ckpt.store.verify import verify
from tests.helpers import env_settings

PAGE = 4096


def fake_dump(store: Store, files: dict[str, bytes], name=None, codec="zstd", pid=4242, earlier=None) -> Manifest:
    """A dump without CRIU: the files staged as CRIU would leave them, then the dump's own
    ingest-and-commit (ckpt/dump/commit.py), the path every real dump ends with."""
    checkpoint_id = ids.new_id()
    staging = store.begin_dump(checkpoint_id)
    for file_name, content in files.items():
        (staging.images_dir / file_name).write_bytes(content)
    record = DumpRecord(checkpoint_id=checkpoint_id, pid=pid, command="x", started=time.monotonic(), name=name,
                        processes=[{"pid": 4242, "threads": [4242, 4243]}])
    try:
        manifest = ingest_and_commit(store, staging, record, codec, earlier=earlier)
    finally:
        staging.remove()
    time.sleep(0.001)
    return manifest


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STAGING", "disk")  # keep these tests out of /dev/shm
    return Store.open(tmp_path / "store", create=True, settings=env_settings())


def modes(root):
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            yield os.path.join(dirpath, d), stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode), 0o700
        for f in filenames:
            yield os.path.join(dirpath, f), stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode), 0o600


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_round_trip_dedup_and_owner_only(store, codec, tmp_path):
    big = os.urandom(1 << 20)
    first = fake_dump(store, {"pages-1.img": big, "core-1.img": b"core"}, codec=codec)
    second = fake_dump(store, {"pages-1.img": big, "core-1.img": b"core2"}, codec=codec)
    assert second.bytes_stored < 100, "identical pages must not be stored twice"
    assert first.bytes_stored >= (1 << 20 if codec == "none" else 1)
    for path, mode, want in modes(store.root):
        if not path.endswith("lock"):
            assert mode == want, path
    dest = laid_out(store, second)
    assert (dest / "pages-1.img").read_bytes() == big and (dest / "core-1.img").read_bytes() == b"core2"
    assert second.all_pids == [4242, 4243]


def test_resolve_latest_name_prefix(store):
    a = fake_dump(store, {"a": b"1"}, name="agent")
    b = fake_dump(store, {"a": b"2"}, name="agent")
    c = fake_dump(store, {"a": b"3"}, name="other")
    assert store.resolve("latest") == c.id
    assert store.resolve("agent") == b.id
    assert store.resolve(a.id) == a.id
    assert store.resolve(a.id[:-2]) == a.id
    with pytest.raises(CheckpointNotFound):
        store.resolve("nobody")


def test_remove_never_breaks_a_remaining_checkpoint(store):
    shared = os.urandom(100000)
    a = fake_dump(store, {"big": shared, "x": b"a"})
    b = fake_dump(store, {"big": shared, "x": b"b"})
    store.remove([a.id])
    removed, freed = collect_garbage(store)
    assert removed == 1  # only a's own "x"
    assert verify(store.objects, store.load(b.id)) == []
    store.remove([b.id])
    collect_garbage(store)
    assert list(store.objects.iter_sizes()) == []


def test_uncommitted_dump_is_invisible_and_cleaned(store):
    staging = store.begin_dump(ids.new_id())
    (staging.images_dir / "pages-1.img").write_bytes(b"partial")
    assert store.checkpoint_ids() == []
    assert store.remove_leftovers() == 0, "a live dump's staging must not be removed"
    # Simulate the dumper dying: its flock goes away with its file descriptor.
    os.close(staging._lock_fd)
    assert store.remove_leftovers() == 1
    assert list(store.tmp_dir.iterdir()) == []


def laid_out(store: Store, manifest: Manifest):
    """The checkpoint's images in a fresh directory of the store's staging area, as a restore lays them out."""
    return materialize(store.objects, store.staging_area(), manifest)


def flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_damage_is_detected_and_named(store):
    m = fake_dump(store, {"pages-1.img": os.urandom(PAGE * 12), "core-1.img": b"c" * 5000}, codec="none")
    core = next(e for e in m.files if e.name == "core-1.img")
    flip_byte(store.root / store.objects.find(core.hash)[0], 100)
    problems = verify(store.objects, m)
    assert len(problems) == 1 and "core-1.img" in problems[0]
    with pytest.raises(DamagedCheckpoint, match="core-1.img"):
        laid_out(store, m)
    assert list(store.tmp_dir.glob("restore-*")) == []


def test_damaged_pack_is_detected(store):
    m = fake_dump(store, {"pages-1.img": os.urandom(PAGE * 12)}, codec="zstd")
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, PAGE * 5)
    problems = verify(store.objects, m)
    assert len(problems) == 1 and "damaged" in problems[0] and "pages-1.img" in problems[0]
    with pytest.raises(DamagedCheckpoint):
        laid_out(store, m)


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_or_truncated_pack_is_refused_whatever_the_codec(store, codec, damage):
    """Uncompressed segments are copied by the kernel: their checksum is still checked first."""
    data = os.urandom(PAGE * 300) if codec == "none" else bytes(PAGE * 150) + os.urandom(PAGE * 150)
    m = fake_dump(store, {"pages-1.img": data}, codec=codec)
    assert laid_out(store, m).joinpath("pages-1.img").read_bytes() == data
    (pack,) = list((store.root / "packs").glob("*/*"))  # half compresses: not adopted as it is
    if damage == "flip":
        flip_byte(pack, pack.stat().st_size - PAGE)
    else:
        os.truncate(pack, pack.stat().st_size - 100)
    assert verify(store.objects, m)
    with pytest.raises(DamagedCheckpoint, match="pages-1.img"):
        laid_out(store, m)


def test_pages_dedup_even_when_mappings_move(store):
    """Pages are named by content: the same pages at other offsets (a mapping added before
    them) are not stored again; a changed page costs one page."""
    pages = [os.urandom(PAGE) for _ in range(64)]
    first = fake_dump(store, {"pages-1.img": b"".join(pages)}, codec="none")
    assert first.bytes_stored >= 64 * PAGE
    moved = [os.urandom(PAGE)] + pages[:10] + [os.urandom(PAGE)] + pages[11:]
    second = fake_dump(store, {"pages-1.img": b"".join(moved)}, codec="none")
    page_list_bytes = 65 * 16
    assert second.bytes_stored == 2 * PAGE + page_list_bytes
    dest = laid_out(store, second)
    assert (dest / "pages-1.img").read_bytes() == b"".join(moved)


def test_prune_repacks_and_keeps_every_remaining_checkpoint(store):
    base = [os.urandom(PAGE) for _ in range(40)]
    made = []
    for k in range(6):
        pages = list(base)
        for j in range(k * 5, k * 5 + 5):
            pages[j] = os.urandom(PAGE)
        made.append((fake_dump(store, {"pages-1.img": b"".join(pages), "core-1.img": bytes([k]) * 100},
                               codec="zstd"), b"".join(pages)))
    store.remove([m.id for m, _ in made[:4]])
    before = store.objects.total_bytes()
    removed, freed = collect_garbage(store)
    assert removed > 0 and freed > 0 and store.objects.total_bytes() < before
    for m, content in made[4:]:
        assert verify(store.objects, m) == []
        dest = laid_out(store, m)
        assert (dest / "pages-1.img").read_bytes() == content
    assert len(store.blocks.index_file_names()) == 1
    # A second prune finds nothing more to do.
    removed, freed = collect_garbage(store)
    assert (removed, freed) == (0, 0)


def test_manifest_is_json_with_format_first(store):
    m = fake_dump(store, {"a": b"1"})
    data = json.loads((store.root / store.manifest_name(m.id)).read_text())
    assert list(data)[:2] == ["format", "id"] and data["format"] == 2


@pytest.mark.parametrize("content", [b"[]", b"3", b'"a manifest"', b"null", b'{"format": "two", "files": []}',
                                     b'{"id": "x", "files": [3]}'])
def test_a_manifest_that_is_valid_json_but_no_manifest_is_a_damaged_checkpoint(store, content):
    """Valid JSON that is not a manifest object is damage like any unreadable manifest: the
    checkpoint is named, `list` and the others go on (it was an AttributeError, an internal error)."""
    good = fake_dump(store, {"a": b"1"})
    bad = fake_dump(store, {"a": b"2"})
    (store.root / store.manifest_name(bad.id)).write_bytes(content)
    with pytest.raises(DamagedCheckpoint, match=f"checkpoint {bad.id}: manifest .* is not a manifest"):
        store.load(bad.id)
    damaged = []
    assert [m.id for m in store.manifests(lambda i, e: damaged.append(i))] == [good.id] and damaged == [bad.id]


def test_exclusive_lock_waits_and_names_holder(store, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ckpt.store import Store\n"
        "from ckpt.settings import Settings\n"
        f"s = Store.open(Path({str(store.root)!r}), settings=Settings.from_environment())\n"
        "with s.lock(exclusive=False):\n"
        "    print('held', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
            with store.lock(exclusive=True, timeout=0.5):
                pass
        with store.lock(exclusive=False, timeout=0.5):
            pass  # shared locks coexist
    finally:
        holder.kill()
        holder.wait()
    with store.lock(exclusive=True, timeout=2):
        pass  # released by the kernel when its holder died


def test_runs_of_new_pages_are_consecutive_and_bounded():
    from ckpt.store.blocks.blockstore import _runs

    assert _runs([], 4) == []
    assert _runs([1, 2, 3, 7, 8, 10], 2) == [(1, 3), (3, 4), (7, 9), (10, 11)]
    assert _runs(list(range(10)), 256) == [(0, 10)]


def test_large_staging_is_moved_aside_at_once_and_removed_in_the_background(tmp_path, monkeypatch):
    from ckpt.store import staging

    monkeypatch.setattr(staging, "LARGE_TREE", 1 << 20)
    small, large = tmp_path / "dump-small", tmp_path / "dump-large"
    for path, size in ((small, 1000), (large, 2 << 20)):
        path.mkdir(mode=0o700)
        (path / "images").mkdir()
        (path / "images" / "pages-1.img").write_bytes(b"x" * size)
    staging.remove_tree(small)
    assert not small.exists()
    staging.remove_tree(large)
    assert not large.exists()  # renamed to *.trash before returning
    deadline = time.monotonic() + 10
    while list(tmp_path.glob("*.trash")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []


# ---- damage does not spread to new checkpoints, and heals (docs/design.md, "Damage and healing")

@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_damaged_object_is_replaced_by_the_next_dump_that_holds_it(store, codec):
    core = os.urandom(3000) * 3  # compressible: stored as zstd when asked
    first = fake_dump(store, {"core-1.img": core, "pages-1.img": os.urandom(PAGE * 4)}, codec=codec)
    entry = next(e for e in first.files if e.name == "core-1.img")
    flip_byte(store.root / store.objects.find(entry.hash)[0], 50)
    assert verify(store.objects, first), "the damage must be seen"
    second = fake_dump(store, {"core-1.img": core, "pages-1.img": os.urandom(PAGE * 4)}, codec=codec)
    assert second.bytes_stored > len(core) // 10, "the damaged object must be stored again"
    assert verify(store.objects, second) == []
    assert verify(store.objects, first) == [], "replacing the object heals the older checkpoint too"
    assert (laid_out(store, first) / "core-1.img").read_bytes() == core


def test_a_damaged_page_list_is_replaced_by_the_next_dump_with_the_same_pages(store):
    pages = os.urandom(PAGE * 8)
    first = fake_dump(store, {"pages-1.img": pages, "core-1.img": b"a"}, codec="none")
    entry = next(e for e in first.files if e.kind == "pages")
    flip_byte(store.root / store.objects.find(entry.hash)[0], 3)
    second = fake_dump(store, {"pages-1.img": pages, "core-1.img": b"b"}, codec="none")
    assert verify(store.objects, second) == [] and verify(store.objects, first) == []


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_damaged_segment_once_seen_is_stored_again_and_prune_drops_it(store, codec):
    pages = bytes(PAGE * 20) + os.urandom(PAGE * 20)
    first = fake_dump(store, {"pages-1.img": pages}, codec=codec)
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, pack.stat().st_size - 10)
    assert verify(store.objects, first), "verify finds the damage"
    assert store.blocks.damage_markers(), "and records it"
    second = fake_dump(store, {"pages-1.img": pages}, codec=codec)
    assert second.bytes_stored > PAGE, "pages known only from a damaged segment are stored again"
    assert verify(store.objects, second) == []
    assert verify(store.objects, first) == [], "the older checkpoint reads the healthy copy"
    collect_garbage(store)
    assert not pack.exists(), "the damaged segment was dead: its pack is gone"
    assert store.blocks.damage_markers() == []
    for m in (first, second):
        assert (laid_out(store, m) / "pages-1.img").read_bytes() == pages
    # Without a record of the damage, a dump reuses pages as it always did.
    assert fake_dump(store, {"pages-1.img": pages}, codec=codec).bytes_stored < PAGE


def test_verify_records_every_damaged_segment_not_just_the_first(store):
    pages = os.urandom(PAGE * 600)  # segments of 256, 256 and 88 pages
    first = fake_dump(store, {"pages-1.img": pages}, codec="none")
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, 10 * PAGE)  # two flips in one pack: segments 0 and 2
    flip_byte(pack, 590 * PAGE)
    (problem,) = verify(store.objects, first)
    assert "pages-1.img" in problem and "1 more damaged segment" in problem
    assert sorted(offset for _, offset in store.blocks.damage_markers()) == [0, 512 * PAGE]


def test_verify_records_every_segment_of_a_truncated_pack(store):
    pages = os.urandom(PAGE * 600)
    first = fake_dump(store, {"pages-1.img": pages}, codec="none")
    (pack,) = list((store.root / "packs").glob("*/*"))
    os.truncate(pack, pack.stat().st_size // 2)  # cuts segment 1 and all of segment 2 off
    assert verify(store.objects, first)
    assert sorted(offset for _, offset in store.blocks.damage_markers()) == [256 * PAGE, 512 * PAGE]
    second = fake_dump(store, {"pages-1.img": pages}, codec="none")
    assert verify(store.objects, second) == [] and verify(store.objects, first) == []


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_dump_checks_the_segments_it_would_reuse_in_a_pack_with_recorded_damage(store, damage):
    """Damage recorded in a pack (by a restore or verify that read only part of it) makes its
    other segments suspect: a dump checks those it would reuse, and stores again the pages of
    any found damaged that nobody had met yet."""
    shared, own = os.urandom(PAGE * 256), os.urandom(PAGE * 300)
    both = fake_dump(store, {"pages-1.img": shared + own}, codec="none")
    part = fake_dump(store, {"pages-1.img": shared}, codec="none")  # names segment 0 only
    (pack,) = list((store.root / "packs").glob("*/*"))
    if damage == "flip":
        flip_byte(pack, 10 * PAGE)
        flip_byte(pack, 500 * PAGE)  # segment 2: in no page `part` names
    else:
        flip_byte(pack, 10 * PAGE)
        os.truncate(pack, 300 * PAGE)
    assert verify(store.objects, part)
    assert [offset for _, offset in store.blocks.damage_markers()] == [0], "verify met only segment 0"
    store.blocks.forget_index()  # as a new command sees the store
    again = fake_dump(store, {"pages-1.img": shared + own}, codec="none")
    if damage == "flip":  # segment 1 found damaged, segment 2 intact and reused
        assert sorted(offset for _, offset in store.blocks.damage_markers()) == [0, 256 * PAGE]
        assert PAGE * 512 <= again.bytes_stored < PAGE * 556
    else:  # segment 1 cut short, segment 2 past the end
        assert sorted(offset for _, offset in store.blocks.damage_markers()) == [0, 256 * PAGE, 512 * PAGE]
        assert again.bytes_stored >= PAGE * 556
    assert verify(store.objects, again) == []
    for m in (both, part, again):
        assert verify(store.objects, m) == [], "older checkpoints read the fresh copies"
        assert (laid_out(store, m) / "pages-1.img").read_bytes() == (shared if m is part else shared + own)
    collect_garbage(store)
    assert not pack.exists() and store.blocks.damage_markers() == []


def no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_a_holder_record_that_cannot_be_written_does_not_stop_a_command(store, monkeypatch):
    import ckpt.store.backends.local as lock

    real_write = os.write
    monkeypatch.setattr(lock.os, "write", no_space)  # however the record is written, it fails
    monkeypatch.setattr(lock.Path, "write_text", no_space)
    with store.lock(exclusive=True):
        monkeypatch.setattr(lock.os, "write", real_write)
        assert list((store.root / "holders").iterdir()) == [], "no partial record is left"
        store.remove([])


def test_prune_without_room_to_repack_still_drops_what_is_dead(store, monkeypatch):
    from ckpt.store.backends import local as local_backend

    pages = [os.urandom(PAGE) for _ in range(300)]  # segments of 256 and 44 pages
    whole = fake_dump(store, {"pages-1.img": b"".join(pages)}, codec="none")
    tail = fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="none")
    alone = fake_dump(store, {"pages-1.img": os.urandom(PAGE * 20)}, codec="none")
    (old_pack,) = [p for p in (store.root / "packs").glob("*/*") if p.stat().st_size > 100 * PAGE]
    store.remove([whole.id, alone.id])
    monkeypatch.setattr(local_backend._LocalWriter, "write", no_space)  # a full disk for the copy
    collect_garbage(store)
    assert [p for p in (store.root / "packs").glob("*/*")] == [old_pack], \
        "the pack to repack stays, the dead one and the half-written copy are gone"
    assert len(store.blocks.index_file_names()) == 1
    assert (laid_out(store, tail) / "pages-1.img").read_bytes() == b"".join(pages[256:])


def test_a_damaged_segment_is_never_repacked_and_keeps_its_pack(store):
    """Nothing damaged is written into a store and no pack is deleted unless every byte copied
    out of it was verified: the live damaged segment stays where it is, with its record."""
    pages = [os.urandom(PAGE) for _ in range(300)]  # segments of 256 and 44 pages
    whole = fake_dump(store, {"pages-1.img": b"".join(pages)}, codec="none")
    tail = fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="none")
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, 280 * PAGE)
    assert verify(store.objects, tail)
    store.remove([whole.id])
    collect_garbage(store)  # the 256-page segment is dead, the damaged one live: the pack stays
    assert list((store.root / "packs").glob("*/*")) == [pack]
    (marker,) = store.blocks.damage_markers()
    assert marker == (pack.name, 256 * PAGE)
    assert verify(store.objects, tail), "still damaged where it was"
    fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="none")
    assert verify(store.objects, tail) == [], "healed by a dump of the same pages"


def test_a_parent_with_pages_recorded_damaged_is_not_used(store, tmp_path):
    pages = os.urandom(PAGE * 8)
    parent = fake_dump(store, {"pages-1.img": pages, "pagemap-1.img": b"pm", "inventory.img": b"inv"},
                       codec="none")
    materialize_parent(store.objects, parent, tmp_path / "ok")
    assert (tmp_path / "ok" / "pagemap-1.img").read_bytes() == b"pm"
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, 100)
    assert verify(store.objects, parent)
    with pytest.raises(DamagedCheckpoint, match="recorded as damaged"):
        materialize_parent(store.objects, parent, tmp_path / "damaged")


def test_a_parent_in_a_pack_with_recorded_damage_is_checked_before_it_is_used(store, tmp_path):
    """Dirty tracking takes pages from the parent without reading them: those in a pack with
    recorded damage are checked first, even where nobody has recorded damage yet."""
    first, second = os.urandom(PAGE * 256), os.urandom(PAGE * 44)
    fake_dump(store, {"pages-1.img": first + second}, codec="none")  # segments 0 and 1 of one pack
    parent = fake_dump(store, {"pages-1.img": second, "pagemap-1.img": b"pm", "inventory.img": b"inv"},
                       codec="none")
    other = fake_dump(store, {"pages-1.img": first}, codec="none")
    (pack,) = list((store.root / "packs").glob("*/*"))
    flip_byte(pack, 100)
    flip_byte(pack, 260 * PAGE)
    assert verify(store.objects, other)  # records segment 0 only: `parent` names none of its pages
    store.blocks.forget_index()
    with pytest.raises(DamagedCheckpoint, match="recorded as damaged"):
        materialize_parent(store.objects, parent, tmp_path / "parent")


def test_a_damaged_index_file_is_named_healed_by_the_next_dump_and_stops_prune(store):
    pages = os.urandom(PAGE * 30)
    first = fake_dump(store, {"pages-1.img": pages}, codec="none")
    (index_file,) = list((store.root / "index").iterdir())
    flip_byte(index_file, index_file.stat().st_size - 3)  # in the last entry: a page's place
    store.blocks.forget_index()
    (problem,) = verify(store.objects, first)
    assert "missing from the store" in problem and index_file.name in problem and "damaged" in problem
    with pytest.raises(StoreError, match="index file .* is damaged"):
        collect_garbage(store)
    second = fake_dump(store, {"pages-1.img": pages}, codec="none")
    assert second.bytes_stored >= 30 * PAGE, "pages named only by the damaged index are stored again"
    assert verify(store.objects, second) == [] and verify(store.objects, first) == [], \
        "and the first checkpoint is whole again"
    index_file.unlink()  # what prune's hint says to do
    store.blocks.forget_index()  # as a new command would see the store
    collect_garbage(store)
    for m in (first, second):
        assert (laid_out(store, m) / "pages-1.img").read_bytes() == pages


def test_a_second_checkpoint_never_replaces_one_with_the_same_id(store):
    first = fake_dump(store, {"core-1.img": b"first"})
    twin = Manifest(id=first.id, created=first.created, pid=1, command="twin", processes=[], files=[])
    with pytest.raises(StoreError, match="already exists"):
        store.commit(twin)
    assert store.load(first.id).command == "x" and verify(store.objects, store.load(first.id)) == []
    assert [p.name for p in (store.root / "checkpoints").iterdir()] == [f"{first.id}.json"]


def pagemap_bytes(tmp_path, pages_id: int, runs) -> bytes:
    from ckpt.criu import images

    path = tmp_path / f"pagemap-{pages_id}.tmp"
    images.write_pagemap(path, pages_id, [(vaddr, nr_pages, 4) for vaddr, nr_pages in runs])
    return path.read_bytes()


def searches(monkeypatch) -> list[int]:
    """How many ids each lookup in the index is for."""
    from ckpt.store.blocks.index import BlockIndex

    searched = []
    real_held = BlockIndex.held
    monkeypatch.setattr(BlockIndex, "held", lambda self, page_list: searched.append(len(page_list) // 16)
                        or real_held(self, page_list))
    return searched


def test_a_dump_looks_up_only_pages_not_at_their_address_in_its_pids_newest_checkpoint(store, monkeypatch,
                                                                                         tmp_path):
    from ckpt.dump import unchanged

    searched = searches(monkeypatch)
    heap, data = 0x10000, 0x7f0000000000
    pages = bytearray(os.urandom(64 * PAGE))
    first = fake_dump(store, {"pages-1.img": bytes(pages), "pagemap-10.img": pagemap_bytes(tmp_path, 1, [
        (heap, 4), (data, 60)])}, pid=10)
    fake_dump(store, {"pages-1.img": os.urandom(8 * PAGE)}, pid=11)
    assert store.newest_of(10).id == first.id and store.newest_of(12) is None
    # The heap grew by two pages (every later row moved by two) and two data pages changed.
    pages = pages[:4 * PAGE] + os.urandom(2 * PAGE) + pages[4 * PAGE:]
    for page in (10, 40):
        pages[page * PAGE:(page + 1) * PAGE] = os.urandom(PAGE)
    staging = tmp_path / "images"
    staging.mkdir()
    (staging / "pagemap-10.img").write_bytes(pagemap_bytes(tmp_path, 1, [(heap, 6), (data, 60)]))
    read_ahead = unchanged.EarlierCheckpoint(store.newest_of(10), store, tmp_path / "scratch")
    read_ahead.start()  # as a dump does while CRIU works
    earlier = read_ahead.pieces(staging)
    # (row, earlier row, count): the heap's first 4 pages, then the data 2 rows further on
    assert earlier["pages-1.img"][1].tolist() == [[0, 0, 4], [6, 4, 60]]
    second = fake_dump(store, {"pages-1.img": bytes(pages),
                               "pagemap-10.img": (staging / "pagemap-10.img").read_bytes()}, pid=10, earlier=earlier)
    assert searched[-1] == 4, "only the new heap pages and the rewritten ones are looked up"
    assert second.bytes_stored < 8 * PAGE, "only those 4 pages (and the page list) are stored"
    assert (laid_out(store, second) / "pages-1.img").read_bytes() == bytes(pages)


def test_an_earlier_checkpoint_that_cannot_be_read_only_costs_a_lookup(store, monkeypatch, tmp_path):
    from ckpt.dump import unchanged

    searched = searches(monkeypatch)
    pages = os.urandom(32 * PAGE)
    pagemap = pagemap_bytes(tmp_path, 1, [(0x10000, 32)])
    first = fake_dump(store, {"pages-1.img": pages, "pagemap-10.img": pagemap}, pid=10)
    page_list = store.root / store.objects.find(next(e for e in first.files if e.kind == "pages").hash)[0]
    os.chmod(page_list, 0o600)
    page_list.write_bytes(b"\xff" * page_list.stat().st_size)
    staging = tmp_path / "images"
    staging.mkdir()
    (staging / "pagemap-10.img").write_bytes(pagemap)
    assert unchanged.EarlierCheckpoint(first, store, tmp_path / "scratch").pieces(staging) == {}
    second = fake_dump(store, {"pages-1.img": pages, "pagemap-10.img": pagemap}, pid=10, earlier={})
    assert searched[-1] == 32
    assert (laid_out(store, second) / "pages-1.img").read_bytes() == pages


@pytest.mark.parametrize("now_runs,want", [
    ([(0x10000, 4), (0x80000, 6)], [6, 7, 8, 9, 0, 1, 2, 3, 4, 5]),  # the same mappings
    ([(0x80000 + 2 * PAGE, 3)], [2, 3, 4]),  # a run that starts inside an earlier one
    ([(0x7F000, 3)], [-1, 0, 1]),  # and one that starts before it
    ([(0x10000, 5)], [6, 7, 8, 9, -1]),  # a mapping that grew
    ([(0x40000, 2)], [-1, -1]),  # pages the earlier image took from its parent: not held there
])
def test_pages_are_matched_by_address(now_runs, want):
    from ckpt.dump.unchanged import _pieces_by_address

    earlier = [(0x80000, 6, 4), (0x10000, 4, 4), (0x40000, 3, 1)]  # out of order; one "in parent" run
    pieces = _pieces_by_address([(v, n, 4) for v, n in now_runs], earlier, 10)
    rows = [-1] * sum(n for _, n in now_runs)
    for row, earlier_row, count in pieces.tolist():
        rows[row:row + count] = range(earlier_row, earlier_row + count)
    # The earlier image holds the run at 0x80000 first (rows 0-5), then 0x10000 (rows 6-9).
    expected = {0x80000 + k * PAGE: k for k in range(6)} | {0x10000 + k * PAGE: 6 + k for k in range(4)}
    addresses = [v + k * PAGE for v, n in now_runs for k in range(n)]
    assert rows == [expected.get(a, -1) for a in addresses] == want
    assert _pieces_by_address([(0x10000, 1, 4)], earlier, 11) is None  # a page list that does not fit


def test_an_unchanged_layout_is_one_stretch():
    """Runs that follow each other in both images make one (row, earlier row, count) stretch:
    the ids of half a million pages are then compared in one go."""
    from ckpt.dump.unchanged import _pieces_by_address

    runs = [(0x10000, 4, 4), (0x80000, 6, 4), (0x7F0000000000, 100, 4)]
    assert _pieces_by_address(runs, runs, 110).tolist() == [[0, 0, 110]]
    assert _pieces_by_address(runs, [], 0).tolist() == []  # nothing held earlier


def test_an_image_of_pages_that_do_not_compress_becomes_the_pack_as_it_is(store):
    """CRIU's pages image is renamed into packs/ (its pages are not copied a second time);
    one that mostly compresses is stored through the dump's own pack as before."""
    data = os.urandom(PAGE * 1000)
    m = fake_dump(store, {"pages-1.img": data, "pages-2.img": bytes(PAGE * 100) + os.urandom(PAGE * 100)})
    packs = sorted((store.root / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
    assert len(packs) == 2 and packs[-1].read_bytes() == data  # the image itself
    assert packs[0].stat().st_size < 120 * PAGE  # the zeros compressed, the rest as is
    assert verify(store.objects, m) == []
    dest = laid_out(store, m)
    assert (dest / "pages-1.img").read_bytes() == data
    # Pages repeated within the image are named once; the copies are bytes no segment names.
    again = fake_dump(store, {"pages-1.img": data[:PAGE * 500] * 2})
    assert again.bytes_stored < PAGE * 10


def test_an_adopted_image_keeps_only_the_bytes_its_segments_name(store):
    """A pages image that became a pack as it is holds pages the dump did not store from it
    (here a quarter of it repeats its own pages): those are punched out of it before it is
    made durable, so the store holds only what the segments name, prune finds nothing dead,
    and the image reads back whole."""
    from ckpt.store.prune import prune_plan

    unique = [os.urandom(PAGE) for _ in range(750)]
    image = b"".join(unique + unique[:250])
    m = fake_dump(store, {"pages-1.img": image})
    (pack,) = list((store.root / "packs").glob("*/*"))
    assert pack.stat().st_size == len(image)  # CRIU's image itself, its size kept
    assert 750 * PAGE <= pack.stat().st_blocks * 512 < 800 * PAGE  # the repeated quarter freed
    assert pack.read_bytes()[750 * PAGE:] == bytes(250 * PAGE)
    with store.lock(exclusive=True):
        assert prune_plan(store).repack == []
    assert (laid_out(store, m) / "pages-1.img").read_bytes() == image


def test_an_adopted_image_keeps_in_place_what_does_not_shrink_by_a_tenth(store):
    """Three 1 MiB runs of one pages image: random data behind a few pages of heap (its first
    16 KiB compress: the probe's slices over the whole run find it does not), random data with
    zeros just where the probe's slices fall (it passes the probe; compressed, it shrinks by
    1.6%), and text. The first two stay where they lie in the adopted image, only the text is
    compressed into the dump's own pack, the image reads back whole."""
    from ckpt.store.blocks import blockstore

    run = blockstore.SEGMENT_PAGES * PAGE
    heap_then_random = b"heap object " * (4 * PAGE // 12) + os.urandom(run)
    heap_then_random = heap_then_random[:run]
    probed = bytearray(os.urandom(run))
    piece = blockstore.PROBE // blockstore.PROBE_SLICES
    for k in range(blockstore.PROBE_SLICES):
        at = (run - piece) * k // (blockstore.PROBE_SLICES - 1)
        probed[at:at + piece] = bytes(piece)
    text = b"".join(f"line {k} of some text\n".encode() for k in range(run // 16))[:run]
    image = heap_then_random + bytes(probed) + text
    m = fake_dump(store, {"pages-1.img": image})
    packs = sorted((store.root / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
    assert len(packs) == 2
    own, adopted = packs
    assert adopted.stat().st_size == len(image)  # CRIU's image itself
    assert 2 * run <= adopted.stat().st_blocks * 512 < 2 * run + 16 * PAGE  # the text punched out
    assert own.stat().st_size < run // 4  # the text, compressed
    assert (laid_out(store, m) / "pages-1.img").read_bytes() == image


def test_an_adopted_image_starts_writing_out_only_what_stays(store, monkeypatch):
    """Once its pages are stored, what stays of an adopted image (its segments) is sent to
    the disk ahead of the commit's fsync, and nothing else: a compressible run stored in the
    dump's own pack is left to the punch, never written."""
    from ckpt.store.blocks import blockstore
    from ckpt.system import files

    started: list[tuple[str, list[tuple[int, int]]]] = []
    real = files.start_writeback
    monkeypatch.setattr(blockstore, "start_writeback",
                        lambda path, ranges: (started.append((path.name, list(ranges))), real(path, ranges)))
    run = blockstore.SEGMENT_PAGES * PAGE
    text = b"".join(f"line {k} of some text\n".encode() for k in range(run // 16))[:run]
    image = os.urandom(run) + text + os.urandom(run)
    m = fake_dump(store, {"pages-1.img": image})
    assert started == [("pages-1.img", [(0, run), (2 * run, run)])]
    assert (laid_out(store, m) / "pages-1.img").read_bytes() == image


def test_adopted_images_stored_at_once_are_all_dropped_when_one_fails(store, monkeypatch):
    """The adopted images of a dump are made durable a few at once: when one fails (a full
    disk), the dump fails and none of them is left in the store, nor any index file."""
    from ckpt.store.backends.local import LocalBackend

    real_put_file, calls = LocalBackend.put_file, []

    def failing_put_file(self, name, source):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_put_file(self, name, source)

    monkeypatch.setattr(LocalBackend, "put_file", failing_put_file)
    images = {f"pages-{k}.img": os.urandom(300 * PAGE) for k in range(1, 7)}
    with pytest.raises(DiskFull):
        fake_dump(store, images)
    assert len(calls) == 6  # every one was tried: the others had been stored, then dropped
    assert list((store.root / "packs").glob("*/*")) == []
    assert list((store.root / "index").glob("*")) == []


def test_prune_counts_the_bytes_of_an_adopted_image_no_segment_names(store, monkeypatch):
    """Where the filesystem cannot punch holes, an adopted image keeps its dead bytes: prune
    counts them and repacks a pack a quarter of whose bytes is dead, as for any other pack."""
    from ckpt.store.blocks import blockstore
    from ckpt.store.prune import prune_plan

    monkeypatch.setattr(blockstore, "punch_out", lambda path, keep: False)
    unique = [os.urandom(PAGE) for _ in range(750)]
    image = b"".join(unique + unique[:250])
    m = fake_dump(store, {"pages-1.img": image})
    (pack,) = list((store.root / "packs").glob("*/*"))
    assert pack.stat().st_size == len(image)  # CRIU's image itself
    with store.lock(exclusive=True):
        assert prune_plan(store).repack == [pack.name]
        collect_garbage(store)
    (repacked,) = list((store.root / "packs").glob("*/*"))
    assert repacked.stat().st_size == 750 * PAGE
    assert (laid_out(store, m) / "pages-1.img").read_bytes() == image


def test_prune_dry_run_changes_nothing_not_even_staging_leftovers(store):
    """A restore directory of a restore that is gone: prune removes it, a dry run does not."""
    from ckpt.commands.prune import prune

    fake_dump(store, {"pages-1.img": os.urandom(PAGE * 4)}, codec="none")
    store.tmp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    leftover = store.tmp_dir / "restore-leftover"
    leftover.mkdir(mode=0o700)
    (leftover / "pages-1.img").write_bytes(b"x")
    assert prune(store, dry_run=True)["dry_run"] is True
    assert leftover.is_dir(), "a dry run removed a staging leftover"
    prune(store)
    assert not leftover.exists()


def test_a_segment_recorded_damaged_whose_checksum_passes_is_not_repacked(store, monkeypatch):
    """A segment that cannot be decoded has the right checksum of its (bad) bytes: verify records
    it. Prune must leave it where it is, with its record, or the next dump would find its pages
    known again and name the broken segment (review of 33634d8)."""
    from ckpt.store.blocks import blockstore

    pages = [((b"page %d " % i) * PAGE)[:PAGE] for i in range(300)]  # segments of 256 and 44
    encode = blockstore._Encoders.encode
    monkeypatch.setattr(blockstore._Encoders, "encode", lambda self, codec, data: os.urandom(200)
                        if len(data) == 44 * PAGE else encode(self, codec, data))
    whole = fake_dump(store, {"pages-1.img": b"".join(pages)}, codec="zstd")
    monkeypatch.setattr(blockstore._Encoders, "encode", encode)
    tail = fake_dump(store, {"pages-1.img": b"".join(pages[256:])}, codec="zstd")
    assert "cannot be decoded" in verify(store.objects, tail)[0]
    (marker,) = store.blocks.damage_markers()
    store.remove([whole.id])
    collect_garbage(store)
    reopened = Store.open(store.root, settings=env_settings())
    assert reopened.blocks.damage_markers() == [marker], "the record of the damage was lost"
    again = fake_dump(reopened, {"pages-1.img": b"".join(pages[256:])}, codec="zstd")
    assert again.bytes_stored > 0, "a dump named the broken segment's pages again"
    assert verify(Store.open(store.root, settings=env_settings()).objects, again) == []


def test_a_dump_asks_once_for_each_object_new_or_stored(store, monkeypatch):
    """In S3 every question is a request: an object (an image, a page list) is looked for
    under the one name it would be stored under, and a stored one is not asked again for its
    size (a dump of 100 processes asked 1027 times for 312 new objects and 204 stored ones)."""
    files = {f"core-{i}.img": os.urandom(1000) * 3 for i in range(5)}  # compressible: zstd
    files |= {"random.img": os.urandom(2 << 20), "pages-1.img": os.urandom(PAGE * 4)}  # stored as they are
    asked: list[str] = []
    for question in ("stat", "exists"):
        real = getattr(store.backend, question)
        monkeypatch.setattr(store.backend, question, lambda name, real=real: (asked.append(name), real(name))[1])
    first = fake_dump(store, files)
    objects_asked = [name for name in asked if name.startswith("objects/")]
    assert len(first.files) == 7 and len(objects_asked) == 7 == len(set(objects_asked)), objects_asked
    assert {e.codec for e in first.files if e.kind != "pages"} == {"zstd", "none"}
    asked.clear()
    second = fake_dump(store, files)
    assert second.bytes_stored == 0 and verify(store.objects, second) == []
    assert len([name for name in asked if name.startswith("objects/")]) == 7, asked


@pytest.mark.parametrize("recorded,now", [("zstd", "none"), ("none", "zstd")])
def test_an_object_found_under_the_other_codec_than_the_manifest_says_is_read(store, recorded, now):
    """An object is read under the codec its checkpoint recorded, without asking whether it is
    there first (from S3, a request per object); one healed since under the other codec's name
    is found there."""
    import zstandard

    from ckpt.store.objects import object_name

    core = os.urandom(3000) * 3  # compressible: stored as zstd when asked
    dumped = fake_dump(store, {"core-1.img": core, "pages-1.img": os.urandom(PAGE * 4)}, codec=recorded)
    entry = next(e for e in dumped.files if e.name == "core-1.img")
    assert entry.codec == recorded
    old, new = store.root / object_name(entry.hash, recorded), store.root / object_name(entry.hash, now)
    new.write_bytes(zstandard.ZstdCompressor().compress(core) if now == "zstd" else core)
    old.unlink()
    assert (laid_out(store, dumped) / "core-1.img").read_bytes() == core
    assert verify(store.objects, dumped) == []
    new.unlink()
    with pytest.raises(DamagedCheckpoint, match="missing from the store"):
        laid_out(store, dumped)


def test_an_object_damaged_under_the_manifest_s_codec_is_read_from_its_healed_copy(store):
    """A dump healed a damaged object under the other codec's name and died before deleting
    the damaged copy: the older checkpoint still restores, from the healed copy."""
    import zstandard

    from ckpt.store.objects import object_name

    core = os.urandom(3000) * 3
    dumped = fake_dump(store, {"core-1.img": core, "pages-1.img": os.urandom(PAGE * 4)}, codec="none")
    entry = next(e for e in dumped.files if e.name == "core-1.img")
    flip_byte(store.root / object_name(entry.hash, "none"), 50)
    (store.root / object_name(entry.hash, "zstd")).write_bytes(zstandard.ZstdCompressor().compress(core))
    assert (laid_out(store, dumped) / "core-1.img").read_bytes() == core
    assert not store.objects.intact(object_name(entry.hash, "none"), "none", entry.hash), "that copy alone"


@pytest.mark.parametrize("recorded,healed", [("zstd", "none"), ("none", "zstd")])
def test_a_copy_reads_an_object_damaged_under_the_manifest_s_codec_from_its_healed_copy(store, tmp_path, recorded,
                                                                                       healed):
    """The copy a dump healed under the other codec's name is what `ckpt copy` sends: the
    damaged one under the manifest's codec is not, and the copy succeeds."""
    import zstandard

    from ckpt.reporting import NullReporter
    from ckpt.store.objects import object_name
    from ckpt.store.transfer import CheckpointCopier

    core = os.urandom(3000) * 3
    dumped = fake_dump(store, {"core-1.img": core, "pages-1.img": os.urandom(PAGE * 4)}, codec=recorded)
    entry = next(e for e in dumped.files if e.name == "core-1.img")
    assert entry.codec == recorded
    flip_byte(store.root / object_name(entry.hash, recorded), 20)
    (store.root / object_name(entry.hash, healed)).write_bytes(
        zstandard.ZstdCompressor().compress(core) if healed == "zstd" else core)
    dest = Store.open(tmp_path / "dest", create=True, settings=env_settings())
    result = CheckpointCopier(store, dest, NullReporter(), "zstd", same_seed=False).copy_one(dumped.id)
    assert result.status == "copied"
    assert not (dest.root / object_name(entry.hash, recorded)).exists(), "the damaged copy is not sent"
    assert (laid_out(dest, dest.load(dumped.id)) / "core-1.img").read_bytes() == core
    assert verify(dest.objects, dest.load(dumped.id)) == []


def test_a_manifest_is_read_once_while_a_lock_is_held(store, monkeypatch):
    """Resolving an ID and loading it read its manifest twice (two GETs from S3): within one
    lock hold the store keeps what it read; outside a lock, and after a forget, it reads again."""
    m = fake_dump(store, {"pages-1.img": os.urandom(PAGE)})
    other = fake_dump(store, {"pages-1.img": os.urandom(PAGE)})
    reads: list[str] = []
    real_get = store.backend.get
    monkeypatch.setattr(store.backend, "get", lambda name: (reads.append(name), real_get(name))[1])
    store.load(m.id)
    store.load(m.id)
    assert len(reads) == 2  # no lock: read each time
    with store.lock():
        assert store.load(m.id).id == m.id and store.load(m.id).files == m.files
        assert len(reads) == 3
        store.load(other.id)
        store.remove([other.id])  # forgotten: no longer kept either
        with pytest.raises(CheckpointNotFound):
            store.load(other.id)
    store.load(m.id)
    assert len(reads) == 6  # the lock let go: read again
