"""The lazy restore's prefetch plan (ckpt/store/blocks/prefetch.py): ranges coalesced from
adjacent segments, in the order of need, and the queue that fetches each segment once, a
segment needed now jumping ahead of the rest."""

from __future__ import annotations

import pytest

from ckpt.store.blocks.prefetch import FetchQueue, plan_ranges
from ckpt.store.blocks.segments import Segment

MIB = 1 << 20


def segments(*layout: tuple[str, int, int]) -> list[Segment]:
    return [Segment(pack, offset, length, max(1, length // 4096), 0, b"") for pack, offset, length in layout]


def spans(ranges) -> list[tuple[str, int, int, list[int]]]:
    return [(r.pack, r.start, r.end, r.keys) for r in ranges]


def test_adjacent_segments_of_a_pack_are_coalesced_up_to_the_range_size():
    segs = segments(("a", 0, MIB), ("a", MIB, MIB), ("a", 2 * MIB, MIB), ("a", 3 * MIB, MIB), ("a", 4 * MIB, MIB))
    assert spans(plan_ranges([0, 1, 2, 3, 4], segs, range_bytes=2 * MIB)) == [
        ("a", 0, 2 * MIB, [0, 1]), ("a", 2 * MIB, 4 * MIB, [2, 3]), ("a", 4 * MIB, 5 * MIB, [4])]


def test_ranges_end_on_multiples_of_the_range_size_in_the_pack():
    # An S3 server reads a range that crosses one of the upload's parts from both parts.
    segs = segments(*(("a", 2 * MIB + i * MIB, MIB) for i in range(20)))
    assert [(r.start // MIB, r.end // MIB) for r in plan_ranges(list(range(20)), segs, range_bytes=8 * MIB)] == [
        (2, 8), (8, 16), (16, 22)]
    # A range starting less than a quarter before a multiple runs on to the next one.
    segs = segments(*(("a", 7 * MIB + i * MIB, MIB) for i in range(12)))
    assert [(r.start // MIB, r.end // MIB) for r in plan_ranges(list(range(12)), segs, range_bytes=8 * MIB)] == [
        (7, 16), (16, 19)]


def test_ranges_end_where_the_bytes_the_store_reads_for_them_would_cross_a_multiple():
    # An encrypted pack: 16 bytes more per 256 KiB chunk, and a header: the plaintext's
    # multiples of 8 MiB are not the store's.
    def stored(pack, start, end):
        return 40 + start + start // (256 << 10) * 16, 40 + end + -(-end // (256 << 10)) * 16 + 1

    segs = segments(*(("a", i * MIB, MIB) for i in range(20)))
    ranges = plan_ranges(list(range(20)), segs, range_bytes=8 * MIB, stored_span=stored)
    assert [(r.start // MIB, r.end // MIB) for r in ranges] == [(0, 7), (7, 15), (15, 20)]
    for r in ranges[:-1]:
        start, end = stored(r.pack, r.start, r.end)
        assert (end - 1) // (8 * MIB) == start // (8 * MIB) or start % (8 * MIB) > 6 * MIB


def test_a_gap_or_another_pack_starts_a_new_range_and_unwanted_segments_are_never_fetched():
    # Segment 1 (an eager page's) lies between 0 and 2: not wanted, so 0 and 2 are not adjacent.
    segs = segments(("a", 0, 4096), ("a", 4096, 8192), ("a", 12288, 4096), ("b", 4096, 4096), ("b", 0, 4096))
    ranges = plan_ranges([0, 2, 3, 4], segs, range_bytes=MIB)
    assert spans(ranges) == [("a", 0, 4096, [0]), ("a", 12288, 16384, [2]), ("b", 0, 8192, [4, 3])]
    assert sorted(k for r in ranges for k in r.keys) == [0, 2, 3, 4]


def test_ranges_come_in_the_order_their_segments_are_needed_each_segment_once():
    segs = segments(("a", 0, MIB), ("b", 0, MIB), ("a", 8 * MIB, MIB))
    ranges = plan_ranges([1, 2, 1, 0, 2], segs, range_bytes=4 * MIB)
    assert spans(ranges) == [("b", 0, MIB, [1]), ("a", 8 * MIB, 9 * MIB, [2]), ("a", 0, MIB, [0])]


def test_a_segment_needed_now_jumps_the_queue_and_is_cut_out_of_its_range():
    segs = segments(*(("a", i * MIB, MIB) for i in range(4)), ("a", 10 * MIB, MIB))
    queue = FetchQueue(plan_ranges([0, 1, 2, 3, 4], segs, range_bytes=4 * MIB))
    first = queue.take()
    assert first is not None and first.keys == [0, 1, 2, 3]
    # In flight: the page server waits for it instead of fetching segment 2 again.
    assert queue.claim(2, segs)[0] == "wait"
    queue.finish(first)
    assert queue.claim(2, segs) == ("ready", first)
    # Pending: segment 4 is fetched alone, at once, by whoever asks.
    action, alone = queue.claim(4, segs)
    assert action == "fetch" and (alone.start, alone.end, alone.keys) == (10 * MIB, 11 * MIB, [4])
    assert queue.take() is None, "the range of segment 4 is still queued: it would be fetched twice"
    queue.finish(alone)
    assert queue.claim(4, segs)[0] == "ready"


def test_cutting_a_segment_out_of_the_middle_leaves_both_sides_queued_in_place():
    segs = segments(*(("a", i * MIB, MIB) for i in range(3)), ("b", 0, MIB))
    queue = FetchQueue(plan_ranges([0, 1, 2, 3], segs, range_bytes=4 * MIB))
    action, alone = queue.claim(1, segs)
    assert action == "fetch" and alone.keys == [1]
    assert queue.claim(1, segs)[0] == "wait"
    taken = [queue.take(), queue.take(), queue.take(), queue.take()]
    assert [(r.pack, r.keys) for r in taken if r is not None] == [("a", [0]), ("a", [2]), ("b", [3])]
    assert taken[-1] is None
    fetched = [k for r in [alone, *taken] if r is not None for k in r.keys]
    assert sorted(fetched) == [0, 1, 2, 3], "a segment fetched twice or not at all"


def test_a_failed_fetch_is_handed_to_whoever_needs_its_segments():
    segs = segments(("a", 0, MIB), ("a", MIB, MIB))
    queue = FetchQueue(plan_ranges([0, 1], segs))
    taken = queue.take()
    assert taken is not None
    queue.finish(taken, OSError("the store did not answer"))
    action, found = queue.claim(1, segs)
    assert action == "ready" and found.state == "failed" and isinstance(found.error, OSError)


def test_the_encrypted_backends_view_of_a_range_is_its_get():
    import os
    import random

    from ckpt.store.backends.encrypted import EncryptedBackend
    from ckpt.store.backends.memory import MemoryBackend

    backend = EncryptedBackend(MemoryBackend(), os.urandom(32), chunk_size=4096)
    data = os.urandom(50_000)
    backend.put("packs/ab/abcd", data)
    picks = random.Random(7)
    for _ in range(200):
        offset, length = picks.randrange(0, 52_000), picks.randrange(1, 30_000)
        with backend.get_view("packs/ab/abcd", offset, length) as view:
            assert bytes(view) == data[offset:offset + length] == backend.get("packs/ab/abcd", offset, length)


def test_the_prefetcher_serves_every_segment_fetched_once_while_its_threads_run(tmp_path):
    import random

    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=3)
    prefetcher.start()
    try:
        for key in random.Random(3).sample(wanted, len(wanted)):  # faults in any order, jumping the queue
            with prefetcher.segment(key) as got:
                assert bytes(got) == pack[segs[key].offset:segs[key].offset + segs[key].length]
    finally:
        prefetcher.close()
    spans = sorted((offset, offset + length) for _, offset, length, _ in prefetcher.stats.fetches)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), "fetched twice"
    assert sum(end - start for start, end in spans) == sum(seg.length for seg in segs)
    assert prefetcher.checked == set(wanted) and not (tmp_path / "spool").exists()


def _prefetcher_over_a_pack(tmp_path, threads: int = 2):
    """A pack of random pages in a memory backend, 20 segments of 1, 2 and 3 pages every 3 pages
    (a segment of 3 touches the next: ranges of several segments), 40 of the pack's 64 pages,
    and a Prefetcher of them all (not started) in ranges of at most 5 pages."""
    import os

    import xxhash

    from ckpt.store.backends.memory import MemoryBackend
    from ckpt.store.blocks.prefetch import Prefetcher

    backend = MemoryBackend()
    pack = os.urandom(64 * 4096)
    backend.put("packs/pa/pack1", pack)
    segs = [Segment("pack1", n * 3 * 4096, 4096 * (1 + n % 3), 1 + n % 3, 0, b"") for n in range(20)]
    for seg in segs:
        seg.checksum = xxhash.xxh3_128_digest(pack[seg.offset:seg.offset + seg.length])
    wanted = list(range(len(segs)))
    prefetcher = Prefetcher(backend, segs, wanted, tmp_path / "spool", threads=threads, range_bytes=5 * 4096)
    assert any(len(r.keys) > 1 for r in prefetcher.ranges)
    return pack, segs, wanted, prefetcher


def _all_down(prefetcher, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while prefetcher.stats.all_down_at is None:
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.005)


def _bytes_of(pack: bytes, seg: Segment) -> bytes:
    return pack[seg.offset:seg.offset + seg.length]


def test_segments_come_from_memory_and_every_range_is_in_the_spool_for_the_cache(tmp_path, monkeypatch):
    import ckpt.store.blocks.prefetch as prefetch

    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path)
    preads = []
    real_pread = prefetch.os.pread
    monkeypatch.setattr(prefetch.os, "pread", lambda *a: preads.append(a) or real_pread(*a))
    prefetcher.start()
    try:
        _all_down(prefetcher)
        assert prefetcher.held_bytes > 0, "nothing read yet: the ranges are held"
        for key in wanted:  # in the order of need, as the page server reads
            with prefetcher.segment(key) as got:
                assert bytes(got) == _bytes_of(pack, segs[key])
        assert preads == [], "read from memory, not from the spool"
        prefetcher.settle()  # every range in the spool
        assert prefetcher.held_bytes == 0, "ranges whose segments were all read are let go"
        spool = (tmp_path / "spool" / "pack1").read_bytes()
        for seg in segs:  # what keep_in hands to the cache
            assert spool[seg.offset:seg.offset + seg.length] == _bytes_of(pack, seg)
        with prefetcher.segment(4) as again:  # read again once let go: from the spool
            assert bytes(again) == _bytes_of(pack, segs[4])
        assert len(preads) == 1
    finally:
        prefetcher.close()
    assert not (tmp_path / "spool").exists()


def test_ranges_beyond_the_memory_bound_are_read_from_the_spool(tmp_path, monkeypatch):
    import ckpt.store.blocks.prefetch as prefetch

    monkeypatch.setattr(prefetch, "HELD_BYTES", 4096)
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path)
    prefetcher.start()
    try:
        _all_down(prefetcher)  # nothing read meanwhile: every range went past the bound
        prefetcher.settle()
        assert prefetcher.held_bytes <= 5 * 4096
        for key in reversed(wanted):
            with prefetcher.segment(key) as got:
                assert bytes(got) == _bytes_of(pack, segs[key])
    finally:
        prefetcher.close()


class _Cache:
    """What keep_in hands packs to: records them."""

    def __init__(self):
        self.kept: list[str] = []

    def copy_room(self) -> int:
        return 1 << 40

    def keep_copy(self, name, path) -> bool:
        self.kept.append(name)
        return True


def test_a_spooled_segment_that_reads_back_wrong_is_fetched_again_and_hashed(tmp_path):
    import pytest

    from ckpt.errors import DamagedBlob

    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path)
    prefetcher.start()
    try:
        _all_down(prefetcher)
        for key in wanted:
            prefetcher.segment(key).release()
        prefetcher.settle()
        with open(tmp_path / "spool" / "pack1", "r+b") as spool:  # a lost writeback: zeros
            spool.seek(segs[7].offset)
            spool.write(bytes(segs[7].length))
        requests = prefetcher.stats.requests
        with prefetcher.segment(7) as again:  # from the store again, hashed
            assert bytes(again) == _bytes_of(pack, segs[7])
        assert prefetcher.stats.requests == requests + 1
        damaged = bytearray(pack)  # and where the store's own bytes are wrong: its damage
        damaged[segs[7].offset] ^= 1
        prefetcher.source.delete(["packs/pa/pack1"])
        prefetcher.source.put("packs/pa/pack1", bytes(damaged))
        with pytest.raises(DamagedBlob):
            prefetcher.segment(7)
        assert 7 not in prefetcher.checked
        cache = _Cache()
        prefetcher.keep_in(cache)  # type: ignore[arg-type]
        assert cache.kept == [], "a spool found wrong is no copy for the cache"
    finally:
        prefetcher.close()


def test_a_range_the_spool_cannot_take_is_fetched_again_when_read_again_and_its_pack_never_kept(tmp_path,
                                                                                               monkeypatch):
    import errno

    import ckpt.store.blocks.prefetch as prefetch

    real_pwrite_all = prefetch.pwrite_all
    failed = []

    def full_once(fd, data, offset):  # the disk full for one range's write, not for later ones
        if not failed:
            failed.append(offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_pwrite_all(fd, data, offset)

    monkeypatch.setattr(prefetch, "pwrite_all", full_once)
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    prefetcher.start()
    try:
        _all_down(prefetcher)
        for key in wanted:
            with prefetcher.segment(key) as got:
                assert bytes(got) == _bytes_of(pack, segs[key])
        prefetcher.settle()
        assert failed and prefetcher.held_bytes == 0, "let go by the same rule as the others"
        hole = next(k for k, seg in enumerate(segs) if seg.offset == failed[0])
        with prefetcher.segment(hole) as again:  # the spool has a hole there: from the store again
            assert bytes(again) == _bytes_of(pack, segs[hole])
        cache = _Cache()
        prefetcher.keep_in(cache)  # type: ignore[arg-type]
        assert cache.kept == [], "a pack with a hole in its spool is never handed to the cache"
    finally:
        prefetcher.close()


def test_a_spool_that_falls_behind_never_holds_up_the_fetch_and_every_range_reaches_it(tmp_path, monkeypatch):
    import threading

    import ckpt.store.blocks.prefetch as prefetch

    real_pwrite_all = prefetch.pwrite_all
    spool_may_write = threading.Event()
    spooled = []

    def slow_spool(fd, data, offset):  # the spool thread stuck in its first write (a slow page cache)
        if threading.current_thread().name == "ckpt-prefetch-spool":
            assert spool_may_write.wait(10)
        spooled.append((offset, offset + len(data)))
        real_pwrite_all(fd, data, offset)

    monkeypatch.setattr(prefetch, "pwrite_all", slow_spool)
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=2)
    prefetcher.start()
    try:
        for key in wanted:  # every segment served while the spool has written nothing
            with prefetcher.segment(key) as got:
                assert bytes(got) == _bytes_of(pack, segs[key])
        _all_down(prefetcher)
        assert not spooled and prefetcher.held_bytes > 0, "read, but held until spooled"
        spool_may_write.set()
        prefetcher.settle()
        assert prefetcher.held_bytes == 0, "each let go once spooled"
        for seg in segs:  # every range in the spool: nothing is fetched twice
            assert any(start <= seg.offset and seg.offset + seg.length <= end for start, end in spooled)
        requests = prefetcher.stats.requests
        with prefetcher.segment(4) as again:  # read again: from the spool, not the store
            assert bytes(again) == _bytes_of(pack, segs[4])
        assert prefetcher.stats.requests == requests
        cache = _Cache()
        prefetcher.keep_in(cache)  # type: ignore[arg-type]
        assert cache.kept == ["packs/pa/pack1"]
        assert (tmp_path / "spool" / "pack1").read_bytes() == pack, "made whole"
    finally:
        spool_may_write.set()
        prefetcher.close()


def test_the_buffer_pool_hands_a_slab_out_again_once_given_back_and_keeps_a_few():
    from ckpt.store.blocks.prefetch import BufferPool

    pool = BufferPool(keep=2, size=8192, smallest=1024)
    first, second, third = pool.take(5000), pool.take(8192), pool.take(1024)
    assert all(len(b) == 8192 and not b.readonly for b in (first, second, third))
    small, large = pool.take(100), pool.take(10000)
    assert (len(small), len(large)) == (100, 10000), "too small or too large: a buffer of its own size"
    for buffer in (first, second, third, small, large):
        pool.give(buffer)
    assert pool.free == 2, "two slabs kept (keep), the third and the buffers of their own size dropped"
    again = {id(pool.take(3000).obj), id(pool.take(3000).obj)}
    assert again == {id(first.obj), id(second.obj)}, "slabs used again"
    pool.give(first)
    pool.close()
    assert pool.free == 0
    pool.give(second)
    assert pool.free == 0, "none kept once closed"


def _a_held_range(prefetcher):
    """Once every range is down and spooled, none read (each held, in a buffer of the pool):
    a range of several segments, its slab, and the buffers given back to the pool from now on."""
    _all_down(prefetcher)
    prefetcher.settle()
    taken = next(r for r in prefetcher.ranges if len(r.keys) > 1)
    given: list = []
    real_give = prefetcher.pool.give
    prefetcher.pool.give = lambda buffer: (given.append(buffer), real_give(buffer))[1]
    return taken, taken.slab, given


def test_a_ranges_buffer_goes_back_to_the_pool_only_once_no_reader_copies_out_of_it(tmp_path):
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    prefetcher.start()
    try:
        taken, slab, given = _a_held_range(prefetcher)
        assert slab is not None and taken.buffer is not None
        with prefetcher._held_lock:
            taken.readers += 1  # another page server thread, in the middle of its copy
        for key in taken.keys:  # its every segment read: the range is let go...
            with prefetcher.segment(key) as got:
                assert bytes(got) == _bytes_of(pack, segs[key])
        assert taken.buffer is None and taken.slab is slab, "...its buffer not handed out while copied from"
        assert not [b for b in given if b is slab]
        with prefetcher._held_lock:
            taken.readers -= 1
            prefetcher._recycle(taken)
        assert taken.slab is None and [b for b in given if b is slab], "given back once the copy is made"
    finally:
        prefetcher.close()


def test_a_lent_segment_is_read_in_place_and_its_buffer_goes_back_only_once_given_back(tmp_path):
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    prefetcher.start()
    try:
        taken, slab, given = _a_held_range(prefetcher)
        lent = [prefetcher.lend(key, segs[key].pages) for key in taken.keys]
        assert all(item is not None for item in lent)
        for key, (view, _) in zip(taken.keys, lent, strict=True):
            assert bytes(view) == _bytes_of(pack, segs[key])
            assert view.obj is slab.obj, "a copy, not the range's buffer"
        assert taken.buffer is None, "every segment read: the range is let go..."
        for view, give_back in lent[:-1]:
            view.release()
            give_back()
        assert not [b for b in given if b is slab], "...its buffer not handed out while one is still lent"
        lent[-1][0].release()
        lent[-1][1]()
        assert taken.slab is None and [b for b in given if b is slab], "given back with the last"
        assert prefetcher.lend(taken.keys[0], 1) is None, "its buffer is gone: read from the spool"
        with prefetcher.segment(taken.keys[0]) as again:
            assert bytes(again) == _bytes_of(pack, segs[taken.keys[0]])
    finally:
        prefetcher.close()


def test_a_reader_borrows_segments_checked_by_the_fetch_in_parts_until_every_page_was_read(tmp_path):
    from ckpt.store.blocks.blockstore import _SegmentReader
    from ckpt.store.blocks.prefetch import PrefetchedRanges

    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=2)
    backend = prefetcher.source
    index = type("Index", (), {"segment_list": segs})()
    blocks = type("Blocks", (), {"record_damage": lambda self, seg: None})()
    prefetcher.start()
    reader = _SegmentReader(blocks, index, PrefetchedRanges(backend.reader(), prefetcher, backend))
    try:
        _all_down(prefetcher)
        whole = next(k for k in wanted if segs[k].pages == 3)
        fetched = next(r for r in prefetcher.ranges if whole in r.keys)
        assert fetched.buffer is not None
        buffer = fetched.buffer.obj
        with reader.borrowed(whole, 0, 3) as pages:
            assert bytes(pages) == _bytes_of(pack, segs[whole])
            assert pages.obj is buffer and whole not in reader.held, "read in place, not held"
        part = next(k for k in wanted if segs[k].pages == 3 and k != whole)
        fetched = next(r for r in prefetcher.ranges if part in r.keys)
        with reader.borrowed(part, 1, 2) as pages:
            assert bytes(pages) == _bytes_of(pack, segs[part])[4096:]
            assert pages.obj is fetched.buffer.obj and part not in reader.held
        assert part in fetched.unread, "a part read: the rest may still be read from the buffer"
        with reader.borrowed(part, 0, 1) as pages:
            assert bytes(pages) == _bytes_of(pack, segs[part])[:4096]
        assert part not in fetched.unread, "every page read"
        unchecked = next(k for k in wanted if segs[k].pages == 2)
        prefetcher.checked.discard(unchecked)  # as if its fetch had found it wrong
        assert reader.ranges.lend("packs/pa/pack1", segs[unchecked].offset, segs[unchecked].length,
                                  segs[unchecked].checksum, 2) is None
        with reader.borrowed(unchecked, 0, 2) as pages:  # read and checked the usual way
            assert bytes(pages) == _bytes_of(pack, segs[unchecked])
    finally:
        reader.close()
        prefetcher.close()


@pytest.mark.parametrize("lending", [False, True], ids=["copied", "lent"])
def test_readers_on_many_threads_read_every_segment_right_while_buffers_are_used_again(tmp_path, lending):
    """Four threads read every segment, twice, in orders of their own, while three fetch (and
    the readers fetch what they need first themselves): what each reads is the pack's bytes,
    and every buffer is let go in the end. Lent: each read in place where its range's
    buffer is still held (Prefetcher.lend), its bytes compared after a pause, while the other
    threads read on and let buffers go (each overwritten as it goes back to the pool)."""
    import random
    import threading
    import time

    import ckpt.store.blocks.prefetch as prefetch

    made = []
    real_fresh_buffer = prefetch.fresh_buffer

    def counting(size):
        made.append(size)
        return real_fresh_buffer(size)

    prefetch.fresh_buffer = counting
    try:
        pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=3)
        real_give = prefetcher.pool.give

        def poisoned(buffer):  # a buffer given back while a reader still reads it reads wrong
            buffer[:] = b"\xa5" * len(buffer)
            real_give(buffer)

        prefetcher.pool.give = poisoned
        wrong: list[int] = []
        read_in_place: list[int] = []

        def read_all(seed: int) -> None:
            order = wanted * 2
            random.Random(seed).shuffle(order)
            for key in order:
                lent = prefetcher.lend(key, segs[key].pages) if lending else None
                if lent is not None:
                    read_in_place.append(key)
                    view, give_back = lent
                    try:
                        time.sleep(0.0005)  # the others read meanwhile: buffers would be used again
                        if bytes(view) != _bytes_of(pack, segs[key]):
                            wrong.append(key)
                    finally:
                        view.release()
                        give_back()
                    continue
                with prefetcher.segment(key) as got:
                    if bytes(got) != _bytes_of(pack, segs[key]):
                        wrong.append(key)

        prefetcher.start()
        try:
            readers = [threading.Thread(target=read_all, args=(seed,)) for seed in range(4)]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(30)
            assert not any(reader.is_alive() for reader in readers), "a reader did not end"
            assert not wrong, f"segments read wrong: {wrong}"
            assert bool(read_in_place) == lending
            prefetcher.settle()
            assert all(r.slab is None and r.buffer is None for r in prefetcher.ranges)
            assert prefetcher.held_bytes == 0 and prefetcher.pool.free == 0, "the pool closed once all was down"
        finally:
            prefetcher.close()
    finally:
        prefetch.fresh_buffer = real_fresh_buffer
    assert made


