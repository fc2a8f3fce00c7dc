"""ckpt/commands/list.py: the rows of `ckpt list`, and what a name that matches nothing is told;
group checkpoints in them, and what readers never see (unfinished members)."""

import pytest

from ckpt.commands.list import absent_name, list_checkpoints
from ckpt.errors import CheckpointNotFound
from tests.commands.conftest import Heard, as_json


def test_rows_are_oldest_first_with_their_figures(store, checkpoints):
    first = checkpoints.make("web")
    second = checkpoints.make("db")
    rows = as_json(list_checkpoints(store))
    assert [(r["id"], r["name"]) for r in rows] == [(first.id, "web"), (second.id, "db")]
    assert rows[0]["pid"] == 4242 and rows[0]["processes"] == 1 and rows[0]["origin"] is None
    assert rows[0]["bytes_total"] == first.bytes_total > 0
    assert rows[0]["bytes_stored"] == first.bytes_stored and rows[0]["lazy_restore_failures"] == 0


def test_a_name_keeps_only_its_checkpoints(store, checkpoints):
    checkpoints.make("web")
    db = checkpoints.make("db")
    checkpoints.make(None)
    assert [r["id"] for r in as_json(list_checkpoints(store, name="db"))] == [db.id]
    assert as_json(list_checkpoints(store, name="nothing")) == []


def test_an_unreadable_manifest_is_warned_about_and_left_out(store, checkpoints):
    kept = checkpoints.make("web")
    broken = checkpoints.make("web")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{not json")
    heard = Heard()
    assert [r["id"] for r in as_json(list_checkpoints(store, reporter=heard))] == [kept.id]
    (warning,) = heard.of("warn")
    assert broken.id in warning and "not valid JSON" in warning


def test_a_name_that_matches_nothing_says_what_there_is_and_what_was_meant(store, checkpoints):
    assert "no checkpoints in the store yet" in absent_name(store, "web")
    checkpoints.make("webserver")
    checkpoints.make("database")
    said = absent_name(store, "webservr")
    assert "the store holds 2" in said and "names: database, webserver" in said
    assert "did you mean" in said and "webserver" in said.split("did you mean", 1)[1]
    assert "did you mean" not in absent_name(store, "zzzzzz")


def test_a_group_is_listed_with_its_members_and_an_unfinished_one_not_at_all(store, checkpoints, groups):
    plain = checkpoints.make("web")
    group = groups.make("agent", members=3, hosts=("host-a", "host-b"))
    unfinished = groups.make("agent", commit=False)
    rows = as_json(list_checkpoints(store))
    assert [r["id"] for r in rows] == [plain.id, *group.checkpoint_ids]
    assert rows[0]["group"] is None
    summary = {"id": group.id, "name": "agent", "created": group.created, "members": 3,
               "hosts": ["host-a", "host-b"],
               "stats": {"freeze_skew_ms": 4.0, "span_ms": 150.0, "longest_freeze_ms": 150.0}}
    assert [r["group"] for r in rows[1:]] == [summary] * 3
    assert not set(unfinished.checkpoint_ids) & {r["id"] for r in rows}
    assert [r["id"] for r in as_json(list_checkpoints(store, name="agent"))] == group.checkpoint_ids


def test_unfinished_members_are_not_resolved_by_id_prefix_name_or_latest(store, checkpoints, groups):
    plain = checkpoints.make("web")
    finished = groups.make("agent")
    unfinished = groups.make("late", commit=False)
    member = unfinished.checkpoint_ids[-1]
    for ref in (member, member[:-1], "late"):
        with pytest.raises(CheckpointNotFound):
            store.resolve(ref)
    assert store.resolve("latest") == finished.checkpoint_ids[-1], "the newest a reader sees"
    assert store.resolve(finished.checkpoint_ids[0]) == finished.checkpoint_ids[0], "a finished member is a checkpoint"
    assert store.newest_of(4242).id == finished.checkpoint_ids[-1], "a dump's parent is never an unfinished member"
    assert [m.id for m in store.manifests()] == [plain.id, *finished.checkpoint_ids]
    assert [m.id for m in store.manifests_by_visibility()[1]] == unfinished.checkpoint_ids


def test_visibility_lists_groups_once_and_not_at_all_without_members(store, checkpoints, groups):
    checkpoints.make("web")
    listed = []
    real_list = store.backend.list
    store.backend.list = lambda prefix, **kw: listed.append(prefix) or real_list(prefix, **kw)
    store.manifests()
    store.resolve("latest")
    assert "groups/" not in listed, "a store without members never lists groups/"
    groups.make("agent", members=3)
    groups.make("late", members=3, commit=False)
    listed.clear()
    store.manifests()
    assert listed.count("groups/") == 1
