"""ckpt.checkpoint()'s parts that need no CRIU: callback order and cancellation, the wait's
conclusions (checked against the incarnation), result files, and that `import ckpt` stays cheap.
The real thing, with CRIU: tests/integration/test_agent_api.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckpt
from ckpt.agent import checkpoint as agent
from ckpt.agent import results
from ckpt.errors import CheckpointCancelled, CheckpointFailed, ExitCode, InvalidReference, UsageError
from ckpt.store import ids
from tests.helpers import ROOT


class Recorded(agent.Checkpointer):
    """A Checkpointer of its own (a clean registry) whose take records where it ran instead of
    dumping."""

    def __init__(self):
        super().__init__(take=self.record)
        self.log: list[str] = []

    def record(self, name, store):
        self.log.append("dump")
        return agent.CheckpointResult("20261202-000000-000-abcdef", False, name)


@pytest.fixture
def program():
    return Recorded()


def layer(program: Recorded, label: str, fail: bool = False) -> None:
    @program.before_checkpoint
    def before():
        program.log.append(f"before {label}")
        if fail:
            raise ValueError(f"{label} says no")

    @program.after_restore
    def after():
        program.log.append(f"after {label}")


def test_before_in_reverse_order_after_in_order(program):
    for label in "ABC":
        layer(program, label)
    result = program.checkpoint(name="agent")
    assert program.log == ["before C", "before B", "before A", "dump", "after A", "after B", "after C"]
    assert result == agent.CheckpointResult("20261202-000000-000-abcdef", False, "agent")


def test_a_failing_before_callback_undoes_the_layers_above_it_and_dumps_nothing(program):
    layer(program, "A")
    layer(program, "B", fail=True)
    layer(program, "C")
    layer(program, "D")
    with pytest.raises(CheckpointCancelled) as info:
        program.checkpoint()
    assert program.log == ["before D", "before C", "before B", "after C", "after D"]
    assert isinstance(info.value.__cause__, ValueError) and info.value.exit_code == ExitCode.ERROR
    assert "raised ValueError: B says no" in str(info.value) and "nothing was frozen or written" in str(info.value)


def test_the_first_before_callback_failing_undoes_nothing(program):
    layer(program, "A")
    layer(program, "B", fail=True)
    with pytest.raises(CheckpointCancelled):
        program.checkpoint()
    assert program.log == ["before B"]


def test_a_failed_dump_runs_every_after_callback_then_raises(program):
    layer(program, "A")
    layer(program, "B")

    def take(name, store):
        program.log.append("dump")
        raise CheckpointFailed("checkpoint failed: CRIU said no")

    program.take = take
    with pytest.raises(CheckpointFailed, match="CRIU said no"):
        program.checkpoint()
    assert program.log == ["before B", "before A", "dump", "after A", "after B"]


def test_every_after_callback_runs_even_if_one_raises(program):
    @program.after_restore
    def broken():
        raise OSError("cannot reconnect")

    layer(program, "A")
    with pytest.raises(OSError, match="cannot reconnect"):
        program.checkpoint()
    assert program.log == ["before A", "dump", "after A"]


def test_a_bad_name_is_refused_before_any_callback(program):
    layer(program, "A")
    with pytest.raises(InvalidReference):
        program.checkpoint(name="not a name")
    assert program.log == []


def test_callbacks_must_be_callable():
    with pytest.raises(TypeError):
        ckpt.before_checkpoint("close")
    with pytest.raises(TypeError):
        agent.Checkpointer().after_restore("close")


ORIGINAL, RESTORED = ("boot", 100), ("boot", 200)


def wait_with(monkeypatch, tmp_path, incarnations, record=None, dumper_alive=True):
    """agent._wait with the incarnation read in turn from `incarnations` (the last repeats)."""
    seen = list(incarnations)
    monkeypatch.setattr(agent.procfs, "pid_exists", lambda pid: dumper_alive)
    monkeypatch.setattr(agent, "POLL_SECONDS", 0.001)
    path = tmp_path / "1-20261202-000000-000-abcdef.json"
    if record is not None:
        results.write(path, record)
    return agent._wait(ORIGINAL, path, 4242, None, tmp_path / "x.log",
                       incarnation=lambda: seen.pop(0) if len(seen) > 1 else seen[0])


def test_the_wait_returns_the_result_of_the_original(monkeypatch, tmp_path):
    assert wait_with(monkeypatch, tmp_path, [ORIGINAL], {"ok": True}) == {"ok": True}


def test_a_copy_restored_after_the_first_look_does_not_take_the_originals_result(monkeypatch, tmp_path):
    assert wait_with(monkeypatch, tmp_path, [ORIGINAL, RESTORED], {"ok": True}) is None


def test_a_copy_restored_after_its_dumper_ended_is_not_a_failure(monkeypatch, tmp_path):
    assert wait_with(monkeypatch, tmp_path, [ORIGINAL, RESTORED], dumper_alive=False) is None


def test_a_dumper_gone_without_a_result_is_a_failure(monkeypatch, tmp_path):
    with pytest.raises(CheckpointFailed, match=r"ckpt dump \(PID 4242\) ended without a result") as info:
        wait_with(monkeypatch, tmp_path, [ORIGINAL], dumper_alive=False)
    assert info.value.log_path == str(tmp_path / "x.log")


def test_result_files_round_trip_and_strangers_files_are_ignored(tmp_path):
    path = tmp_path / "7-20261202-000000-000-abcdef.json"
    results.write(path, {"id": "x", "ok": True})
    assert results.read(path) == {"id": "x", "ok": True}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)  # nobody's: not a result we trust
        assert results.read(path) is None
    path.unlink()
    assert results.read(path) is None


def test_the_result_file_must_be_in_the_agent_dir_and_name_the_id(tmp_path):
    checkpoint_id = ids.new_id()
    good = tmp_path / f"123-{checkpoint_id}.json"
    assert results.check_result_file(good, tmp_path, checkpoint_id) == good
    for bad in (tmp_path / "sub" / good.name, tmp_path / f"123-{ids.new_id()}.json", tmp_path / "x.json",
                tmp_path / f"0-{checkpoint_id}.json", tmp_path / ".." / good.name):
        with pytest.raises(UsageError):
            results.check_result_file(bad, tmp_path, checkpoint_id)


def test_the_agent_dir_is_made_shared_and_sticky(tmp_path):
    agent_dir = tmp_path / "run" / "agent"
    results.ensure_dir(agent_dir)
    assert oct(os.stat(agent_dir).st_mode & 0o7777) == "0o1777"
    results.ensure_dir(agent_dir)  # again: fine
    os.chmod(agent_dir, 0o777)  # anyone may replace files in it: refused
    with pytest.raises(UsageError, match="anyone may replace files"):
        results.ensure_dir(agent_dir)


def test_new_ids_must_be_made_just_now():
    assert ids.check_new_id(ids.new_id())
    with pytest.raises(InvalidReference, match="was not made just now"):
        ids.check_new_id("20200101-000000-000-abcdef")


def test_import_ckpt_imports_nothing_else():
    code = "import ckpt, sys; print(sorted(m for m in sys.modules if m.startswith('ckpt')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert json.loads(out.replace("'", '"')) == ["ckpt"]
    assert "checkpoint" in dir(ckpt) and "journal" in dir(ckpt)
    with pytest.raises(AttributeError):
        ckpt.no_such_thing  # noqa: B018