def test_buffers_are_used_again_when_the_reader_keeps_up_with_the_fetch(tmp_path, monkeypatch):
    """A fetch slower than the reader (as a restore from S3 is): each range is read and spooled
    before the next one is down, and its buffer goes to a next one (two buffers in all, here:
    fewer than ranges asserted, the machine may be slow)."""
    import time

    import ckpt.store.blocks.prefetch as prefetch

    made = []
    real_fresh_buffer = prefetch.fresh_buffer
    monkeypatch.setattr(prefetch, "fresh_buffer", lambda size: made.append(size) or real_fresh_buffer(size))
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    real_get_view = prefetcher.source.get_view

    def slow_get_view(*args, **kwargs):
        time.sleep(0.02)
        return real_get_view(*args, **kwargs)

    prefetcher.source.get_view = slow_get_view
    ranges = [list(r.keys) for r in prefetcher.ranges]
    prefetcher.start()
    try:
        for keys in ranges:  # in the order of the fetch
            for key in keys:
                with prefetcher.segment(key) as got:
                    assert bytes(got) == _bytes_of(pack, segs[key])
        prefetcher.settle()
    finally:
        prefetcher.close()
    assert len(ranges) > 5 and len(made) < len(ranges), f"{len(made)} buffers made for {len(ranges)} ranges"


