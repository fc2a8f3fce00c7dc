"""ckpt/commands/run_group.py and the `:::` of ckpt/commands/run.py: what a run of several
commands decides before anything starts, and what it tells of its group checkpoints (the
supervision itself, with real processes and CRIU: tests/integration/test_run.py)."""

import json
import os
from datetime import timedelta

import pytest

from ckpt.commands import group
from ckpt.commands.run import RunRequest, split_commands
from ckpt.commands.run_group import GroupSupervisor
from ckpt.errors import GroupFailed, UsageError
from ckpt.store import Origin
from ckpt.store.groups import GroupManifest, GroupMember
from tests.helpers import env_settings
from tests.jsonshape import assert_events


def request(**changes) -> RunRequest:
    return RunRequest(**{"command": ["python3", "server.py"], "also": [["python3", "client.py"]],
                         "every": timedelta(minutes=5), "name": "pair", **changes})


@pytest.mark.parametrize("argv,commands", [
    (["a", "-x"], [["a", "-x"]]),
    (["a", "--", "b", ":::", "c", "::", "d"], [["a", "--", "b"], ["c", "::", "d"]]),
    (["a", ":::", "b", ":::", "c"], [["a"], ["b"], ["c"]]),
])
def test_commands_are_split_on_the_separator_word_for_word(argv, commands):
    assert split_commands(argv) == commands


@pytest.mark.parametrize("argv", [[":::", "a"], ["a", ":::"], ["a", ":::", ":::", "b"]])
def test_an_empty_command_is_refused(argv):
    with pytest.raises(UsageError, match="an empty command"):
        split_commands(argv)


@pytest.mark.parametrize("changes,refused", [
    ({"pre_dump_hook": "sync"}, "--pre-dump is not taken"),
    ({"post_restore_hook": "true"}, "--post-restore is not taken"),
    ({"copy_to": "/tmp/elsewhere"}, "--copy-to is not taken"),
    ({"also": [[]]}, "no command to run"),
    ({"every": timedelta(milliseconds=10)}, "--every must be at least 1s"),
])
def test_a_group_run_that_cannot_run_is_refused_before_anything_starts(isolated_env, changes, refused):
    with pytest.raises(UsageError, match=refused):
        GroupSupervisor(isolated_env, request(**changes), env_settings())
    assert not os.path.exists(isolated_env), "a refused run made the store"


def test_a_group_checkpoint_of_every_member_is_taken_and_told(isolated_env, monkeypatch):
    asked, told = [], []

    def group_dump(store_root, dump_request, reporter, *, settings, passwords):
        asked.append(dump_request)
        members = [GroupMember(checkpoint=f"20260101-000000-000-00000{i}", pid=int(p))
                   for i, p in enumerate(dump_request.members)]
        manifest = GroupManifest(id="20260101-000000-001-aaaaaa", created="2026-01-01T00:00:00+00:00",
                                 members=members, name=dump_request.name, origin=dump_request.origin,
                                 stats={"freeze_skew_ms": 1.5})
        return group.GroupDumpResult(manifest, [{"bytes_stored": 5}, {"bytes_stored": 7}])

    monkeypatch.setattr(group, "group_dump", group_dump)
    supervisor = GroupSupervisor(isolated_env, request(), env_settings(), on_event=told.append)
    supervisor.pids = [os.getpid(), os.getppid()]
    assert supervisor.checkpoint_group() is True
    (dumped,) = asked
    assert (dumped.members, dumped.name, dumped.origin) == ([str(os.getpid()), str(os.getppid())], "pair",
                                                            Origin("run", "pair"))
    assert supervisor.checkpoints == ["20260101-000000-001-aaaaaa"]

    def failing(*_args, **_kwargs):
        raise GroupFailed("member 1 failed to prepare: no")

    monkeypatch.setattr(group, "group_dump", failing)
    assert supervisor.checkpoint_group() is False and supervisor.checkpoints == ["20260101-000000-001-aaaaaa"]
    events = assert_events([json.dumps(e) for e in told])
    assert [e["event"] for e in events] == ["group_checkpoint", "group_checkpoint_failed"]
    assert events[0]["bytes_stored"] == 12 and events[0]["members"][1] == {
        "pid": os.getppid(), "checkpoint": "20260101-000000-000-000001"}
    assert events[1]["error"] == "member 1 failed to prepare: no"
