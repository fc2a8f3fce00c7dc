"""ckpt/commands/show.py: what `ckpt show` reads out of a checkpoint's images."""

import pytest

from ckpt.commands.show import CheckpointDescription, GroupDescription, inspect
from ckpt.errors import CheckpointNotFound, UsageError
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


def test_show_of_a_group_gives_its_members_and_stats(store, groups):
    group = groups.make("agent", members=2)
    described = inspect(store, "agent")
    assert isinstance(described, GroupDescription) and described.group.id == group.id
    shown = as_json(described)
    assert shown["id"] == group.id and shown["name"] == "agent" and shown["format"] == 1
    assert [(m["checkpoint"], m["hostname"], m["pid"]) for m in shown["members"]] == [
        (group.checkpoint_ids[0], "host-a", 4242), (group.checkpoint_ids[1], "host-b", 4242)]
    assert shown["members"][1]["frozen_at"] - shown["members"][0]["frozen_at"] == pytest.approx(0.002, abs=1e-6)
    assert shown["stats"] == {"freeze_skew_ms": 2.0, "span_ms": 150.0, "longest_freeze_ms": 150.0}
    assert as_json(inspect(store, group.id[:-1]))["id"] == group.id


def test_show_of_a_member_says_its_group_and_an_unfinished_member_is_not_shown(store, groups):
    group = groups.make("agent")
    unfinished = groups.make("agent", commit=False)
    member = inspect(store, group.checkpoint_ids[0])
    assert isinstance(member, CheckpointDescription) and member.group.id == group.id
    assert as_json(member)["group"] == {"id": group.id, "name": "agent"}
    assert as_json(member)["processes"][0]["pid"] == 4242, "a finished member is an ordinary checkpoint"
    with pytest.raises(CheckpointNotFound):
        inspect(store, unfinished.checkpoint_ids[0])


def test_a_ref_naming_both_a_group_and_a_checkpoint_is_refused(store, checkpoints, groups):
    group = groups.make("agent")
    plain = checkpoints.make("agent")
    with pytest.raises(UsageError) as raised:
        inspect(store, "agent")
    assert "give the ID" in raised.value.message and "\n" not in raised.value.message
    assert as_json(inspect(store, plain.id))["id"] == plain.id
    assert as_json(inspect(store, group.id))["id"] == group.id


def test_a_member_whose_group_manifest_is_damaged_is_still_shown(store, groups):
    group = groups.make("agent")
    store.backend.put(f"groups/{group.id}.json", b"[]")
    member = inspect(store, group.checkpoint_ids[0])
    assert member.group is None and as_json(member)["group"] == {"id": group.id, "name": "agent"}