def test_keep_in_fetches_the_gaps_joined_and_in_parallel_and_makes_the_pack_whole(tmp_path, monkeypatch):
    import os
    import threading

    import xxhash

    import ckpt.store.blocks.prefetch as prefetch
    from ckpt.store.backends.memory import MemoryBackend
    from ckpt.store.blocks.prefetch import Prefetcher

    backend = MemoryBackend()
    monkeypatch.setattr(backend, "requests_in_flight", lambda: 4)  # as a store a round trip away
    pack = os.urandom(64 * 4096)
    backend.put("packs/pa/pack1", pack)
    # Two pages fetched of every four: 16 gaps of two pages, the last at the pack's end.
    segs = [Segment("pack1", n * 4 * 4096, 2 * 4096, 2, 0, b"") for n in range(16)]
    for seg in segs:
        seg.checksum = xxhash.xxh3_128_digest(_bytes_of(pack, seg))
    gap_reads: list[tuple[int, int, str]] = []
    real_get_view = backend.get_view
    # The first two gap reads wait for each other: only two threads reading at once pass.
    together = threading.Barrier(2, timeout=5)

    def counted(name, offset, length, **kwargs):
        if threading.current_thread().name.startswith("ckpt-keep"):
            gap_reads.append((offset, length, threading.current_thread().name))
            if len(gap_reads) <= 2 and prefetch.KEEP_JOIN == 0:
                together.wait()
        return real_get_view(name, offset, length, **kwargs)

    monkeypatch.setattr(backend, "get_view", counted)
    for join, requests in ((prefetch.KEEP_JOIN, 1), (0, 16)):
        monkeypatch.setattr(prefetch, "KEEP_JOIN", join)
        gap_reads.clear()
        prefetcher = Prefetcher(backend, segs, list(range(16)), tmp_path / f"spool-{join}", threads=2,
                                range_bytes=2 * 4096)
        prefetcher.start()
        try:
            _all_down(prefetcher)
            for key in range(16):
                prefetcher.segment(key).release()
            cache = _Cache()
            prefetcher.keep_in(cache)  # type: ignore[arg-type]
            assert cache.kept == ["packs/pa/pack1"]
            assert (tmp_path / f"spool-{join}" / "pack1").read_bytes() == pack, "made whole"
            assert len(gap_reads) == requests, gap_reads
            if requests > 1:
                assert not together.broken, "the gaps fetched by several threads at once"
        finally:
            prefetcher.close()


