"""A checkpoint of a tree of many processes, on real files (no CRIU): hundreds of small images,
many of them alike, stored by several threads and laid out by several threads."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckpt.commands.dump import _wait_for_tree_dead
from ckpt.criu.images import _core_comm, process_tree
from ckpt.errors import DamagedCheckpoint, ImageUnreadable
from ckpt.store import Store
from ckpt.store.materialize import LAY_OUT_WORKERS, materialize
from ckpt.store.objects import worth_compressing
from tests.helpers import env_settings
from tests.unit.test_store import PAGE, fake_dump, flip_byte

PROCESSES = 40


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STAGING", "disk")
    return Store.open(tmp_path / "store", create=True, settings=env_settings())


def pool_images() -> dict[str, bytes]:
    """What CRIU leaves of a worker pool: per process a core image of its own, mm and fs images
    alike in every worker, and a pages image with the pages they share and some of their own."""
    shared_pages = os.urandom(PAGE * 8)
    files = {"inventory.img": b"inventory", "pstree.img": b"pstree"}
    for k in range(1, PROCESSES + 1):
        files[f"core-{k}.img"] = f"core of {k} ".encode() * 50
        files[f"mm-{k}.img"] = b"the same mm" * 100
        files[f"fs-{k}.img"] = b"fs"
        files[f"pages-{k}.img"] = shared_pages + os.urandom(PAGE * 2)
    return files


def stored_objects(store: Store) -> list[str]:
    return [info.name for info in store.backend.list("objects/")]


def test_images_alike_are_stored_once_and_every_image_comes_back(store):
    files = pool_images()
    manifest = fake_dump(store, files)
    entries = {e.name: e for e in manifest.files}
    assert set(entries) == set(files)
    assert len({entries[f"mm-{k}.img"].hash for k in range(1, PROCESSES + 1)}) == 1
    # One object per distinct content: the others, the cores, the page lists (the mm and fs once).
    assert len(stored_objects(store)) == 2 + PROCESSES + 2 + PROCESSES
    again = fake_dump(store, files)
    assert again.bytes_stored == 0  # every object and page is in the store already
    dest = materialize(store.objects, store.staging_area(), again)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == files
    # laid out once (decompressed: the mm images compress), the others linked to it
    assert len({(dest / f"mm-{k}.img").stat().st_ino for k in range(1, PROCESSES + 1)}) == 1


def test_a_damaged_image_among_many_fails_the_lay_out_and_leaves_nothing(store):
    manifest = fake_dump(store, pool_images())
    core = next(e for e in manifest.files if e.name == f"core-{PROCESSES // 2}.img")
    flip_byte(store.root / store.objects.find(core.hash)[0], 5)
    with pytest.raises(DamagedCheckpoint, match=core.name):
        materialize(store.objects, store.staging_area(), manifest)
    assert [p for p in store.tmp_dir.iterdir() if p.name.startswith("restore-")] == []


def test_the_command_name_is_read_from_a_core_image(tmp_path):
    from pycriu import images

    for pid, comm in ((7, "python"), (8, "")):
        with open(tmp_path / f"core-{pid}.img", "wb") as f:
            images.dump({"magic": "CORE", "entries": [{"mtype": "X86_64", "tc": {
                "task_state": 1, "exit_code": 0, "personality": 0, "flags": 0, "blk_sigset": 0,
                "comm": comm}}]}, f)
    with open(tmp_path / "pstree.img", "wb") as f:
        images.dump({"magic": "PSTREE", "entries": [{"pid": 7, "ppid": 0, "pgid": 7, "sid": 7},
                                                    {"pid": 8, "ppid": 7, "pgid": 7, "sid": 7, "threads": [8, 9]}]}, f)
    tree = process_tree(tmp_path)
    assert [(p["pid"], p["ppid"], p["threads"], p["comm"]) for p in tree] == [(7, 0, [7], "python"),
                                                                               (8, 7, [8, 9], "?")]
    with open(tmp_path / "not-a-core.img", "wb") as f:
        images.dump({"magic": "PSTREE", "entries": [{"pid": 7, "ppid": 0, "pgid": 7, "sid": 7}]}, f)
    (tmp_path / "cut.img").write_bytes((tmp_path / "core-7.img").read_bytes()[:20])
    for bad in ("not-a-core.img", "cut.img"):
        with pytest.raises(ImageUnreadable, match=bad):
            _core_comm(tmp_path / bad)


def test_a_stopped_tree_counts_as_dead_once_its_processes_are_zombies():
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        started = time.monotonic()
        deadline = started + 5
        while open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # A zombie (nobody reaped it) is dead: no wait for the reaping.
        _wait_for_tree_dead([child], time.monotonic)
        assert time.monotonic() - started < 2
    finally:
        os.waitpid(child, 0)
    # A live process is waited for, up to the bound, and never killed.
    live = os.fork()
    if live == 0:
        time.sleep(30)
        os._exit(0)
    try:
        ticks = iter(range(1000))
        _wait_for_tree_dead([live], lambda: float(next(ticks)))  # a clock past the bound at its 4th reading
        assert open(f"/proc/{live}/stat").read().rsplit(")", 1)[1].split()[0] in ("S", "R")
    finally:
        os.kill(live, signal.SIGKILL)
        os.waitpid(live, 0)


def test_only_a_sample_of_a_small_pages_image_is_compressed_to_decide(tmp_path):
    random_image, zero_image = tmp_path / "random.img", tmp_path / "zero.img"
    random_image.write_bytes(os.urandom(2 << 20))
    zero_image.write_bytes(bytes(2 << 20))
    assert not worth_compressing(random_image)
    assert worth_compressing(zero_image)


def test_a_restore_logs_errors_and_warnings_at_the_default_level_and_anything_asked_otherwise():
    from ckpt.criu.client import restore_log_level

    assert restore_log_level(3) == 2  # the default: no line per run of pages read
    assert [restore_log_level(level) for level in (0, 1, 2, 4)] == [0, 1, 2, 4]


def test_a_layout_decodes_each_compressed_segment_once_for_all_the_images_that_share_it(store, monkeypatch):
    """The workers' pages images share compressible pages (each worker's own pages do not
    compress): each segment holding them is decoded by one image's reader, then shared."""
    from ckpt.store.blocks import blockstore

    shared = b"".join(f"page {k} of the parent's heap ".encode().ljust(PAGE, b".") for k in range(64))
    files = {"inventory.img": b"inventory"}
    for k in range(1, PROCESSES + 1):
        files[f"pages-{k}.img"] = shared + os.urandom(PAGE)
    manifest = fake_dump(store, files)
    decoded: list[bytes] = []
    real_decode = blockstore._decode

    def counting_decode(codec: int, data: bytes) -> bytes:
        decoded.append(data)
        return real_decode(codec, data)

    monkeypatch.setattr(blockstore, "_decode", counting_decode)
    dest = materialize(store.objects, store.staging_area(), manifest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == files
    assert decoded, "the shared pages were stored compressed"
    # Each segment once, not once per image (but by each of the layout's threads that asked
    # for it at the same time, before the first had decoded it).
    assert max(decoded.count(segment) for segment in decoded) <= LAY_OUT_WORKERS < PROCESSES


def test_the_pages_a_layout_writes_are_those_between_its_holes_in_any_order():
    from ckpt.store.blocks.blockstore import pages_between_holes

    locations = list(range(100, 110))
    assert pages_between_holes(locations, []) == locations
    assert pages_between_holes(locations, [(0, 10)]) == []
    # (first, count), unsorted, one overlapping the next: pages 2-4 and 6-8 are holes
    assert pages_between_holes(locations, [(6, 3), (2, 2), (3, 2)]) == [100, 101, 105, 109]
    assert pages_between_holes(locations, [(8, 5)]) == locations[:8], "a hole past the end"


def test_the_readers_of_each_pack_count_each_image_once():
    """PacksAhead's count of the images reading each pack (ckpt/store/materialize.py), made
    over every page of the tree at once: an image reading two segments of a pack counts once."""
    from types import SimpleNamespace

    from ckpt.store.blocks.segments import pack_name, to_location as location
    from ckpt.store.materialize import _readers_of_packs
    from ckpt.system.arrays import np

    segments = [SimpleNamespace(pack="a"), SimpleNamespace(pack="b"), SimpleNamespace(pack="a")]
    blocks = SimpleNamespace(index=lambda: SimpleNamespace(segment_list=segments))
    located = np.array([location(0, 0), location(0, 1), location(2, 0),  # image 0: pack a, two segments
                        location(1, 0), location(0, 3),  # image 1: b and a
                        location(1, 5)], dtype=np.int64)  # image 2: b
    assert _readers_of_packs(blocks, located, [3, 2, 1]) == {pack_name("a"): 2, pack_name("b"): 2}
