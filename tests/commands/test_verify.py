"""ckpt/commands/verify.py: every checkpoint's bytes checked, damage named with its checkpoint."""

import pytest

from ckpt.commands.verify import verify
from ckpt.errors import CheckpointNotFound
from tests.commands.conftest import BASE, PAGE, Heard, Images, as_json, flip_byte, page


def test_an_intact_store_verifies_clean(store, checkpoints):
    made = [checkpoints.make("web"), checkpoints.make("db")]
    heard = Heard()
    assert as_json(verify(store, None, heard)) == [{"id": m.id, "files": len(m.files), "problems": []}
                                                   for m in made]
    assert heard.of("step") == [f"verifying {m.id}" for m in made]


def test_a_flipped_byte_in_a_pack_is_found_and_names_its_checkpoint(store, checkpoints):
    clean = checkpoints.make("clean", Images({BASE: page("clean")}), codec="none")
    packs_of_clean = store.backend.list("packs/")
    hit = checkpoints.make("hit", Images({BASE: page("hit"), BASE + PAGE: page("hit too")}), codec="none")
    (new_pack,) = {info.name for info in store.backend.list("packs/")} - {info.name for info in packs_of_clean}
    flip_byte(store.backend, new_pack, PAGE + 100)
    results = {r["id"]: r["problems"] for r in as_json(verify(store, None))}
    assert results[clean.id] == []
    assert results[hit.id] and any("pages-1.img" in problem for problem in results[hit.id]), results[hit.id]
    (only,) = as_json(verify(store, "hit"))
    assert only["id"] == hit.id and only["problems"]


def test_an_unreadable_manifest_is_a_problem_of_its_checkpoint(store, checkpoints):
    broken = checkpoints.make("web")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{}")
    (result,) = as_json(verify(store, None))
    assert result["id"] == broken.id and result["files"] == 0 and "lacks" in result["problems"][0]



def test_a_group_is_verified_member_by_member(store, groups, checkpoints):
    checkpoints.make("web")
    group = groups.make("agent", members=3)
    results = as_json(verify(store, "agent"))
    assert [r["id"] for r in results] == group.checkpoint_ids
    assert all(r["files"] > 0 and r["problems"] == [] for r in results)
    assert [r["id"] for r in as_json(verify(store, group.id[:-1]))] == group.checkpoint_ids  # a prefix of its ID


def test_a_group_missing_a_member_is_damaged_and_an_unfinished_member_is_not_verified(store, groups):
    whole = groups.make("agent")
    broken = groups.make("db")
    unfinished = groups.make("agent", commit=False)
    store.backend.delete([f"checkpoints/{broken.checkpoint_ids[0]}.json"])
    everything = as_json(verify(store, None))
    assert [r["id"] for r in everything] == whole.checkpoint_ids + broken.checkpoint_ids[1:] + [broken.id]
    assert not set(unfinished.checkpoint_ids) & {r["id"] for r in everything}
    assert everything[-1]["problems"] == [f"group db ({broken.id}): the manifest of its member "
                                          f"{broken.checkpoint_ids[0]} is missing"]
    one = as_json(verify(store, "db"))
    assert [(r["id"], bool(r["problems"])) for r in one] == [(broken.id, True), (broken.checkpoint_ids[1], False)]
    with pytest.raises(CheckpointNotFound):
        verify(store, unfinished.checkpoint_ids[0])