def test_a_segment_read_in_parts_counts_as_read_once_the_pages_wanted_of_it_were_lent(tmp_path):
    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    three = [k for k in wanted if segs[k].pages == 3]
    prefetcher.pages_wanted = {three[0]: 2}  # (its third page no process of the plan has)
    prefetcher.start()
    try:
        _all_down(prefetcher)
        prefetcher.settle()
        first, second = (next(r for r in prefetcher.ranges if key in r.keys) for key in three[:2])
        for key, pages, still_unread in ((three[0], 1, True), (three[0], 1, False), (three[1], 2, True)):
            lent = prefetcher.lend(key, pages)
            assert lent is not None
            lent[0].release()
            lent[1]()
            lent[1]()  # given back twice: counted once
            assert (key in (first if key == three[0] else second).unread) == still_unread
        assert first.readers == 0 == second.readers
    finally:
        prefetcher.close()


def test_a_segment_whose_fetch_failed_is_not_lent_and_its_damage_is_recorded(tmp_path):
    from ckpt.errors import DamagedBlob, DamagedCheckpoint
    from ckpt.store.blocks.blockstore import _SegmentReader
    from ckpt.store.blocks.prefetch import PrefetchedRanges

    pack, segs, wanted, prefetcher = _prefetcher_over_a_pack(tmp_path, threads=1)
    backend = prefetcher.source
    victim = next(r for r in prefetcher.ranges if len(r.keys) > 1)
    real_get_view = backend.get_view

    def failing(name, offset, length, allocate=None):
        if victim.start <= offset < victim.end:
            raise DamagedBlob(f"chunk at {offset} fails authentication", name=name)
        return real_get_view(name, offset, length, allocate)

    backend.get_view = failing
    recorded: list = []
    blocks = type("Blocks", (), {"record_damage": lambda self, seg: recorded.append(seg)})()
    index = type("Index", (), {"segment_list": segs})()
    reader = _SegmentReader(blocks, index, PrefetchedRanges(backend.reader(), prefetcher, backend))
    prefetcher.start()
    try:
        key = victim.keys[0]
        assert prefetcher.lend(key, segs[key].pages) is None
        with pytest.raises(DamagedCheckpoint), reader.borrowed(key, 0, segs[key].pages):
            pass
        assert recorded == [segs[key]], "the store's damage is recorded, as a read through view() records it"
    finally:
        reader.close()
        prefetcher.close()
