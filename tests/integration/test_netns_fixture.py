"""The test hosts themselves (tests/netns.py): a host B with PIDs of its own restores a tree
with the PID that its original, frozen in host A on this same kernel, still holds, as a
migration's destination must."""

from __future__ import annotations

import json
import signal
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, read_lines, state, wait_until
from tests.netns import hosts_with_own_pids, TwoHosts

pytestmark = pytest.mark.integration


@pytest.fixture
def hosts(tmp_path):
    with hosts_with_own_pids(tmp_path) as made:
        yield made


def test_host_b_has_its_own_pids_and_name(hosts: TwoHosts, tmp_path: Path):
    assert hosts.b.init_pid is not None
    assert hosts.pids_in(hosts.b)[0] == 1  # its PID 1, host_init.py
    named = subprocess.run(hosts.b.command("hostname"), capture_output=True, text=True, timeout=30, check=True)
    assert named.stdout.strip() == "host-b"
    assert socket.gethostname() != "host-b"
    # what a migration's destination agent sees: ssh lands inside B's namespaces
    seen = subprocess.run([*shlex.split(hosts.ssh(via=hosts.a)), hosts.b.alias, "hostname; cat /proc/1/cmdline"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert seen.startswith("host-b\n") and "host_init.py" in seen

    out = tmp_path / "count-b.txt"
    started = hosts.start_in(hosts.b, [sys.executable, FIXTURES / "counter.py", out], "counter-b")
    assert started.pid != started.host_pid
    assert hosts.is_running(hosts.b, started.pid)
    assert started.pid in hosts.pids_in(hosts.b)
    wait_until(lambda: len(read_lines(out)) >= 2, what="the counter on B")
    hosts.kill_in(hosts.b, started.pid)
    assert not hosts.is_running(hosts.b, started.pid)


def test_restore_in_b_with_the_pid_the_frozen_original_holds_in_a(hosts: TwoHosts, tmp_path: Path):
    out = tmp_path / "count.txt"
    original = hosts.start_in(hosts.a, [sys.executable, FIXTURES / "counter.py", out], "counter")
    wait_until(lambda: len(read_lines(out)) >= 3, what="the counter on A")
    dumped = json.loads(hosts.ckpt(hosts.a, "dump", original.pid, "--json").stdout)
    original.popen.send_signal(signal.SIGSTOP)  # frozen, its PID held in A
    wait_until(lambda: state(original.pid) == "T", what="the original stopped")
    counted = len(read_lines(out))

    restored = json.loads(hosts.ckpt(hosts.b, "restore", dumped["id"], "--json").stdout)

    assert restored["pid"] == original.pid
    assert hosts.is_running(hosts.b, original.pid)
    assert state(original.pid) == "T"  # the host's PID original.pid is still A's, stopped
    assert hosts.b.host_pid(original.pid) != original.pid
    wait_until(lambda: len(read_lines(out)) >= counted + 3, what="the restored counter counting on in B")
    after = [int(n) for n in read_lines(out)[counted:]]
    assert 1 < after[0] <= counted + 1  # went on from where it was dumped, not from 1
    assert after == list(range(after[0], after[0] + len(after)))
    # restored by `criu restore -d` inside B: its parent is B's PID 1
    host_pid = hosts.b.host_pid(original.pid)
    assert Path(f"/proc/{host_pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(hosts.b.init_pid)
