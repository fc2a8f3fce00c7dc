"""ckpt/commands/rm.py: references resolved first, all or nothing; shared content kept."""

import threading

import pytest

from ckpt.commands.rm import remove
from ckpt.commands.verify import verify
from ckpt.errors import CheckpointNotFound, StoreBusy, UsageError
from ckpt.settings import Settings
from ckpt.store import Store
from tests.commands.conftest import BASE, PAGE, Images, as_json, page


def test_removing_a_parent_keeps_what_its_child_shares(store, checkpoints):
    parent = checkpoints.make("web", Images({BASE: page("shared"), BASE + PAGE: page("parent only")}))
    child = checkpoints.make("web", Images({BASE: page("shared"), BASE + PAGE: page("child only")}))
    objects_before = {info.name for info in store.backend.list("objects/")}
    result = as_json(remove(store, [parent.id]))
    assert result["removed"] == [parent.id] and result["dry_run"] is False
    assert result["objects_removed"] > 0 and result["bytes_freed"] > 0
    assert store.checkpoint_ids() == [child.id]
    assert {info.name for info in store.backend.list("objects/")} < objects_before, "the parent's own objects stay"
    assert as_json(verify(store, child.id)) == [{"id": child.id, "files": len(child.files), "problems": []}]


def test_a_dry_run_resolves_but_removes_nothing(store, checkpoints):
    web = checkpoints.make("web")
    db = checkpoints.make("db")
    blobs_before = store.backend.list("")
    result = as_json(remove(store, ["web", db.id[:-1], "latest"], dry_run=True))
    assert result == {"removed": [web.id, db.id], "groups": [], "dry_run": True, "objects_removed": 0,
                      "bytes_freed": 0}
    assert store.backend.list("") == blobs_before


def test_one_unknown_reference_removes_nothing(store, checkpoints):
    web = checkpoints.make("web")
    with pytest.raises(CheckpointNotFound, match="'wbe'") as raised:
        remove(store, [web.id, "wbe"])
    assert "did you mean 'web'" in (raised.value.hint or "")
    assert store.checkpoint_ids() == [web.id]


def test_rm_waits_for_a_command_holding_the_store_and_removes_nothing(store, checkpoints):
    """rm takes the exclusive lock: a dump or restore holding the shared one keeps it out."""
    made = checkpoints.make("web")
    # The lock's timeout comes from the store's settings: this handle on the same store waits 0.2 s.
    impatient = Store(store.root, store.backend, store.location, settings=Settings(lock_timeout=0.2))
    held, release = threading.Event(), threading.Event()

    def restoring() -> None:
        with store.lock(exclusive=False):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=restoring)
    holder.start()
    try:
        assert held.wait(5)
        with pytest.raises(StoreBusy, match="memory://mem"):
            remove(impatient, [made.id])
        assert store.checkpoint_ids() == [made.id]
    finally:
        release.set()
        holder.join(5)
    assert as_json(remove(store, [made.id]))["removed"] == [made.id]


def test_rm_of_a_group_removes_the_group_then_its_members_and_what_only_they_held(store, groups, checkpoints):
    web = checkpoints.make("web")
    older = groups.make("agent")
    newer = groups.make("agent")
    objects_before = {info.name for info in store.backend.list("objects/")}
    planned = as_json(remove(store, ["agent"], dry_run=True))
    assert (planned["groups"], planned["removed"]) == ([newer.id], newer.checkpoint_ids)
    assert store.groups.ids() == [older.id, newer.id], "a dry run removed something"
    done = as_json(remove(store, ["agent"]))
    assert (done["groups"], done["removed"]) == ([newer.id], newer.checkpoint_ids) and done["objects_removed"] > 0
    assert store.groups.ids() == [older.id]
    assert store.checkpoint_ids() == [web.id, *older.checkpoint_ids]
    assert {info.name for info in store.backend.list("objects/")} < objects_before
    assert [r["problems"] for r in as_json(verify(store, None))] == [[], [], []], "the others are intact"


def test_rm_of_a_member_is_refused_while_its_group_stands(store, groups):
    older = groups.make("agent")
    newer = groups.make("agent")
    member = newer.checkpoint_ids[1]
    with pytest.raises(UsageError) as raised:
        remove(store, [member])
    assert raised.value.message == (f"checkpoint {member} is a member of group agent ({newer.id}): "
                                    "remove the group with 'ckpt rm agent'")
    assert raised.value.exit_code == 2
    with pytest.raises(UsageError, match=f"remove the group with 'ckpt rm {older.id}'"):
        remove(store, [older.checkpoint_ids[0]])  # 'agent' would be the newer group: its ID
    with pytest.raises(UsageError):
        remove(store, ["latest"])  # the newest checkpoint is a member too
    assert store.groups.ids() == [older.id, newer.id]
    assert store.checkpoint_ids() == older.checkpoint_ids + newer.checkpoint_ids


def test_a_ref_naming_a_group_and_a_checkpoint_is_refused(store, groups, checkpoints):
    plain = checkpoints.make("agent")
    group = groups.make("agent")
    with pytest.raises(UsageError, match=f"'agent' names group checkpoint {group.id} and checkpoint {plain.id}"):
        remove(store, ["agent"])
    assert as_json(remove(store, [group.id], dry_run=True))["groups"] == [group.id]
    assert as_json(remove(store, [plain.id], dry_run=True))["removed"] == [plain.id]


def test_a_group_whose_manifest_cannot_be_read_is_removed_with_the_members_naming_it(store, groups):
    kept = groups.make("other")
    broken = groups.make("agent")
    store.backend.put(f"groups/{broken.id}.json", b"{not json")
    result = as_json(remove(store, [broken.id]))
    assert (result["groups"], result["removed"]) == ([broken.id], broken.checkpoint_ids)
    assert store.groups.ids() == [kept.id] and store.checkpoint_ids() == kept.checkpoint_ids
