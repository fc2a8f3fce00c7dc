"""Images stored as CRIU closes them (ckpt/dump/early_ingest.py), with real files, a real local
store and the kernel's inotify: what is taken reads back as written, and the staging area
still holds every image; an image that changed after it was read, or one that could not be
stored, makes take() give up (the caller ingests everything again) and leaves no pack behind."""

from __future__ import annotations

import os
import time

from ckpt.dump.early_ingest import EarlyIngest
from ckpt.store import Store
from ckpt.store.blocks.blockstore import PAGE, BlockStore
from ckpt.store.objects import hash_file
from ckpt.system.inotify import ClosedFiles


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def wait_for_ingest(ahead: EarlyIngest, name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in ahead._identities:  # noqa: SLF001 - the moment the image was read
        assert time.monotonic() < deadline, f"{name} was never stored"
        time.sleep(0.01)


def packs(store_dir) -> list[str]:
    """Packs, and packs being written, in a local store (under packs/)."""
    return [name for _, _, files in os.walk(store_dir / "packs") for name in files]


def setup(tmp_path, codec: str = "zstd") -> tuple[EarlyIngest, Store]:
    images = tmp_path / "images"
    images.mkdir()
    (tmp_path / "store").mkdir()
    store = Store(tmp_path / "store")
    ahead = EarlyIngest(images, store.objects, codec, tmp_path / "early")
    ahead.start()
    return ahead, store


def test_images_closed_while_watched_are_stored_and_read_back(tmp_path):
    ahead, store = setup(tmp_path)
    first, second = os.urandom(64 * PAGE), os.urandom(3 * PAGE) * 2
    write(tmp_path / "images" / "pages-1.img", first)
    wait_for_ingest(ahead, "pages-1.img")
    write(tmp_path / "images" / "pages-2.img", second)  # closed just before the stop: taken too
    core = b"core of one process " * 100
    for name in ("core-1.img", "core-2.img"):  # alike: one object for both
        write(tmp_path / "images" / name, core)
    run = ahead.take()
    assert run is not None and run.stored == {"pages-1.img", "pages-2.img", "core-1.img", "core-2.img"}
    assert sorted(run.pages.page_lists) == ["pages-1.img", "pages-2.img"]
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(run.stored), "an image left staging"
    entries = {e.name: e for e in run.files.entries}
    assert sorted(entries) == ["core-1.img", "core-2.img"]
    assert entries["core-1.img"].hash == entries["core-2.img"].hash == hash_file(tmp_path / "images" / "core-1.img")
    back = tmp_path / "core-back"
    store.objects.read_into(entries["core-2.img"], back)
    assert back.read_bytes() == core
    page_lists, stats, written = run.pages.finish()
    ahead.close()  # after the commit: changes nothing
    assert stats.pages == 70 and stats.new_pages == 67, stats  # the repeated pages once
    assert packs(tmp_path / "store"), "no pack was written"  # (what the tests below look for)
    fresh = BlockStore(store.backend)
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


def test_an_object_stored_as_it_is_is_never_the_staging_image_itself(tmp_path):
    """Stored uncompressed, an object is the file the store renames into place: from a copy,
    so that the staging image (what a fallback ingests again) and the object stay apart."""
    ahead, store = setup(tmp_path, codec="none")
    image = tmp_path / "images" / "fs-1.img"
    write(image, b"an image stored as it is")
    run = ahead.take()
    assert run is not None and [e.name for e in run.files.entries] == ["fs-1.img"]
    assert os.stat(image).st_nlink == 1, "the staging image is also the store's object"
    back = tmp_path / "back"
    store.objects.read_into(run.files.entries[0], back)
    assert back.read_bytes() == image.read_bytes()
    ahead.close()


def test_closing_after_taking_drops_a_pack_nobody_committed(tmp_path):
    ahead, _ = setup(tmp_path)
    # Pages that compress: written into a new pack (random ones would make the image itself
    # the pack, at the commit).
    write(tmp_path / "images" / "pages-1.img", b"".join(bytes([k]) * PAGE for k in range(8)))
    wait_for_ingest(ahead, "pages-1.img")
    assert ahead.take() is not None
    assert packs(tmp_path / "store"), "nothing was written"
    ahead.close()  # (the ingest after it failed before committing)
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
