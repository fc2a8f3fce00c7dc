"""ckpt.checkpoint() from inside a real program (tests/fixtures/agent_counter.py), with real CRIU:
the original goes on with restored=False; killed and restored from that checkpoint, the copy
returns from the same call with restored=True, the same ID, and its memory (counters, threads,
a child) as it was; callbacks in order on both sides; a failing before-callback cancels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt.store import ids
from tests.helpers import ckpt, ckpt_json, read_lines, state, tree_pids, wait_until

AGENT = "agent_counter.py"
LINE_RE = re.compile(r"^checkpoint (\S+) restored=(True|False) at=(\d+) took=([0-9.]+)$")


@pytest.fixture
def agent_dir(tmp_path, monkeypatch):
    """The programs' result files in the test's directory, not /run/ckpt/agent."""
    path = tmp_path / "agent"
    monkeypatch.setenv("CKPT_AGENT_DIR", str(path))
    return path


def outcomes(out: Path) -> list[str]:
    return [line for line in read_lines(out) if line.startswith(("checkpoint ", "failed "))]


def checkpointed(out: Path, count: int = 1, timeout: float = 90) -> list[tuple[str, bool, int]]:
    """The first `count` checkpoint lines: (id, restored, at)."""
    lines = wait_until(lambda: len(outcomes(out)) >= count and outcomes(out), timeout=timeout,
                       what=f"{count} checkpoint line(s) in {out.name}")
    parsed = []
    for line in lines[:count]:
        match = LINE_RE.match(line)
        assert match, f"the program reported: {line}"
        parsed.append((match.group(1), match.group(2) == "True", int(match.group(3))))
    return parsed


def counts_after(out: Path, line_index: int) -> list[int]:
    """The 'count I' values written after the line_index-th checkpoint line."""
    seen, values = -1, []
    for line in read_lines(out):
        if line.startswith("checkpoint "):
            seen += 1
        elif seen == line_index and line.startswith("count "):
            values.append(int(line.split()[1]))
    return values


def kill_and_restore(procs, pid: int, checkpoint_id: str, before_restore=lambda: None) -> int:
    """Ends the original tree (as a crash would), restores the checkpoint; the restored root PID.
    before_restore() runs once the original is gone."""
    pids = tree_pids(pid)
    procs.kill_tree(pid)
    wait_until(lambda: all(state(p) is None for p in pids), timeout=15, what="the original tree to be gone")
    before_restore()
    restored = ckpt_json("restore", checkpoint_id)
    procs.adopt(restored["pid"])
    assert restored["id"] == checkpoint_id and restored["pid"] == pid
    return restored["pid"]


def assert_round_trip(procs, out: Path, agent_dir: Path, *args: str) -> tuple[str, int, int]:
    """Runs the program to its checkpoint, checks the original side, kills and restores it, and
    checks the restored side: (the ID, the count at the checkpoint, the restored PID)."""
    target = procs.start(AGENT, out, *args)
    [(checkpoint_id, restored, at)] = checkpointed(out)
    assert restored is False
    assert [c["id"] for c in ckpt_json("list")] == [checkpoint_id]
    wait_until(lambda: len(counts_after(out, 0)) >= 3, what="the original to go on counting")
    assert counts_after(out, 0)[:3] == [at + 1, at + 2, at + 3]
    assert not agent_dir.exists() or list(agent_dir.iterdir()) == [], "the result and log files were not removed"

    pid = kill_and_restore(procs, target.pid, checkpoint_id)
    second = checkpointed(out, 2)[1]
    assert second == (checkpoint_id, True, at), "the restored copy did not see the restored side of its checkpoint"
    wait_until(lambda: len(counts_after(out, 1)) >= 3, what="the restored copy to go on counting")
    assert counts_after(out, 1)[:3] == [at + 1, at + 2, at + 3], "the restored counter did not go on"
    return checkpoint_id, at, pid


def test_the_restored_copy_returns_from_the_same_call_with_restored_true(procs, tmp_path, agent_dir):
    checkpoint_id, _, _ = assert_round_trip(procs, tmp_path / "out.txt", agent_dir, "--name", "agent")
    assert ckpt_json("show", checkpoint_id)["name"] == "agent"


def test_from_asyncio_through_a_thread(procs, tmp_path, agent_dir):
    assert_round_trip(procs, tmp_path / "out.txt", agent_dir, "--asyncio")


def test_eight_busy_threads_and_a_call_from_another_thread(procs, tmp_path, agent_dir):
    out = tmp_path / "out.txt"
    assert_round_trip(procs, out, agent_dir, "--threads", "8")

    def thread_counts() -> list[list[int]]:
        return [[int(c) for c in line.split()[1].split(",")] for line in read_lines(out) if line.startswith("threads ")]

    # The line before the restored copy's first own line is the original's last; the restored
    # threads go on from what they had counted at the checkpoint, not from 0, and keep counting.
    lines = read_lines(out)
    restored_at = next(i for i, line in enumerate(lines) if "restored=True" in line)
    at_checkpoint = next(line for line in reversed(lines[:lines.index(next(
        line for line in lines if "restored=False" in line))]) if line.startswith("threads "))
    before = [int(c) for c in at_checkpoint.split()[1].split(",")]
    wait_until(lambda: len([line for line in read_lines(out)[restored_at:] if line.startswith("threads ")]) >= 3,
               what="the restored threads' counts")
    after = thread_counts()[-1]
    assert len(after) == 8 and all(a > b > 0 for a, b in zip(after, before, strict=True)), (before, after)


def test_a_child_process_is_checkpointed_with_its_parent(procs, tmp_path, agent_dir):
    out, child_out = tmp_path / "out.txt", tmp_path / "child.txt"
    target = procs.start(AGENT, out, "--child", child_out, "--at", "10")
    wait_until(lambda: len(read_lines(child_out)) >= 3, what="the child to count")
    procs.pids.update(tree_pids(target.pid))  # ended by PID at teardown even if its parent dies first
    [(checkpoint_id, restored, _)] = checkpointed(out)
    assert restored is False
    [show] = [c for c in ckpt_json("list") if c["id"] == checkpoint_id]
    assert len(tree_pids(target.pid)) == 2
    # What the original child wrote, counted once it is gone (it counts on until the kill).
    written_by_original: list[int] = []
    kill_and_restore(procs, target.pid, checkpoint_id,
                     lambda: written_by_original.append(len(read_lines(child_out))))
    written = written_by_original[0]
    checkpointed(out, 2)
    wait_until(lambda: len(read_lines(child_out)) >= written + 3, what="the restored child to count")
    resumed = [int(v) for v in read_lines(child_out)[written:]]
    # The child goes on from the value it had at the freeze (it has counted since, so a lower
    # one than its last), one by one: its memory was in the checkpoint.
    assert 1 < resumed[0] <= written, resumed[:5]
    assert resumed[:3] == [resumed[0], resumed[0] + 1, resumed[0] + 2]
    assert show["processes"] == 2


def test_callbacks_run_in_order_on_both_sides(procs, tmp_path, agent_dir):
    out, calls = tmp_path / "out.txt", tmp_path / "calls.txt"
    target = procs.start(AGENT, out, "--callbacks", calls)
    [(checkpoint_id, _, _)] = checkpointed(out)
    # before: last registered first; after: in registration order
    original = ["before C", "before B", "before A", "after A", "after B", "after C"]
    assert read_lines(calls) == original
    kill_and_restore(procs, target.pid, checkpoint_id)
    checkpointed(out, 2)
    wait_until(lambda: len(read_lines(calls)) >= 9, what="the restored copy's callbacks")
    assert read_lines(calls) == original + ["after A", "after B", "after C"]


def test_a_failing_before_callback_cancels_the_checkpoint(procs, tmp_path, agent_dir, isolated_env):
    ckpt("init", isolated_env)  # an empty store, to find it still empty
    out, calls = tmp_path / "out.txt", tmp_path / "calls.txt"
    target = procs.start(AGENT, out, "--callbacks", calls, "--fail-before", "B")
    [line] = wait_until(lambda: outcomes(out), timeout=60, what="the checkpoint's outcome")
    assert line.startswith("failed CheckpointCancelled exit=1: checkpoint cancelled: the before_checkpoint "
                           "callback layer.<locals>.before raised RuntimeError: layer B refuses"), line
    # C's before-callback ran and is undone by C's after-callback; B raised; A never ran.
    assert read_lines(calls) == ["before C", "before B", "after C"]
    assert ckpt_json("list") == []
    assert not agent_dir.exists() or list(agent_dir.iterdir()) == []
    # the program goes on
    written = len(read_lines(out))
    wait_until(lambda: len(read_lines(out)) >= written + 3, what="the program to go on after the cancel")
    assert state(target.pid) not in (None, "Z")


def test_a_failed_dump_raises_checkpoint_failed_and_keeps_the_dumpers_output(procs, tmp_path, agent_dir,
                                                                             monkeypatch):
    """A store the dumper cannot use: the program hears why, with the dumper's exit code, and
    the dumper's output stays in the agent directory; the after-callbacks ran (what the
    before-callbacks closed is open again)."""
    out, calls = tmp_path / "out.txt", tmp_path / "calls.txt"
    not_a_store = tmp_path / "not-a-store"
    not_a_store.write_text("a file\n")
    monkeypatch.setenv("CKPT_STORE", str(not_a_store))
    target = procs.start(AGENT, out, "--callbacks", calls)
    [line] = wait_until(lambda: outcomes(out), timeout=60, what="the checkpoint's outcome")
    assert line.startswith("failed CheckpointFailed exit="), line
    assert read_lines(calls) == ["before C", "before B", "before A", "after A", "after B", "after C"]
    [log] = list(agent_dir.glob("*.log"))
    assert "Error:" in log.read_text() and str(log) in line
    assert list(agent_dir.glob("*.json")) == []
    written = len(read_lines(out))
    wait_until(lambda: len(read_lines(out)) >= written + 3, what="the program to go on after the failure")
    assert state(target.pid) not in (None, "Z")


def test_ckpt_dump_refuses_an_id_that_is_not_new(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "count.txt")
    wait_until(lambda: read_lines(tmp_path / "count.txt"), what="counter")
    first = ckpt_json("dump", target.pid)["id"]
    again = ckpt("dump", target.pid, "--id", first, check=False)
    assert again.returncode == 2 and f"a checkpoint with ID {first} exists already" in again.stderr
    old = ckpt("dump", target.pid, "--id", "20200101-000000-000-abcdef", check=False)
    assert old.returncode == 2 and "was not made just now" in old.stderr
    bad = ckpt("dump", target.pid, "--id", "x", "--result-file", "/tmp/x.json", check=False)
    assert bad.returncode == 2 and "'x' is not a checkpoint ID" in bad.stderr
    fresh = ids.new_id()
    elsewhere = ckpt("dump", target.pid, "--id", fresh, "--result-file", tmp_path / f"{target.pid}-{fresh}.json",
                     check=False)
    assert elsewhere.returncode == 2 and "is not /run/ckpt/agent/<pid>-" in elsewhere.stderr
    assert not (tmp_path / f"{target.pid}-{fresh}.json").exists()
    assert [c["id"] for c in ckpt_json("list")] == [first]
