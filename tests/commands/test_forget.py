"""ckpt/commands/forget.py as a use case: what a policy keeps and why, dry runs, the safety net.
(The origins a retention judges: tests/unit/test_forget.py.)"""

from datetime import datetime, timedelta, timezone

import pytest

from ckpt.commands.forget import forget
from ckpt.errors import UsageError
from ckpt.schedule.retention import Policy
from tests.commands.conftest import Heard, as_json


@pytest.fixture
def made(checkpoints) -> list[str]:
    """Three checkpoints named web, then one named db, oldest first."""
    return [checkpoints.make(name).id for name in ("web", "web", "web", "db")]


def test_the_policy_keeps_per_group_and_says_why(store, made):
    result = as_json(forget(store, Policy(keep_last=2)))
    assert {k["id"]: (k["group"], k["reasons"]) for k in result["keep"]} == {
        made[3]: ("db", ["last 1 of 2"]), made[2]: ("web", ["last 1 of 2"]), made[1]: ("web", ["last 2 of 2"])}
    assert result["remove"] == [{"id": made[0], "group": "web"}]
    assert store.checkpoint_ids() == made[1:]
    assert result["pruned"] is False and result["objects_removed"] == 0


def test_keep_within_is_judged_from_now(store, made):
    created = {m.id: m.created_at for m in store.manifests()}
    now = created[made[3]] + timedelta(hours=2)
    result = as_json(forget(store, Policy(keep_within=timedelta(hours=3)), now=now, dry_run=True))
    assert sorted(k["id"] for k in result["keep"]) == sorted(made)
    result = as_json(forget(store, Policy(keep_within=timedelta(hours=1)), now=now, allow_remove_all=True))
    assert result["keep"] == [] and store.checkpoint_ids() == []


def test_a_dry_run_says_what_it_would_forget_and_forgets_nothing(store, made):
    blobs = store.backend.list("")
    result = as_json(forget(store, Policy(keep_last=1), name="web", dry_run=True, prune=True))
    assert [r["id"] for r in result["remove"]] == made[:2] and result["dry_run"] is True
    assert result["pruned"] is False and store.backend.list("") == blobs


def test_emptying_a_group_is_refused_unless_allowed(store, made):
    with pytest.raises(UsageError, match="every checkpoint of 'web'"):
        forget(store, Policy(keep_within=timedelta(seconds=1)), name="web",
               now=store.manifests()[-1].created_at + timedelta(days=1))
    assert store.checkpoint_ids() == made
    with pytest.raises(UsageError, match="no retention rule"):
        forget(store, Policy())


def test_with_prune_the_space_of_the_forgotten_is_reclaimed(store, made):
    objects = {info.name for info in store.backend.list("objects/")}
    result = as_json(forget(store, Policy(keep_last=1), name="web", prune=True))
    assert result["pruned"] is True and result["objects_removed"] > 0 and result["bytes_freed"] > 0
    assert {info.name for info in store.backend.list("objects/")} < objects


def test_groups_are_kept_or_forgotten_whole(store, groups, checkpoints):
    """keep-last 1, two groups of one name: the older group and all its members go, the newer
    stays whole; plain checkpoints of that name are a series of their own."""
    plain = checkpoints.make("agent")
    older = groups.make("agent", members=3)
    newer = groups.make("agent", members=2)
    heard = Heard()
    result = as_json(forget(store, Policy(keep_last=1), reporter=heard))
    assert result["remove"] == [{"id": older.id, "group": "group: agent", "members": older.checkpoint_ids}]
    assert {k["id"]: (k["group"], k.get("members")) for k in result["keep"]} == {
        plain.id: ("agent", None), newer.id: ("group: agent", newer.checkpoint_ids)}
    assert heard.of("info") == [f"forgot 1 group checkpoint of 'group: agent' (keep-last 1), with their 3 member "
                                f"checkpoint(s): {older.id}"]
    assert store.groups.ids() == [newer.id]
    assert store.checkpoint_ids() == [plain.id, *newer.checkpoint_ids]
    assert as_json(forget(store, Policy(keep_last=1)))["remove"] == [], "what stays is kept again"


def test_a_members_name_or_time_never_forgets_it_alone(store, groups):
    """Members carry the group's name; judged alone, keep-last 1 would drop all but one of them."""
    group = groups.make("agent", members=3)
    unfinished = groups.make("agent", commit=False)
    result = as_json(forget(store, Policy(keep_last=1), name="agent"))
    assert [k["id"] for k in result["keep"]] == [group.id] and result["remove"] == []
    assert store.checkpoint_ids() == group.checkpoint_ids + unfinished.checkpoint_ids, "prune's, not forget's"
    with pytest.raises(UsageError, match="'group: agent'"):
        forget(store, Policy(keep_within=timedelta(seconds=1)), now=datetime.now(timezone.utc) + timedelta(days=1))
    assert store.groups.ids() == [group.id]
