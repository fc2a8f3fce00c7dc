"""ckpt/commands/run.py: what `ckpt run` decides before and around supervision (the
supervision itself, with real processes and CRIU: tests/integration/test_run.py)."""

import os
import signal
from datetime import timedelta

import pytest

from ckpt.commands.run import RunRequest, Supervisor, default_name, describe_status
from ckpt.errors import UsageError
from tests.helpers import env_settings


def request(**changes) -> RunRequest:
    return RunRequest(**{"command": ["python3", "server.py"], "every": timedelta(minutes=5), "name": "server",
                         **changes})


@pytest.mark.parametrize("command,name", [
    (["/usr/bin/python3", "x.py"], "python3"),
    (["./my server"], "my-server"),
    (["7zip"], "run-7zip"),
    (["x" * 100], "x" * 64),
])
def test_the_default_name_comes_from_the_program(command, name):
    assert default_name(command) == name


def test_how_the_tree_ended_is_told_and_handed_on():
    assert describe_status(0) == ("exited with status 0", 0, True)
    assert describe_status(3 << 8) == ("exited with status 3", 3, False)
    assert describe_status(signal.SIGKILL) == ("killed by signal 9 (SIGKILL)", 128 + 9, False)


@pytest.mark.parametrize("changes,refused", [
    ({"command": []}, "no command to run"),
    ({"every": timedelta(milliseconds=500)}, "--every must be at least 1s"),
    ({"first_after": timedelta(0)}, "--first-after must be at least 1s"),
    ({"keep_last": -1}, "--keep-last -1 is negative"),
    ({"max_restores": -2}, "--max-restores -2 is negative"),
])
def test_a_request_that_cannot_run_is_refused_before_anything_starts(isolated_env, changes, refused):
    with pytest.raises(UsageError, match=refused):
        Supervisor(isolated_env, request(**changes), env_settings())
    assert not os.path.exists(isolated_env), "a refused run made the store"


def test_a_program_asking_for_its_checkpoints_is_answered(isolated_env):
    supervisor = Supervisor(isolated_env, request(), env_settings())
    supervisor.checkpoint_requested("20260101-000000-000-aaaaaa", None, client=None, error=None, result_file=False)
    supervisor.checkpoint_requested("20260101-000000-000-bbbbbb", None, client=None, error="frozen", result_file=False)
    assert supervisor.result("20260101-000000-000-aaaaaa") == "PENDING"
    assert supervisor.result("20260101-000000-000-bbbbbb") == "FAILED frozen"
    assert supervisor.result("20260101-000000-000-cccccc").startswith("ERROR unknown checkpoint")
    supervisor.restored_from = "20260101-000000-000-aaaaaa"
    assert supervisor.result("20260101-000000-000-aaaaaa") == "RESTORED 20260101-000000-000-aaaaaa"
    assert supervisor.agent_name() == "server" and supervisor.supervised_pid() is None
