"""The parts of a lazy restore that need no CRIU: images with holes, the page source, and CRIU's
page server protocol spoken over a socket pair."""

import os
import socket
import struct
import threading

import pytest

from ckpt.criu import lazypages
from ckpt.errors import DamagedCheckpoint
from ckpt.restore.lazy import _StorePages
from ckpt.restore.lazyplan import LazyPlan
from ckpt.store import Store
from ckpt.store.materialize import materialize_lazily
from tests.unit.test_store import PAGE, fake_dump, flip_byte
from tests.helpers import env_settings

IOV = struct.Struct("=I4xQQQ")  # criu/page-xfer.c: struct page_server_iov


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STAGING", "disk")
    return Store.open(tmp_path / "store", create=True, settings=env_settings())


def lazy_materialise(store, manifest, holes):
    return materialize_lazily(store.objects, store.staging_area(), manifest, lambda directory: holes)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_holes_are_left_out_of_the_image_and_every_other_page_is_written(store, codec):
    pages = [os.urandom(PAGE) for _ in range(40)]
    manifest = fake_dump(store, {"pages-1.img": b"".join(pages), "core-1.img": b"core"}, codec=codec)
    directory, locations = lazy_materialise(store, manifest, {"pages-1.img": [(0, 5), (10, 20), (38, 2)]})
    image = (directory / "pages-1.img").read_bytes()
    assert len(image) == 40 * PAGE, "the image keeps its size: CRIU counts offsets through the holes"
    for i, page in enumerate(pages):
        hole = i < 5 or 10 <= i < 30 or i >= 38
        assert image[i * PAGE:(i + 1) * PAGE] == (bytes(PAGE) if hole else page), i
    assert (directory / "core-1.img").read_bytes() == b"core"
    assert len(locations["pages-1.img"]) == 40
    # Mostly holes on disk: the lazily served pages were never written.
    assert os.stat(directory / "pages-1.img").st_blocks * 512 <= 15 * PAGE


def test_a_damaged_segment_under_a_hole_is_still_refused(store):
    manifest = fake_dump(store, {"pages-1.img": os.urandom(8 * PAGE)}, codec="none")
    pack = next((store.root / "packs").rglob("*"))
    while pack.is_dir():
        pack = next(pack.iterdir())
    flip_byte(pack, 3 * PAGE)
    with pytest.raises(DamagedCheckpoint):
        lazy_materialise(store, manifest, {"pages-1.img": [(0, 8)]})
    assert not any(store.tmp_dir.iterdir()), "a refused restore leaves nothing staged"


def served_store(store, codec="zstd"):
    pages = [os.urandom(PAGE) for _ in range(64)]
    manifest = fake_dump(store, {"pages-7.img": b"".join(pages)}, codec=codec)
    # Process 42: pagemap entries at 0x10000 (8 pages, image pages 0-7, not lazy), 0x40000
    # (16 lazy pages from image page 8) and 0x90000 (40 lazy pages from image page 24).
    plan = LazyPlan(runs={42: ("pages-7.img", [(0x40000, 16, 8), (0x90000, 40, 24)])})
    _, plan.locations = lazy_materialise(store, manifest, plan.holes())
    return pages, plan


def test_the_page_source_answers_within_one_pagemap_entry(store):
    pages, plan = served_store(store)
    source = _StorePages(store, plan)
    assert source.available(42, 0x40000, 4) == 4
    assert source.available(42, 0x40000 + 14 * PAGE, 10) == 2, "stops at the end of the entry"
    assert source.available(42, 0x10000, 1) == 0, "not a lazy entry"
    assert source.available(42, 0x40000 + 100, 1) == 0, "not page aligned"
    assert source.available(43, 0x40000, 1) == 0, "another process"
    read, write = os.pipe()
    try:
        source.send(42, 0x90000 + 3 * PAGE, 5, write)
        assert os.read(read, 5 * PAGE + 1) == b"".join(pages[27:32])
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_the_page_server_speaks_criu_s_protocol(store, codec):
    pages, plan = served_store(store, codec)
    daemon, server = socket.socketpair()
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        served=lazypages.serve(server, _StorePages(store, plan))))
    thread.start()
    try:
        def ask(vaddr, count):
            daemon.sendall(IOV.pack(7, count, vaddr, 42))  # PS_IOV_GET
            header = daemon.recv(IOV.size, socket.MSG_WAITALL)
            cmd, nr_pages, answered_vaddr, pid = IOV.unpack(header)
            assert (cmd, answered_vaddr, pid) == (4 << 16 | 6, vaddr, 42)  # PS_IOV_ADD_F, PE_PRESENT
            return nr_pages, daemon.recv(nr_pages * PAGE, socket.MSG_WAITALL)

        assert ask(0x40000, 16) == (16, b"".join(pages[8:24]))
        assert ask(0x90000 + 30 * PAGE, 64) == (10, b"".join(pages[54:64])), "cut at the entry's end"
        daemon.sendall(IOV.pack(0x1024, 0, 0, 0))  # PS_IOV_FORCE_CLOSE
        assert daemon.recv(4, socket.MSG_WAITALL) == struct.pack("=i", 0)
    finally:
        thread.join(timeout=10)
        daemon.close()
        server.close()
    assert result["served"] == (26, 2)


