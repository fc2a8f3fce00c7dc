"""A restore waits for the tree's PIDs (ckpt/system/procs.py): zombies and processes on their
way out (killed with kill -9, still tearing down) get the whole wait, a live holder a short grace.
A restore right after `kill -9` of the agent failed when the killed process took over a second to
go (session 11's rehearsal, test_each_call_happens_exactly_once_across_kill_9_and_restores)."""

import subprocess
import threading
import time

import pytest

from ckpt.errors import PidInUse
from ckpt.system import procs


def test_a_zombie_is_exiting_and_a_sleeping_process_is_not():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while procs.process_state(sleeper.pid) != "S":  # started (exec'd) and asleep
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not procs.is_exiting(sleeper.pid)
        sleeper.kill()
        while procs.process_state(sleeper.pid) != "Z":  # not reaped: PF_EXITING stays set
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert procs.is_exiting(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert procs.is_exiting(sleeper.pid), "a PID that is gone is not held by anything live"


def test_a_process_on_its_way_out_gets_the_whole_wait_and_a_live_one_the_grace(monkeypatch):
    holder = subprocess.Popen(["sleep", "30"])
    try:
        started = time.monotonic()
        with pytest.raises(PidInUse, match=f"PID {holder.pid} needed by the checkpoint is in use by 'sleep 30'"):
            procs.wait_for_pids_free([holder.pid], timeout=3.0, live_grace=0.3)
        assert 0.3 <= time.monotonic() - started < 2.0, "a live holder fails after the grace"

        monkeypatch.setattr(procs, "is_exiting", lambda pid: pid == holder.pid)
        started = time.monotonic()
        with pytest.raises(PidInUse):
            procs.wait_for_pids_free([holder.pid], timeout=1.5, live_grace=0.3)
        assert time.monotonic() - started >= 1.5, "one on its way out is waited for until the timeout"

        # ... and the wait ends as soon as it is gone (killed and reaped by us, its parent).
        ending = threading.Timer(0.8, lambda: (holder.kill(), holder.wait()))
        ending.start()
        started = time.monotonic()
        procs.wait_for_pids_free([holder.pid], timeout=10.0, live_grace=0.3)
        assert 0.7 <= time.monotonic() - started < 5.0
        ending.join()
    finally:
        holder.kill()
        holder.wait()
