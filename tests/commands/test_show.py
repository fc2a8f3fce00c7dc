"""ckpt/commands/show.py: what `ckpt show` reads out of a checkpoint's images."""

import pytest

from ckpt.commands.show import inspect
from ckpt.errors import CheckpointNotFound
from tests.commands.conftest import BASE, PAGE, Images, as_json, page


def test_show_reads_the_processes_mappings_pages_and_files_of_the_images(store, checkpoints):
    made = checkpoints.make("web", Images({BASE: page(1), BASE + 3 * PAGE: page(2)}, mapped_pages=8,
                                          open_files=[(4, "/srv/app.log"), (3, "/srv/data.db")]))
    shown = as_json(inspect(store, "web"))
    assert shown["id"] == made.id and shown["name"] == "web" and shown["format"] == 2
    (process,) = shown["processes"]
    assert process["pid"] == 4242 and process["threads"] == [4242, 4243]
    assert (process["mappings"], process["mapped_bytes"], process["pages"]) == (1, 8 * PAGE, 2)
    assert [(fd["fd"], fd["path"]) for fd in process["fds"]] == [(3, "/srv/data.db"), (4, "/srv/app.log")]
    assert {f["name"] for f in shown["files"]} >= {"pages-1.img", "pagemap-4242.img", "mm-4242.img"}
    assert shown["lazy_restore_failures"] == []


def test_show_resolves_prefixes_and_latest_and_leaves_no_staging(store, checkpoints):
    checkpoints.make("web")
    newest = checkpoints.make("db")
    assert as_json(inspect(store, "latest"))["id"] == newest.id
    assert as_json(inspect(store, newest.id[:-2]))["id"] == newest.id
    assert not list(store.tmp_dir.iterdir()), "the images read for show were left behind"
    with pytest.raises(CheckpointNotFound, match="no checkpoint with ID or name 'wbe'") as raised:
        inspect(store, "wbe")
    assert "web" in (raised.value.hint or "")