def test_a_request_outside_the_lazy_memory_is_an_error_not_an_answer(store):
    _, plan = served_store(store)
    daemon, server = socket.socketpair()
    try:
        daemon.sendall(IOV.pack(7, 1, 0x10000, 42))
        with pytest.raises(lazypages.PageServerError, match="does not hold as lazy pages"):
            lazypages.serve(server, _StorePages(store, plan))
        daemon.close()
        with pytest.raises(lazypages.PageServerError, match="closed the connection"):
            lazypages.serve(server, _StorePages(store, plan))
    finally:
        daemon.close()
        server.close()


P, L = 4, 2  # PE_PRESENT, PE_LAZY
K = 4096


@pytest.mark.parametrize("runs, vmas, eager", [
    # one mapping, all lazy: nothing eager
    ([(0x10000, 4, P | L), (0x20000, 2, P | L)], [(0x10000, 0x30000)], set()),
    # a stack-like mapping: one page not lazy makes the mapping's other entries eager too
    ([(0x10000, 4, P | L), (0x20000, 1, P), (0x40000, 8, P | L)], [(0x10000, 0x30000), (0x40000, 0x50000)],
     {0, 1}),
    # an entry spanning two mappings carries the second one along
    ([(0x10000, 1, P), (0x1f000, 2, P | L), (0x22000, 1, P | L), (0x40000, 1, P | L)],
     [(0x10000, 0x20000), (0x20000, 0x30000), (0x40000, 0x41000)], {0, 1, 2}),
    # entries taken from a parent (PE_PARENT) are not present here: left alone
    ([(0x10000, 1, 1), (0x11000, 1, P | L)], [(0x10000, 0x20000)], set()),
    # no mappings known: nothing is lazy
    ([(0x10000, 1, P | L)], [], {0}),
])
def test_a_mapping_is_lazy_only_if_all_its_pages_are(runs, vmas, eager):
    from ckpt.criu.images import _entries_in_mixed_mappings

    assert _entries_in_mixed_mappings(runs, vmas) == eager


HUGE, NOHUGE = 1 << 14, 1 << 15  # VmaEntry.madv bits of MADV_HUGEPAGE, MADV_NOHUGEPAGE


@pytest.mark.parametrize("madv, thp_always, refused", [
    (HUGE, False, True),     # madvised huge pages: a write before userfaultfd fills 2 MiB
    (0, False, False),       # THP only where madvised (Debian's default): safe
    (0, True, True),         # THP for every mapping
    (NOHUGE, True, False),   # ... but this one opted out
])
def test_eager_pages_in_a_huge_page_mapping_refuse_a_lazy_restore(madv, thp_always, refused):
    from ckpt.criu.images import _huge_pages_in

    runs = [(0x10000, 1, P), (0x11000, 4, P | L), (0x40000, 8, P | L)]
    vmas = [(0x10000, 0x20000, madv), (0x40000, 0x50000, HUGE)]
    assert _huge_pages_in(runs, {0, 1}, vmas, thp_always) is refused
    assert _huge_pages_in(runs, set(), vmas, thp_always) is False, "all lazy: huge pages are fine"


def test_the_segments_to_fetch_come_per_process_by_address_in_turn_each_once():
    from ckpt.restore.lazyplan import needed_segments
    from ckpt.store.blocks.segments import to_location

    plan = LazyPlan()
    # Process 1: two runs, given out of address order; its pages in segments 5, 5, 6, 5 (again), 9.
    plan.runs[1] = ("pages-1.img", [(0x20000, 2, 3), (0x10000, 3, 0)])
    plan.locations["pages-1.img"] = [to_location(5, 0), to_location(5, 1), to_location(6, 0),
                                     to_location(5, 7), to_location(9, 2)]
    # Process 2: segments 6 (shared with process 1), 7, 7.
    plan.runs[2] = ("pages-2.img", [(0x10000, 3, 0)])
    plan.locations["pages-2.img"] = [to_location(6, 3), to_location(7, 0), to_location(7, 1)]
    # A process with nothing lazy.
    plan.runs[3] = ("pages-3.img", [])
    assert needed_segments(plan) == [5, 6, 7, 9]


def test_the_pages_wanted_of_each_segment_are_its_distinct_lazy_pages():
    from ckpt.restore.lazyplan import pages_by_segment
    from ckpt.store.blocks.segments import to_location

    plan = LazyPlan()
    # Process 1: pages 5/0, 5/1 and 6/0 lazy, 5/7 not (its run leaves it out), 5/0 twice.
    plan.runs[1] = ("pages-1.img", [(0x10000, 3, 0), (0x20000, 1, 4)])
    plan.locations["pages-1.img"] = [to_location(5, 0), to_location(5, 1), to_location(6, 0),
                                     to_location(5, 7), to_location(5, 0)]
    # Process 2: 6/0 again (the same page as process 1's) and 6/1.
    plan.runs[2] = ("pages-2.img", [(0x10000, 2, 0)])
    plan.locations["pages-2.img"] = [to_location(6, 0), to_location(6, 1)]
    plan.runs[3] = ("pages-3.img", [])
    assert pages_by_segment(plan) == {5: 2, 6: 2}
    assert pages_by_segment(LazyPlan()) == {}
