"""ckpt/commands/schedule.py: add, list and remove against a ScheduleBook in the test's
directories (cron_dir), with the scheduler's facts given (no systemd, a cron daemon)."""

import json
import os
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from ckpt.commands import schedule
from ckpt.errors import ProcessNotFound, UsageError
from ckpt.schedule.book import ScheduleBook
from ckpt.schedule.retention import Policy
from ckpt.schedule.schedulers import Facts
from tests.helpers import env_settings

CRON_RUNS = Facts(systemd=None, cron_pid=os.getpid(), init="sh")
NO_CRON = Facts(systemd=None, cron_pid=None, init="sh")
NOON = datetime(2026, 6, 1, 12, 7, tzinfo=timezone.utc)


@pytest.fixture
def book(isolated_env, tmp_path) -> ScheduleBook:
    return ScheduleBook(isolated_env, replace(env_settings(), cron_dir=tmp_path / "cron.d"))


def hourly(name: str = "web", **changes) -> schedule.AddRequest:
    return schedule.AddRequest(**{"name": name, "target": {"pid": os.getpid()}, "every": "1h",
                                  "policy": Policy(keep_last=3), **changes})


def test_an_added_schedule_is_recorded_installed_and_listed(book, tmp_path):
    added = schedule.add(book, hourly(), CRON_RUNS)
    assert added.will_run and added.warning is None and added.schedule.scheduler == "cron"
    assert json.loads(book.path("web").read_text())["retention"] == Policy(keep_last=3).to_json()
    assert any("web" in path.read_text() for path in (tmp_path / "cron.d").iterdir())
    (row,) = schedule.listing(book, NOON, CRON_RUNS)
    assert (row["name"], row["cron"], row["every"], row["installed"], row["will_run"]) == \
        ("web", added.schedule.cron, "1h", True, True)
    assert row["next_run"] > NOON.isoformat(timespec="minutes") and row["problem"] is None


def test_a_schedule_is_not_replaced_unless_told(book):
    schedule.add(book, hourly(), CRON_RUNS)
    with pytest.raises(UsageError, match="exists already"):
        schedule.add(book, hourly(every="2h"), CRON_RUNS)
    assert schedule.add(book, hourly(every="2h", replace=True), CRON_RUNS).schedule.every == "2h"


@pytest.mark.parametrize("changes,refused", [
    ({"every": None}, "exactly one of --every"),
    ({"cron": "*/5 * * * *"}, "exactly one of --every"),
    ({"target": {"pid": 1}}, "PID 1"),
    ({"target": {"match": "("}}, "invalid --match"),
    ({"target": {}}, "exactly one target"),
])
def test_invalid_requests_are_refused_and_record_nothing(book, changes, refused):
    with pytest.raises(UsageError, match=refused):
        schedule.add(book, hourly(**changes), CRON_RUNS)
    assert book.names() == []


def test_without_a_cron_daemon_a_schedule_says_it_will_not_run(book):
    added = schedule.add(book, hourly(), NO_CRON)
    assert not added.will_run and "cron" in (added.warning or "")
    (row,) = schedule.listing(book, NOON, NO_CRON)
    assert row["will_run"] is False and row["problem"]


def test_removing_a_schedule_removes_its_entry_and_keeps_the_others(book, tmp_path):
    schedule.add(book, hourly("web"), CRON_RUNS)
    schedule.add(book, hourly("db"), CRON_RUNS)
    assert schedule.remove(book, "web", CRON_RUNS).name == "web"
    assert [row["name"] for row in schedule.listing(book, NOON, CRON_RUNS)] == ["db"]
    assert not any("web" in path.read_text() for path in (tmp_path / "cron.d").iterdir())
    with pytest.raises(ProcessNotFound, match="no schedule named 'web'"):
        schedule.remove(book, "web", CRON_RUNS)


def group_of(*members: dict, **changes) -> schedule.AddRequest:
    return hourly("pair", target={"group": list(members)}, **changes)


def test_a_group_schedule_is_recorded_with_its_members_and_listed(book, tmp_path):
    added = schedule.add(book, group_of({"pid": os.getpid()}, {"pidfile": "run/server.pid"}, {"match": "client"}),
                         CRON_RUNS)
    members = [{"pid": os.getpid()}, {"pidfile": str(Path.cwd() / "run/server.pid")}, {"match": "client"}]
    assert json.loads(book.path("pair").read_text())["target"] == {"group": members}
    assert book.load("pair").members == members
    assert added.schedule.describe_target() == (f"group of pid {os.getpid()}, pidfile {members[1]['pidfile']}, "
                                                "match client")
    assert "group of pid" in (tmp_path / "cron.d" / "ckpt-pair").read_text()
    (row,) = schedule.listing(book, NOON, CRON_RUNS)
    assert row["target"] == {"group": members}


def test_a_schedule_of_one_target_has_no_members(book):
    assert schedule.add(book, hourly(), CRON_RUNS).schedule.members is None


@pytest.mark.parametrize("changes,refused", [
    ({"target": {"group": []}}, "needs its members"),
    ({"target": {"group": [{"pid": 1}]}}, "PID 1"),
    ({"target": {"group": [{"match": "a"}, {"match": "a"}]}}, "member match a is named twice"),
    ({"target": {"group": [{"match": "a"}], "pid": 7}}, "needs its members"),
    ({"target": {"group": [{"match": "a"}]}, "pre_dump": "sync"}, "--pre-dump is not taken by a group"),
    ({"target": {"group": [{"match": "a"}]}, "copy_to": "/tmp/elsewhere"}, "--copy-to is not taken by a group"),
])
def test_a_group_schedule_that_cannot_run_is_refused(book, changes, refused):
    with pytest.raises(UsageError, match=refused):
        schedule.add(book, hourly("pair", **changes), CRON_RUNS)
    assert book.names() == []


def test_a_group_run_resolves_each_member_and_records_the_group(book, monkeypatch):
    """What `schedule run` hands group_dump and records (the real group dump, with CRIU:
    tests/integration/test_schedule.py)."""
    from ckpt.commands import group
    from ckpt.store import Origin
    from ckpt.store.groups import GroupManifest, GroupMember

    schedule.add(book, group_of({"pid": os.getpid()}, {"pid": os.getppid()}), CRON_RUNS)
    asked = []

    def group_dump(store_root, request, reporter, *, settings, passwords):
        asked.append(request)
        members = [GroupMember(checkpoint=f"20260101-000000-000-00000{i}", pid=int(p), freeze_ms=10.0 * (i + 1))
                   for i, p in enumerate(request.members)]
        manifest = GroupManifest(id="20260101-000000-001-aaaaaa", created="2026-01-01T00:00:00+00:00",
                                 members=members, name=request.name, origin=request.origin)
        return group.GroupDumpResult(manifest, [{"bytes_stored": 5}, {"bytes_stored": 7}])

    monkeypatch.setattr(group, "group_dump", group_dump)
    result = schedule.run(book, "pair")
    (request,) = asked
    assert (request.members, request.name, request.origin) == (
        [str(os.getpid()), str(os.getppid())], "pair", Origin("schedule", "pair"))
    recorded = result.to_json()
    assert "pid" not in recorded and recorded["id"] == recorded["group"] == "20260101-000000-001-aaaaaa"
    assert recorded["members"] == [{"pid": os.getpid(), "checkpoint": "20260101-000000-000-000000"},
                                   {"pid": os.getppid(), "checkpoint": "20260101-000000-000-000001"}]
    assert (recorded["bytes_stored"], recorded["freeze_ms"]) == (12, 20.0)
    assert book.state("pair")["members"] == recorded["members"]
