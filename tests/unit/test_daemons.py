"""ckpt/system/daemons.py: a cron daemon is found by its name or its executable, read from /proc."""

import shutil
import subprocess
import time

import pytest

from ckpt.system import daemons


def _fake_process(proc, pid, comm, exe=None, cmdline=b"", state="S"):
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "comm").write_text(comm + "\n")
    (entry / "stat").write_text(f"{pid} ({comm}) {state} 1 1 1\n")
    (entry / "cmdline").write_bytes(cmdline)
    if exe:
        (entry / "exe").symlink_to(exe)


@pytest.mark.parametrize("comm, exe, cmdline, found", [
    ("cron", "/usr/sbin/cron", b"/usr/sbin/cron\0-f\0", True),  # Debian's
    ("crond", "/usr/sbin/crond", b"crond\0", True),  # cronie
    ("busybox", "/bin/busybox", b"busybox\0crond\0-f\0", True),  # `busybox crond`
    ("crond", "/bin/busybox", b"crond\0", True),  # busybox's applet by its link
    ("cronjob", "/usr/bin/cronjob", b"cronjob\0", False),
    ("busybox", "/bin/busybox", b"busybox\0sh\0", False),
    ("sleep", "/usr/bin/sleep", b"sleep\0cron\0", False),  # an argument is not a name
])
def test_a_cron_daemon_is_found_by_its_name(tmp_path, comm, exe, cmdline, found):
    _fake_process(tmp_path, 1, "init", "/sbin/init")
    _fake_process(tmp_path, 42, comm, exe, cmdline)
    assert daemons.cron_daemon_pid(tmp_path) == (42 if found else None)


def test_a_zombie_cron_is_not_a_daemon(tmp_path):
    _fake_process(tmp_path, 42, "cron", None, b"", state="Z")
    assert daemons.cron_daemon_pid(tmp_path) is None


def test_a_real_process_named_crond_is_found(tmp_path):
    """Through the real /proc: a copy of sleep named crond (its comm and its exe), ended by PID."""
    if daemons.cron_daemon_pid() is not None:
        pytest.skip("a cron daemon runs here already")
    crond = tmp_path / "crond"
    shutil.copy(shutil.which("sleep"), crond)
    child = subprocess.Popen([str(crond), "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while daemons.cron_daemon_pid() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemons.cron_daemon_pid() == child.pid
    finally:
        child.kill()
        child.wait(timeout=10)
    assert daemons.cron_daemon_pid() is None


def test_systemd_is_not_asked_when_it_is_not_pid_1(monkeypatch):
    monkeypatch.setattr(daemons, "init_name", lambda proc=None: "tini")
    monkeypatch.setattr(daemons.subprocess, "run", lambda *a, **k: pytest.fail("systemctl asked"))
    assert daemons.systemd_state() is None
