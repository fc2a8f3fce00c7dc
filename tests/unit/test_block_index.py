"""BlockIndex.find: sorted searches over index files, checked against a plain dict."""

import os
import random
from unittest import mock

import blake3
import numpy as np
import pytest

from ckpt.errors import DamagedCheckpoint
from ckpt.store.backends import LocalBackend
from ckpt.store.blocks.index import BlockIndex
from ckpt.store.blocks.index import render_index
from ckpt.store.blocks.segments import ID_LEN, Segment


def as_written(ids, segment_numbers, positions):
    return (ids, np.asarray(segment_numbers, dtype="<u4").tobytes(), np.asarray(positions, dtype="<u2").tobytes())


def index_file(ids: list[bytes], sort: bool = True, pack: str = "ab" * 16) -> tuple[str, bytes]:
    """An index file naming each id at its own page of a few segments of one pack (unsorted:
    as ckpt wrote them before their entries were in id order)."""
    segments = [Segment(pack, k << 20, 100, 256, 0, bytes(16)) for k in range(len(ids) // 256 + 1)]
    columns = (b"".join(ids), [k // 256 for k in range(len(ids))], [k % 256 for k in range(len(ids))])
    if sort:
        data = render_index(segments, *columns)
    else:
        with mock.patch("ckpt.store.blocks.index.in_id_order", as_written):
            data = render_index(segments, *columns)
    return blake3.blake3(data).hexdigest(), data


def expected(index: BlockIndex, wanted: list[bytes]) -> list[int]:
    return [index.pages.get(w, -1) for w in wanted]


def random_ids(n: int) -> list[bytes]:
    return [os.urandom(ID_LEN) for _ in range(n)]


@pytest.mark.parametrize("sizes,sort", [
    ([5000], True),  # one large sorted file: searched for each wanted id
    ([5000, 40, 3], True),  # small files: each of their ids searched among the wanted ones
    ([3000, 2000], False),  # files written before index files were sorted
    ([0, 10], True),  # an empty index file
])
def test_find_agrees_with_a_dict(sizes, sort):
    index = BlockIndex()
    held = []
    for size in sizes:
        ids = random_ids(size)
        held += ids
        index.add_file(*index_file(ids, sort))
    rng = random.Random(7)
    wanted = rng.sample(held, min(len(held), 1500)) + random_ids(200)
    wanted += wanted[:50]  # a page list repeats ids (a zero page, many times)
    rng.shuffle(wanted)
    found = index.find(b"".join(wanted)).tolist()
    assert found == expected(index, wanted)
    held_set = set(held)
    assert [f >= 0 for f in found] == [w in held_set for w in wanted]
    assert index.held(b"".join(wanted)).tolist() == [f >= 0 for f in found]


def test_ids_that_share_their_first_half():
    """Two ids with the same first 8 bytes (which the searches compare first) stay apart."""
    base = os.urandom(8)
    twins = [base + os.urandom(8) for _ in range(4)]
    others = random_ids(3000)
    index = BlockIndex()
    index.add_file(*index_file(others + twins[:3]))  # large and sorted: searched per wanted id
    small = BlockIndex()
    small.add_file(*index_file(twins[1:3]))  # small: searched the other way round
    for idx in (index, small):
        # (100 more ids: a file of 2 is searched the other way round, among the wanted ids)
        wanted = [twins[3], twins[2], twins[0], twins[1], twins[2]] + others[:100]
        assert idx.find(b"".join(wanted)).tolist() == expected(idx, wanted)
    assert index.held(b"".join(twins)).tolist() == [True, True, True, False]


def test_a_page_in_two_index_files_and_a_damaged_copy():
    page = os.urandom(ID_LEN)
    first_ids, second_ids = [page] + random_ids(10), random_ids(5) + [page]
    index = BlockIndex()
    index.add_file(*index_file(first_ids))
    index.add_file(*index_file(second_ids, pack="cd" * 16))
    assert index.find(page).tolist()[0] >= 0
    # The copy in the first file's segment is damaged: the healthy copy in the second is found.
    first_location = dict(zip(first_ids, index._columns[0].locations().tolist(), strict=True))[page]
    index.mark_damaged([first_location >> 16])
    location = index.find(page).tolist()[0]
    assert location >> 16 != first_location >> 16
    assert index.held(page).tolist() == [True]
    # Both copies damaged: still located (a restore names the damage), but not held.
    index.mark_damaged([location >> 16])
    assert index.find(page).tolist()[0] >= 0
    assert index.held(page).tolist() == [False]


def same_rows(now: list, earlier: list) -> np.ndarray:
    """Each row of now paired with the same row of earlier, as far as both go: one stretch."""
    return np.array([[0, 0, min(len(now), len(earlier))]], dtype=np.int64)


@pytest.mark.parametrize("earlier_rows", [
    "same",  # the earlier checkpoint's list: most rows equal
    "shorter",  # the target grew since
    "longer",  # it shrank
    "other",  # a PID reused by another program: nothing in common
])
def test_missing_with_an_earlier_page_list_agrees_with_a_search(earlier_rows):
    rng = random.Random(11)
    held = random_ids(4000)
    index = BlockIndex()
    index.add_file(*index_file(held[:3000]))
    index.add_file(*index_file(held[3000:]))
    earlier = rng.sample(held, 2000)
    now = list(earlier)
    for row in rng.sample(range(2000), 40):  # rewritten pages: new ones, or pages moved here
        now[row] = os.urandom(ID_LEN) if row % 2 else rng.choice(held)
    if earlier_rows == "shorter":
        earlier, now = earlier[:1500], now + random_ids(30) + held[:30]
    elif earlier_rows == "longer":
        earlier = earlier + random_ids(100)
    elif earlier_rows == "other":
        earlier = random_ids(2000)
    page_list = b"".join(now)
    want = index.missing(page_list)
    assert want == [row for row, page_id in enumerate(now) if page_id not in set(held)]
    assert index.missing(page_list, (b"".join(earlier), same_rows(now, earlier))) == want


def test_missing_with_earlier_rows_at_other_places(monkeypatch):
    """Rows paired by address, not by position; a row with no earlier page is searched."""
    earlier, new = random_ids(5), random_ids(2)
    index = BlockIndex()
    index.add_file(*index_file(earlier))
    searched = []
    real_held = BlockIndex.held
    monkeypatch.setattr(BlockIndex, "held", lambda self, ids: searched.append(len(ids) // ID_LEN)
                        or real_held(self, ids))
    page_list = b"".join([earlier[3], new[0], earlier[0], new[1], earlier[1]])
    # (row, earlier row, count): row 3's address held earlier[4] then; row 4's held nothing
    pieces = np.array([[0, 3, 1], [2, 0, 1], [3, 4, 1]])
    assert index.missing(page_list, (b"".join(earlier), pieces)) == [1, 3]
    assert searched == [3], "rows 0 and 2 match their earlier ids: only rows 1, 3 and 4 are searched"
    # Stretches that do not fit the lists (another image's): a plain search, same answer.
    for wrong in ([[0, 0, 6]], [[0, 3, 3]], [[-1, 0, 1]], [[0, 0, 0]], [[0, 0]]):
        assert index.missing(page_list, (b"".join(earlier), np.array(wrong))) == [1, 3]


def test_an_earlier_page_list_is_not_trusted_once_damage_is_recorded():
    held = random_ids(600)
    index = BlockIndex()
    index.add_file(*index_file(held))
    page_list = b"".join(held)
    index.mark_damaged([0])  # the first segment (256 pages): its pages must be stored again
    assert index.missing(page_list, (page_list, np.array([[0, 0, 600]]))) == list(range(256))


def test_copies_outside_a_pack_with_recorded_damage_are_preferred():
    """The other segments of a pack with a damaged one are suspect (not checked since): a
    copy elsewhere is located first."""
    in_a, in_both = random_ids(600), random_ids(20)
    index = BlockIndex()
    index.add_file(*index_file(in_a + in_both, pack="aa" * 16))
    index.add_file(*index_file(in_both, pack="bb" * 16))
    index.add_file(*index_file(random_ids(5), pack="cc" * 16))
    assert index.suspect == set()
    index.mark_damaged([0])  # pack aa's first segment
    assert index.suspect == {0, 1, 2}
    assert {index.segment_list[location >> 16].pack for location in index.find(b"".join(in_both)).tolist()} \
        == {"bb" * 16}
    assert index.held(b"".join(in_a)).tolist() == [False] * 256 + [True] * 344


def test_index_files_are_written_in_id_order():
    ids = random_ids(1000)
    name, data = index_file(ids)
    index = BlockIndex()
    index.add_file(name, data)
    assert index._columns[0].sorted
    assert index._columns[0].id_list() == sorted(ids)
    unsorted = BlockIndex()
    unsorted.add_file(*index_file(ids, sort=False))
    assert not unsorted._columns[0].sorted


@pytest.mark.parametrize("damage", ["truncate", "extend", "segment"])
def test_damaged_index_files_are_refused(damage):
    ids = random_ids(300)
    _, data = index_file(ids)
    if damage == "truncate":
        data = data[:-3]
    elif damage == "extend":
        data += b"\0"
    else:  # an entry naming a segment past the file's segments
        data = data[:-300 * 6] + np.full(300, 99, dtype="<u4").tobytes() + data[-300 * 2:]
    with pytest.raises(DamagedCheckpoint, match="is damaged"):
        BlockIndex().add_file(blake3.blake3(data).hexdigest(), data)


def test_an_index_loaded_ahead_is_the_one_used(tmp_path):
    from ckpt.store.blocks.blockstore import BlockStore

    image = tmp_path / "pages-1.img"
    image.write_bytes(os.urandom(4096 * 8))
    page_lists, _, _ = BlockStore(LocalBackend(tmp_path / "blocks")).ingest([image], lambda _: "none")
    blocks = BlockStore(LocalBackend(tmp_path / "blocks"))
    blocks.preload_index()
    index = blocks.index()
    assert blocks._preload is None and len(index.files) == 1
    assert index.held(page_lists[image.name]).all()
    assert blocks.index() is index


def test_an_index_that_fails_to_load_ahead_fails_where_it_is_used(tmp_path):
    from ckpt.store.blocks.blockstore import BlockStore

    from ckpt.store.blocks.segments import INDEX_PREFIX

    class IndexesRefused(LocalBackend):
        """Its index files cannot be listed: loading the index raises."""

        def list(self, prefix, incomplete=False):
            if prefix == INDEX_PREFIX:
                raise PermissionError("no")
            return super().list(prefix, incomplete)

    blocks = BlockStore(IndexesRefused(tmp_path / "blocks"))
    blocks.preload_index()  # the thread says nothing...
    with pytest.raises(PermissionError):
        blocks.index()  # ...the caller loads again and gets the error
