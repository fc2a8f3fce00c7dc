"""ckpt/commands/prune.py: a plan and its execution; a dry run changes nothing at all; what a
write in progress may still need is kept for the backend's safety margin; the members of group
checkpoints that never committed are removed (past that margin)."""

import pytest

from ckpt.commands.prune import prune
from ckpt.commands.verify import verify
from ckpt.errors import StoreError
from tests.commands.conftest import Checkpoints, Groups, Heard, as_json, memory_store


def test_prune_reclaims_what_removed_checkpoints_held_and_then_nothing(store, checkpoints):
    gone = checkpoints.make("web")
    kept = checkpoints.make("web")
    store.remove([gone.id])  # the manifest only, as a forget without --prune leaves it
    plan = as_json(prune(store))
    assert plan["dry_run"] is False and plan["objects"] > 0 and plan["bytes_freed"] > 0
    again = as_json(prune(store))
    assert (again["objects"], again["bytes_freed"], again["drop_packs"], again["repack"]) == (0, 0, [], [])
    assert store.checkpoint_ids() == [kept.id]


def test_a_dry_run_plans_the_same_and_changes_nothing_not_even_leftovers(store, checkpoints):
    gone = checkpoints.make("web")
    checkpoints.make("web")
    store.remove([gone.id])
    unfinished = store.backend.writer("objects/ab/abandoned")
    unfinished.write(b"a dump that died")
    leftover = store.tmp_dir / "restore-leftover"
    leftover.mkdir(mode=0o700, parents=True)
    blobs = store.backend.list("") + store.backend.list("", incomplete=True)
    planned = as_json(prune(store, dry_run=True))
    assert planned["dry_run"] is True and planned["objects"] > 0
    assert store.backend.list("") + store.backend.list("", incomplete=True) == blobs
    assert leftover.is_dir(), "a dry run removed a staging leftover"
    done = as_json(prune(store))
    assert {k: v for k, v in done.items() if k not in ("dry_run", "duration_ms")} == \
        {k: v for k, v in planned.items() if k not in ("dry_run", "duration_ms")}
    assert store.backend.list("", incomplete=True) == [] and not leftover.exists()


def test_within_the_safety_margin_an_unreferenced_object_is_kept(tmp_path):
    """A store whose locks can be lost (S3) keeps what is younger than its margin: it may be
    a dump's, still committing. The memory backend's clock and margin are the seam."""
    clock = [1_000_000.0]
    store = memory_store(tmp_path, "margin", clock=lambda: clock[0], gc_margin=600)
    store.backend.put("objects/ab/" + "ab" * 32, b"written by a dump still under way")
    assert as_json(prune(store))["objects"] == 0
    assert store.backend.exists("objects/ab/" + "ab" * 32)
    clock[0] += 601
    assert as_json(prune(store))["objects"] == 1
    assert not store.backend.exists("objects/ab/" + "ab" * 32)


def test_a_manifest_that_cannot_be_read_stops_prune(store, checkpoints):
    broken = checkpoints.make("web")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{")
    with pytest.raises(StoreError, match=f"cannot reclaim space: manifest.*{broken.id}"):
        prune(store)


def _object_names(store) -> set[str]:
    return {info.name for info in store.backend.list("objects/")}


def test_prune_removes_unfinished_members_and_what_only_they_hold_and_keeps_finished_groups(store, groups):
    finished = groups.make("agent")
    before = _object_names(store) | {info.name for info in store.backend.list("packs/")}
    dead = groups.make("agent", commit=False)
    heard = Heard()
    planned = as_json(prune(store, dry_run=True, reporter=heard))
    assert planned["unfinished_members"] == dead.checkpoint_ids
    assert heard.of("info") == [f"would remove 2 unfinished group member(s) (their group checkpoint never "
                                f"committed): {', '.join(dead.checkpoint_ids)}"]
    assert set(store.checkpoint_ids()) == set(finished.checkpoint_ids + dead.checkpoint_ids), "a dry run removed one"
    done = as_json(prune(store))
    assert done["unfinished_members"] == dead.checkpoint_ids and done["bytes_freed"] > 0
    assert store.checkpoint_ids() == finished.checkpoint_ids
    after = _object_names(store) | {info.name for info in store.backend.list("packs/")}
    assert after <= before, "what only the unfinished members named is reclaimed"
    assert [r["problems"] for r in as_json(verify(store, None))] == [[], []], "the finished group is intact"


def test_an_unfinished_member_younger_than_the_margin_stays_with_what_it_names(tmp_path):
    clock = [1_000_000.0]
    store = memory_store(tmp_path, "margin", clock=lambda: clock[0], gc_margin=600)
    pending = Groups(store, Checkpoints(store, tmp_path)).make("agent", commit=False)
    assert as_json(prune(store))["unfinished_members"] == []
    assert store.checkpoint_ids() == pending.checkpoint_ids
    store.groups.commit(pending)  # its coordinator commits it after all: the group is whole
    assert [r["problems"] for r in as_json(verify(store, "agent"))] == [[], []]
    store.groups.remove(pending.id)
    clock[0] += 601
    assert as_json(prune(store))["unfinished_members"] == pending.checkpoint_ids
    assert store.checkpoint_ids() == []
