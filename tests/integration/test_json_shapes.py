"""Every command's --json output, from real runs with real CRIU, against docs/json.md.

One dumped target serves all the commands that read checkpoints; `ckpt run` has its own."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES, ROOT, ckpt, ckpt_json, read_lines, wait_until
from tests.jsonshape import assert_events, assert_shape


def ints(path) -> list[int]:
    return [int(x) for x in read_lines(path)]


@pytest.fixture
def cron_dir(tmp_path, monkeypatch):
    path = tmp_path / "cron.d"
    monkeypatch.setenv("CKPT_CRON_DIR", str(path))
    return path


def test_every_command_prints_its_documented_shape(procs, tmp_path, cron_dir):
    out = tmp_path / "count.txt"
    # stdout a pipe the test holds: the dump then has an external pipe to describe
    target = subprocess.Popen([sys.executable, str(FIXTURES / "counter.py"), out], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.popens.append(target)
    procs.pids.add(target.pid)
    wait_until(lambda: len(ints(out)) >= 3, what="the counter to count")

    first = ckpt_json("dump", target.pid, "--name", "shapes")
    assert_shape(first, "dump")
    second = ckpt_json("dump", target.pid, "--name", "shapes", "--stop")
    assert_shape(second, "dump")
    assert second["stopped"] and second["external_pipes"], "the shapes of these were checked too"
    target.wait(timeout=10)
    target.stdout.close()

    assert_shape(ckpt_json("list"), "list")
    shown = ckpt_json("show", second["id"])
    assert_shape(shown, "show")
    assert shown["processes"][0]["fds"] and shown["criu"]["external_pipes"]
    changed = ckpt_json("diff", first["id"], second["id"])
    assert_shape(changed, "diff")
    assert changed["per_process"]
    assert_shape(ckpt_json("verify", second["id"]), "verify")
    assert_shape(ckpt_json("verify", "--all"), "verify")

    restored = ckpt_json("restore", second["id"], "--output", tmp_path / "relayed.out")
    procs.adopt(restored["pid"])
    assert_shape(restored, "restore")

    added = ckpt_json("schedule", "add", "sched", "--pid", restored["pid"], "--every", "5m", "--keep-last", "1",
                      "--copy-to", tmp_path / "offsite")
    assert_shape(added, "schedule add")
    assert_shape(ckpt_json("schedule", "list"), "schedule list")
    outcome = ckpt_json("schedule", "run", "sched")
    assert_shape(outcome, "schedule run")
    assert outcome["copies"][0]["status"] == "copied", "the shape of the copies was checked too"
    copied = ckpt_json("copy", "--all", "--to", tmp_path / "elsewhere")
    assert_shape(copied, "copy")
    assert_shape(ckpt_json("copy", "--pending"), "copy: pending")
    ckpt("schedule", "add", "none", "--pid", restored["pid"], "--cron", "0 * * * *")  # no retention
    listed = ckpt_json("schedule", "list")
    assert_shape(listed, "schedule list")
    assert [r["last"] is not None for r in listed] == [False, True]
    procs.kill_tree(restored["pid"])
    assert ckpt("schedule", "run", "none", check=False).returncode == 3  # its target is gone
    listed = ckpt_json("schedule", "list")
    assert_shape(listed, "schedule list")
    assert listed[0]["last"]["outcome"] == "target-gone"
    for name in ("sched", "none"):
        assert_shape(ckpt_json("schedule", "rm", name), "schedule rm")

    assert_shape(ckpt_json("rm", first["id"], "--dry-run"), "rm")
    assert_shape(ckpt_json("forget", "--keep-last", "1", "--dry-run"), "forget")
    assert_shape(ckpt_json("prune", "--dry-run"), "prune")
    forgot = ckpt_json("forget", "--keep-last", "1", "--name", "shapes", "--prune")
    assert_shape(forgot, "forget")
    assert [r["id"] for r in forgot["remove"]] == [first["id"]] and forgot["pruned"]
    assert_shape(ckpt_json("rm", second["id"]), "rm")
    assert_shape(ckpt_json("prune"), "prune")


def test_run_prints_its_events_as_json_lines(procs, tmp_path):
    out = tmp_path / "count.txt"
    events_file = tmp_path / "events.jsonl"
    with open(events_file, "wb") as stdout:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "run", "--json", "--every", "1s", "--output", str(tmp_path / "run.out"),
             "--", sys.executable, FIXTURES / "counter.py", out, "0.05"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)

    def kinds() -> list[str]:
        return [e["event"] for e in assert_events(read_lines(events_file))]

    wait_until(lambda: "checkpoint" in kinds(), timeout=30, what="a checkpoint event")
    pid = assert_events(read_lines(events_file))[0]["pid"]
    procs.pids.add(pid)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: "restored" in kinds(), timeout=30, what="a restored event")
    supervisor.send_signal(signal.SIGTERM)  # forwarded to the command: supervision ends
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM
    events = assert_events(read_lines(events_file))
    seen = [e["event"] for e in events]
    assert seen[0] == "started" and seen[-1] == "exit"
    assert seen.index("checkpoint") < seen.index("died") < seen.index("restored")
    assert events[-1]["reason"] == "stopped" and events[-1]["exit_code"] == 128 + signal.SIGTERM
    died = events[seen.index("died")]
    assert died["pid"] == pid and died["exit_code"] == 128 + signal.SIGKILL
