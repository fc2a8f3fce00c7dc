"""Merging index files (docs/design.md, "Merging index files"): every page stays found, each
id once, and an interrupted merge loses nothing."""

import os
import pathlib

import pytest

from ckpt.commands import dump as checkpoint
from ckpt.reporting import NullReporter
from ckpt.store import Store
from ckpt.store.backends import LocalBackend
from ckpt.store.blocks.blockstore import ID_LEN, MERGE_ABOVE, MERGE_COUNT, PAGE, BlockStore
from tests.helpers import env_settings


def dump_pages(blocks: BlockStore, tmp_path, name: str, data: bytes) -> bytes:
    image = tmp_path / f"pages-{name}.img"
    image.write_bytes(data)
    page_lists, _, _ = blocks.ingest([image], lambda _: "zstd")
    return page_lists[image.name]


def store_with_index_files(tmp_path, count: int) -> tuple[BlockStore, dict[str, tuple[bytes, bytes]]]:
    """A block store with `count` index files, each from a dump of its own few pages (file k
    holds k % 5 + 1 pages, so that their sizes differ)."""
    blocks = BlockStore(LocalBackend(tmp_path / "blocks"))
    dumps = {}
    for k in range(count):
        data = os.urandom((k % 5 + 1) * PAGE)
        dumps[str(k)] = (data, dump_pages(blocks, tmp_path, str(k), data))
    return blocks, dumps


def assert_every_page_is_read_back(blocks: BlockStore, dumps, tmp_path) -> None:
    fresh = BlockStore(blocks.backend)  # as the next command loads it
    for name, (data, page_list) in dumps.items():
        out = tmp_path / f"out-{name}.img"
        out.unlink(missing_ok=True)
        fresh.write_image(f"pages-{name}.img", page_list, out, check_ids=True)
        assert out.read_bytes() == data


def test_the_files_with_fewest_entries_are_merged_into_one(tmp_path):
    blocks, dumps = store_with_index_files(tmp_path, MERGE_ABOVE + 3)
    before = {name: blocks.index().columns[k].count for k, name in enumerate(blocks.index().files)}
    merged = blocks.merge_index_files()
    assert len(merged) == MERGE_COUNT
    assert sorted(before[name] for name in merged) == sorted(before.values())[:MERGE_COUNT]
    assert len(blocks.index_file_names()) == MERGE_ABOVE + 3 - MERGE_COUNT + 1
    assert sum(blocks.index().columns[k].count for k in range(len(blocks.index().files))) == sum(before.values())
    assert_every_page_is_read_back(blocks, dumps, tmp_path)
    assert blocks.merge_index_files() == [], "at most MERGE_ABOVE files: nothing to do"


def test_a_page_two_files_name_is_named_once_by_the_merged_file(tmp_path):
    """Two dumps that stored the same page concurrently (neither saw the other's index)."""
    blocks, dumps = store_with_index_files(tmp_path, MERGE_ABOVE)
    shared = os.urandom(PAGE)  # one page: both files are among the smallest, and merged
    unaware = {name: BlockStore(blocks.backend) for name in ("a", "b")}
    for store in unaware.values():
        store.index()  # both loaded before either stored the page
    for name, store in unaware.items():
        dumps[name] = (shared, dump_pages(store, tmp_path, name, shared))
    blocks.forget_index()
    assert len(blocks.merge_index_files()) == MERGE_COUNT
    index = BlockStore(blocks.backend).index()
    ids = [column.id_bytes() for column in index.columns]
    for file_ids in ids:
        entries = [file_ids[i:i + ID_LEN] for i in range(0, len(file_ids), ID_LEN)]
        assert len(entries) == len(set(entries)), "an id twice in one index file"
    assert_every_page_is_read_back(blocks, dumps, tmp_path)


def test_an_interrupted_merge_loses_nothing_and_the_next_one_finishes(tmp_path, monkeypatch):
    blocks, dumps = store_with_index_files(tmp_path, MERGE_ABOVE + 1)
    real_unlink = pathlib.Path.unlink

    def killed(self, *args, **kwargs):  # as if kill -9 came once the merged file was written
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        blocks.merge_index_files()
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    assert len(blocks.index_file_names()) == MERGE_ABOVE + 2  # the merged file, and all the old ones
    assert_every_page_is_read_back(blocks, dumps, tmp_path)
    blocks.forget_index()
    assert blocks.merge_index_files()
    assert_every_page_is_read_back(blocks, dumps, tmp_path)


def test_recorded_damage_leaves_the_files_to_prune(tmp_path):
    blocks, _ = store_with_index_files(tmp_path, MERGE_ABOVE + 1)
    blocks.record_damage(blocks.index().segment_list[0])
    assert blocks.merge_index_files() == []
    assert len(blocks.index_file_names()) == MERGE_ABOVE + 1


def test_a_dump_merges_only_if_the_store_is_free_at_once(tmp_path):
    store = Store.open(tmp_path / "store", create=True, settings=env_settings())
    for k in range(MERGE_ABOVE + 1):
        dump_pages(store.blocks, tmp_path, str(k), os.urandom(PAGE))
    with store.lock(exclusive=False):  # another command reading the store
        checkpoint._merge_index_files(store, NullReporter())
    assert len(store.blocks.index_file_names()) == MERGE_ABOVE + 1
    checkpoint._merge_index_files(store, NullReporter())
    assert len(store.blocks.index_file_names()) == MERGE_ABOVE + 1 - MERGE_COUNT + 1
