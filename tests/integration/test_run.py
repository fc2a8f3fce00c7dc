"""`ckpt run`: a supervised command that dies is restored from its newest checkpoint."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import FIXTURES, ROOT, ckpt, ckpt_json, read_lines, state, wait_until
from tests.jsonshape import assert_shape


def start_run(tmp_path, procs, *args):
    log = open(tmp_path / "run.stderr", "wb")
    supervisor = subprocess.Popen([sys.executable, "-m", "ckpt", "run", "--output", str(tmp_path / "run.out"),
                                   *map(str, args)], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True)
    log.close()
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    return supervisor


def events(tmp_path) -> list[str]:
    return read_lines(tmp_path / "run.stderr")


def child_pid(tmp_path) -> int:
    line = wait_until(lambda: [e for e in events(tmp_path) if "started PID" in e], what="start")[0]
    return int(line.split("started PID ")[1].split(":")[0])


def ints(path: Path) -> list[int]:
    return [int(x) for x in read_lines(path)]


def test_killed_command_carries_on_from_the_last_checkpoint(procs, tmp_path):
    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--name", "counter", "--keep-last", "2", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    wait_until(lambda: sum("checkpoint " in e for e in events(tmp_path)) >= 3, timeout=30, what="three checkpoints")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("killed by signal 9" in e for e in events(tmp_path)), what="the death to be seen")
    written = ints(out)  # the killed counter has written its last value by now
    killed_at, n = written[-1], len(written)  # what follows is the restored counter's (it appends)
    wait_until(lambda: any("restored" in e for e in events(tmp_path)), what="the restore")
    # (Counted before the restore: the restored counter may write before its restore is logged,
    # and a count taken then missed its first values: 70 after a kill at 68, in one CI run.)
    wait_until(lambda: len(ints(out)) >= n + 5, what="the restored counter")
    after = ints(out)[n:]
    # It goes on from a checkpointed value: not from 1, and at most one past where it was killed
    # (when the last checkpoint came after its last write).
    assert 10 < after[0] <= killed_at + 1
    assert after == list(range(after[0], after[0] + len(after)))
    assert len([c for c in ckpt_json("list") if c["name"] == "counter"]) <= 3
    supervisor.send_signal(signal.SIGTERM)  # forwarded to the command
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    assert state(pid) in (None, "Z")
    assert "supervision ends" in events(tmp_path)[-1]


def test_restore_limit(procs, tmp_path):
    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--max-restores", "1", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    wait_until(lambda: any("checkpoint " in e for e in events(tmp_path)), what="a checkpoint")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("restored" in e for e in events(tmp_path)), what="the restore")
    os.kill(pid, signal.SIGKILL)  # the restored command has the same PID
    assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
    assert any("restore limit (1) reached" in e for e in events(tmp_path))


def test_clean_exit_ends_supervision_with_its_status(procs, tmp_path):
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--", sys.executable, "-c",
                           "import time; time.sleep(2.5)")
    assert supervisor.wait(timeout=30) == 0
    assert any("exited with status 0; supervision ends" in e for e in events(tmp_path))


def test_failure_before_any_checkpoint_is_handed_on(procs, tmp_path):
    supervisor = start_run(tmp_path, procs, "--every", "1m", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert supervisor.wait(timeout=30) == 3
    assert any("nothing to restore" in e for e in events(tmp_path))


def test_run_forgets_only_the_checkpoints_it_made(procs, tmp_path):
    """Issue 24: `ckpt run --keep-last` forgot, silently, a checkpoint dumped by hand under its name."""
    hand_out = tmp_path / "hand.txt"
    target = procs.start("counter.py", hand_out)
    wait_until(lambda: len(ints(hand_out)) >= 3, what="the counter dumped by hand to count")
    hand = ckpt("dump", target.pid, "--name", "keepme").stdout.strip()

    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--keep-last", "1", "--name", "keepme", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    procs.pids.add(child_pid(tmp_path))
    wait_until(lambda: sum(e.startswith("ckpt: checkpoint ") for e in events(tmp_path)) >= 3, timeout=30,
               what="three checkpoints")
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM
    taken = [e.split()[2].rstrip(":") for e in events(tmp_path) if e.startswith("ckpt: checkpoint ")]

    listed = ckpt_json("list")
    assert hand in [c["id"] for c in listed], "the checkpoint dumped by hand is still there"
    assert_shape(listed, "list")
    assert [(c["id"], c["origin"]) for c in listed] == [
        (hand, {"kind": "dump", "name": None}), (taken[-1], {"kind": "run", "name": "keepme"})]
    forgot = re.compile(r"^ckpt: forgot 1 checkpoint of 'keepme' \(keep-last 1\): [0-9a-f-]{26}$")
    said = [e.split()[-1] for e in events(tmp_path) if forgot.match(e)]
    assert said == taken[:-1], "each checkpoint of the run but the last forgotten, and said so"
    shown = ckpt_json("show", hand)
    assert_shape(shown, "show")
    assert shown["origin"] == {"kind": "dump", "name": None}
    assert "made by ckpt dump (by hand)" in ckpt("show", hand).stdout
    assert "made by ckpt run --name keepme" in ckpt("show", taken[-1]).stdout

    # and the hand-made checkpoint still restores
    procs.kill_tree(target.pid)
    written = ints(hand_out)
    procs.adopt(int(ckpt("restore", hand).stdout.strip()))
    wait_until(lambda: len(ints(hand_out)) >= len(written) + 5, what="the restored counter")
    after = ints(hand_out)[len(written):]
    assert 3 <= after[0] <= written[-1] and after == list(range(after[0], after[0] + len(after)))
