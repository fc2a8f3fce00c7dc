"""ckpt/system/procs.py kill_tree, what an aborted restore ends its tree with: every process of
a tree that keeps forking is gone (or a zombie) when it returns, none orphaned on the way."""

from __future__ import annotations

import subprocess
import sys
import time

from ckpt.system import procs
from tests.helpers import state, wait_until

# Each process forks children without pause (at most 6, down to depth 3), each child appending
# its PID to the file first: a tree that grows while it is being ended.
FORKING = r"""
import os, sys, time
out, depth = sys.argv[1], 0
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        depth += 1
        with open(out, "a") as f:
            f.write(f"{os.getpid()}\n")
        if depth >= 3:
            break
time.sleep(300)
"""


def test_a_tree_that_keeps_forking_is_ended_whole(tmp_path):
    out = tmp_path / "pids"
    out.touch()
    root = subprocess.Popen([sys.executable, "-c", FORKING, str(out)], start_new_session=True)
    try:
        wait_until(lambda: len(out.read_text().split()) >= 5, timeout=30, what="the tree to fork")
        procs.kill_tree(root.pid)
        root.wait(timeout=10)
        time.sleep(0.3)  # any process still forking would have written its PID by now
        seen = [int(pid) for pid in out.read_text().split()]
        alive = [pid for pid in seen if state(pid) not in (None, "Z", "X")]
        assert alive == [], f"{len(alive)} of {len(seen)} processes of the tree survived"
    finally:
        procs.kill_tree(root.pid)
        for pid in [int(pid) for pid in out.read_text().split()]:  # survivors (orphans), ours by their command
            if state(pid) not in (None, "Z", "X") and FORKING in " ".join(procs.psutil.Process(pid).cmdline()):
                procs.kill_tree(pid)
        if root.poll() is None:
            root.kill()
            root.wait()
