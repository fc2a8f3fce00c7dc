"""Whether the daemons that run schedules run here: systemd as init, a cron daemon.

Only looked at, never touched: /proc is read and `systemctl is-system-running` asked. Either can
be missing in containers, minimal VMs and sandboxes, where a schedule installed for it would
never run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# The names a cron daemon runs under: Debian's cron, cronie (crond), busybox's applet as crond.
CRON_NAMES = ("cron", "crond", "cronie")
# What `systemctl is-system-running` answers when a systemd manager runs (not "offline", and
# nothing at all when systemctl is missing).
SYSTEMD_STATES = ("initializing", "starting", "running", "degraded", "maintenance", "stopping")


def init_name(proc: Path = Path("/proc")) -> str:
    """The command name of PID 1 ('systemd', 'tini', 'sh'...), '' when it cannot be read."""
    try:
        return (proc / "1" / "comm").read_text().strip()
    except OSError:
        return ""


def systemd_state() -> str | None:
    """What `systemctl is-system-running` answers ('running', 'degraded'...) when systemd is PID 1
    and its manager answers; None otherwise."""
    if init_name() != "systemd":
        return None
    try:
        proc = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=15,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = proc.stdout.strip()
    return state if state in SYSTEMD_STATES else None


def cron_daemon_pid(proc: Path = Path("/proc")) -> int | None:
    """The PID of a running cron daemon (by its command name or its executable), if any."""
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return None
    for entry in sorted(entries, key=int):
        base = proc / entry
        try:
            comm = (base / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        try:
            exe = os.path.basename(os.readlink(base / "exe"))
        except OSError:
            exe = ""  # a kernel thread, or another user's process when not root
        if _is_zombie(base):
            continue
        if comm in CRON_NAMES or exe in CRON_NAMES:
            return int(entry)
        if "busybox" in (comm, exe):
            try:
                argv = (base / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 1 and argv[1] == b"crond":  # `busybox crond`
                return int(entry)
    return None


def _is_zombie(base: Path) -> bool:
    try:
        data = (base / "stat").read_text()
    except OSError:
        return True
    return data[data.rindex(")") + 2:].startswith("Z")
