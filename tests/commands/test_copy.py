"""ckpt/commands/copy.py: checkpoints copied between two stores (here both in memory), only
what the destination lacks sent, the copy usable there."""

import pytest

from ckpt.commands.copy import copy, select
from ckpt.commands.verify import verify
from ckpt.errors import UsageError
from tests.commands.conftest import BASE, PAGE, Images, as_json, memory_store, page


@pytest.fixture
def backup(tmp_path):
    return memory_store(tmp_path, "backup")


def test_a_copy_arrives_whole_and_a_second_copy_sends_nothing(store, checkpoints, backup):
    made = checkpoints.make("web", Images({BASE: page(1), BASE + PAGE: page(2)}))
    first = as_json(copy(store, backup, [made.id]))
    assert (first["source"], first["destination"]) == ("memory://mem", "memory://backup")
    assert first["copied"] == 1 and first["failed"] == 0 and first["bytes_sent"] > 0
    assert backup.checkpoint_ids() == [made.id]
    assert backup.load(made.id).files == made.files
    assert as_json(verify(backup, made.id))[0]["problems"] == []
    again = as_json(copy(store, backup, [made.id]))
    assert (again["copied"], again["present"], again["bytes_sent"]) == (0, 1, 0)


def test_a_next_checkpoint_sends_only_its_new_pages(store, checkpoints, backup):
    pages = {BASE + k * PAGE: page(k) for k in range(64)}
    first = checkpoints.make("web", Images(pages, mapped_pages=64), codec="none")
    copy(store, backup, [first.id])
    second = checkpoints.make("web", Images({**pages, BASE: page("changed")}, mapped_pages=64), codec="none")
    sent = as_json(copy(store, backup, [second.id]))
    assert sent["copied"] == 1
    assert 0 < sent["bytes_sent"] < 8 * PAGE, "the pages the destination holds were sent again"
    assert backup.checkpoint_ids() == [first.id, second.id]


def test_a_checkpoint_damaged_in_the_source_fails_alone(store, checkpoints, backup):
    broken = checkpoints.make("web")
    fine = checkpoints.make("db")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{}")
    report = as_json(copy(store, backup, [broken.id, fine.id]))
    assert (report["copied"], report["failed"]) == (1, 1)
    assert backup.checkpoint_ids() == [fine.id]


def test_copying_a_store_to_itself_is_refused(store, checkpoints):
    made = checkpoints.make("web")
    with pytest.raises(UsageError, match="the same store"):
        copy(store, store, [made.id])


def test_select_resolves_references_or_takes_all_of_a_name(store, checkpoints):
    web = [checkpoints.make("web").id for _ in range(2)]
    db = checkpoints.make("db").id
    assert select(store, ["web", "latest", web[0]], False).checkpoints == sorted({web[1], db, web[0]})
    assert select(store, [], True, name="web").checkpoints == web
    assert select(store, [], True).checkpoints == web + [db]
    with pytest.raises(UsageError, match="--all"):
        select(store, [], False)
    with pytest.raises(UsageError, match="--name goes with --all"):
        select(store, ["web"], False, name="web")


def test_a_group_is_copied_members_first_then_its_manifest_and_arrives_whole(store, groups, checkpoints, backup):
    plain = checkpoints.make("web")
    group = groups.make("agent", members=3)
    unfinished = groups.make("agent", commit=False)
    committed = []  # the order names arrive in the destination
    real_put = backup.backend.put_if_absent
    backup.backend.put_if_absent = lambda name, data: committed.append(name) or real_put(name, data)
    selection = select(store, ["agent"], False)
    assert (selection.checkpoints, selection.groups) == (group.checkpoint_ids, [group.id])
    report = as_json(copy(store, backup, selection.checkpoints, groups=selection.groups))
    assert [c["status"] for c in report["checkpoints"]] == ["copied"] * 3
    assert [(g["id"], g["status"]) for g in report["groups"]] == [(group.id, "copied")]
    assert [n for n in committed if n.startswith(("checkpoints/", "groups/"))] == \
        [f"checkpoints/{i}.json" for i in group.checkpoint_ids] + [f"groups/{group.id}.json"]
    assert backup.groups.load(group.id) == group
    assert [m.id for m in backup.manifests()] == group.checkpoint_ids, "the group is visible whole"
    assert [r["problems"] for r in as_json(verify(backup, "agent"))] == [[], [], []]
    again = as_json(copy(store, backup, selection.checkpoints, groups=selection.groups))
    assert [g["status"] for g in again["groups"]] == ["present"] and again["bytes_sent"] == 0
    everything = select(store, [], True)
    assert (everything.checkpoints, everything.groups) == ([plain.id, *group.checkpoint_ids], [group.id])
    assert not set(unfinished.checkpoint_ids) & set(everything.checkpoints)


def test_a_member_alone_or_an_unfinished_one_is_not_copied_nor_a_group_missing_a_member(store, groups, backup):
    group = groups.make("agent")
    unfinished = groups.make("late", commit=False)
    with pytest.raises(UsageError, match=f"member of group agent \\({group.id}\\): copy the group with "
                                         "'ckpt copy agent'"):
        select(store, [group.checkpoint_ids[0]], False)
    report = as_json(copy(store, backup, unfinished.checkpoint_ids))  # as a stale pending record might ask
    assert report["failed"] == 2 and "never committed" in report["checkpoints"][0]["error"]
    store.backend.put(f"checkpoints/{group.checkpoint_ids[1]}.json", b"{}")  # damaged in the source
    report = as_json(copy(store, backup, group.checkpoint_ids, groups=[group.id]))
    assert (report["copied"], report["failed"]) == (1, 1)
    assert report["groups"][0]["status"] == "failed" and group.checkpoint_ids[1] in report["groups"][0]["error"]
    assert backup.groups.ids() == [] and backup.manifests() == [], "the member copied is unfinished there"
