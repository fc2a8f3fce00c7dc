"""Records of running page servers (CKPT_LAZY_DIR): which count as live (a dump of their tree
waits for them) and which are stale (removed)."""

import json
import os

from ckpt.restore import lazy
from ckpt.system import procfs


def write(directory, name, record):
    (directory / f"{name}.json").write_text(json.dumps(record))


def test_a_record_names_its_server_by_pid_and_start_time(tmp_path):
    me = os.getpid()
    here = lazy._pid_namespace()
    write(tmp_path, "live", {"server_pid": me, "server_start": procfs.start_ticks(me), "pidns": here, "pids": [1]})
    # Its PID taken by another process since: the start time differs.
    write(tmp_path, "reused", {"server_pid": me, "server_start": procfs.start_ticks(me) - 1, "pidns": here,
                               "pids": [2]})
    # An older ckpt's record, no start time, whose PID is a kernel thread's now (kthreadd, PID 2).
    write(tmp_path, "kernel", {"server_pid": 2, "pids": [3]})
    # A server in a PID namespace of its own: its PIDs are not this namespace's; left alone.
    write(tmp_path, "elsewhere", {"server_pid": 10, "server_start": 1, "pidns": here + 1, "pids": [4]})
    live = lazy._live_records(tmp_path)
    assert [r["pids"] for r in live] == [[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.json", "live.json"]
