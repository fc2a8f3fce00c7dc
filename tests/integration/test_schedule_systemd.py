"""Schedules as real systemd timers (issue 24, item 4): a timer fires and its run takes a
checkpoint. Needs systemd as PID 1, which neither this project's hosts nor CI have: `make
vm-test` boots a second guest with it to run these (scripts/vm/guest-systemd.sh)."""

import json
import secrets
import subprocess
from pathlib import Path

import pytest

from ckpt.system import daemons
from tests.helpers import ckpt, ckpt_json, wait_until

pytestmark = [pytest.mark.systemd_timers, pytest.mark.skipif(
    daemons.systemd_state() is None, reason="systemd is not PID 1 here: 'make vm-test' runs it in a guest with it")]


def _timers() -> str:
    return subprocess.run(["systemctl", "list-timers", "--all", "--no-pager"], capture_output=True, text=True,
                          timeout=60).stdout


def test_a_timer_takes_a_checkpoint_and_rm_removes_it(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    name = f"timer-{secrets.token_hex(4)}"
    proc = ckpt("schedule", "add", name, "--pid", target.pid, "--every", "1m", "--keep-last", "1", "--json")
    added = json.loads(proc.stdout)
    units = [Path(f"/etc/systemd/system/ckpt-{name}.{kind}") for kind in ("service", "timer")]
    try:
        assert added["scheduler"] == "systemd" and added["will_run"] is True and "Warning" not in proc.stderr
        assert added["installed"] == str(units[1]) and all(u.exists() for u in units)
        assert f"ckpt-{name}.timer" in _timers()
        checkpoints = wait_until(lambda: ckpt_json("list"), timeout=150, interval=2,
                                 what="the timer to run the schedule")
        assert checkpoints[0]["name"] == name and checkpoints[0]["pid"] == target.pid
        last = wait_until(lambda: ckpt_json("schedule", "list")[0]["last"], timeout=60, what="the outcome")
        assert last["outcome"] == "ok", last
        row = ckpt_json("schedule", "list")[0]
        assert (row["scheduler"], row["installed"], row["will_run"]) == ("systemd", True, True)
        assert checkpoints[0]["id"] in Path(added["log"]).read_text(), "the run's output went to its log"
    finally:
        removed = ckpt("schedule", "rm", name, check=False)
        for unit in units:  # never leave a test's timer behind
            unit.unlink(missing_ok=True)
    assert removed.returncode == 0, removed.stderr
    assert f"ckpt-{name}" not in _timers()
