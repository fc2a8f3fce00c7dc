"""Pages images stored as CRIU closes them (ckpt/dump/pages_ahead.py), with real files, a real
local store and the kernel's inotify: what is taken reads back as written; an image that
changed after it was read, or one that could not be stored, makes take() give up (the caller
ingests everything again) and leaves no pack behind."""

from __future__ import annotations

import os
import time

from ckpt.dump.pages_ahead import PagesAhead
from ckpt.store.backends import LocalBackend
from ckpt.store.blocks.blockstore import PAGE, BlockStore
from ckpt.system.inotify import ClosedFiles


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def wait_for_ingest(ahead: PagesAhead, name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in ahead._identities:  # noqa: SLF001 - the moment the image was read
        assert time.monotonic() < deadline, f"{name} was never stored"
        time.sleep(0.01)


def packs(store_dir) -> list[str]:
    """Packs, and packs being written, in a local store (under packs/)."""
    return [name for _, _, files in os.walk(store_dir / "packs") for name in files]


def setup(tmp_path) -> tuple[PagesAhead, BlockStore]:
    images = tmp_path / "images"
    images.mkdir()
    blocks = BlockStore(LocalBackend(tmp_path / "store"))
    ahead = PagesAhead(images, blocks, lambda _image: "none")
    ahead.start()
    return ahead, blocks


def test_images_closed_while_watched_are_stored_and_read_back(tmp_path):
    ahead, blocks = setup(tmp_path)
    first, second = os.urandom(64 * PAGE), os.urandom(3 * PAGE) * 2
    write(tmp_path / "images" / "pages-1.img", first)
    wait_for_ingest(ahead, "pages-1.img")
    write(tmp_path / "images" / "pages-2.img", second)  # closed just before the stop: taken too
    write(tmp_path / "images" / "core-1.img", b"not pages")
    run = ahead.take()
    ahead.close()
    assert run is not None and sorted(run.page_lists) == ["pages-1.img", "pages-2.img"]
    page_lists, stats, written = run.finish()
    assert stats.pages == 70 and stats.new_pages == 67, stats  # the repeated pages once
    assert packs(tmp_path / "store"), "no pack was written"  # (what the tests below look for)
    fresh = BlockStore(blocks.backend)
    for name, data in (("pages-1.img", first), ("pages-2.img", second)):
        dest = tmp_path / f"back-{name}"
        fresh.write_image(name, page_lists[name], dest)
        assert dest.read_bytes() == data


def test_an_image_changed_after_it_was_read_drops_the_early_ingest(tmp_path):
    ahead, _ = setup(tmp_path)
    image = tmp_path / "images" / "pages-1.img"
    write(image, os.urandom(16 * PAGE))
    wait_for_ingest(ahead, "pages-1.img")
    with open(image, "ab") as f:
        f.write(os.urandom(PAGE))
    assert ahead.take() is None
    ahead.close()
    assert packs(tmp_path / "store") == [], "the dropped ingest left a pack"


def test_an_image_that_cannot_be_stored_makes_take_give_up(tmp_path):
    ahead, _ = setup(tmp_path)
    write(tmp_path / "images" / "pages-1.img", os.urandom(PAGE + 10))  # not whole pages
    assert ahead.take() is None
    ahead.close()
    assert packs(tmp_path / "store") == []


def test_closing_without_taking_drops_what_was_stored(tmp_path):
    ahead, _ = setup(tmp_path)
    write(tmp_path / "images" / "pages-1.img", os.urandom(8 * PAGE))
    wait_for_ingest(ahead, "pages-1.img")
    ahead.close()
    assert packs(tmp_path / "store") == []


def test_closed_files_names_each_file_closed_after_writing(tmp_path):
    with ClosedFiles(tmp_path) as closed:
        write(tmp_path / "a", b"1")
        (tmp_path / "b").touch()
        with open(tmp_path / "a", "rb"):
            pass  # closed after reading: not named
        names = closed.wait(1.0)
        deadline = time.monotonic() + 5
        while len(names) < 2 and time.monotonic() < deadline:
            names += closed.wait(0.1)
        assert names == ["a", "b"]
        assert closed.wait(0.05) == []
