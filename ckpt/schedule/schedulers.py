"""Which scheduler installs and runs schedules here, and whether it will run them at all.

CKPT_SCHEDULER=auto (the default) takes systemd's timers where systemd is PID 1 and answers
(for root: ckpt's units are system units) and cron elsewhere. A schedule installed for a
scheduler that does not run here (no cron daemon in a container, systemd not PID 1) would never
run: add, list and check say so instead of letting it look installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckpt.errors import UsageError
from ckpt.system import daemons

SCHEDULERS = ("systemd", "cron")


@dataclass(frozen=True)
class Facts:
    """What runs here: systemd's state (None: systemd is not PID 1 or does not answer) and the
    PID of a cron daemon (None: none runs)."""

    systemd: str | None
    cron_pid: int | None
    init: str = ""

    @classmethod
    def here(cls) -> Facts:
        return cls(daemons.systemd_state(), daemons.cron_daemon_pid(), daemons.init_name())

    def runs(self, scheduler: str) -> bool:
        return self.systemd is not None if scheduler == "systemd" else self.cron_pid is not None

    def why(self, scheduler: str) -> str:
        """Why `scheduler` runs or not, in a few words."""
        if scheduler == "systemd":
            if self.systemd is not None:
                return f"systemd is PID 1 ({self.systemd})"
            return f"systemd is not PID 1 here (PID 1 is {self.init or 'unknown'})" if self.init != "systemd" \
                else "systemd is PID 1 but does not answer"
        return f"a cron daemon runs (PID {self.cron_pid})" if self.cron_pid is not None else "no cron daemon runs"


def choose(facts: Facts, wanted: str) -> str:
    """The scheduler new schedules are installed for: wanted (CKPT_SCHEDULER), auto resolved with the facts."""
    if wanted == "systemd" and os.geteuid() != 0:
        raise UsageError("CKPT_SCHEDULER=systemd installs system units, which only root can",
                         hint="run as root, or set CKPT_SCHEDULER=cron (your crontab)")
    if wanted != "auto":
        return wanted
    return "systemd" if facts.systemd is not None and os.geteuid() == 0 else "cron"


def problem(scheduler: str, facts: Facts) -> tuple[str, str] | None:
    """(what, fix) when `scheduler` will not run schedules here; None when it will."""
    if facts.runs(scheduler):
        return None
    if scheduler == "systemd":
        return (f"{facts.why('systemd')}: ckpt's timers will not fire",
                "boot the machine with systemd, or set CKPT_SCHEDULER=cron"
                + (f" ({facts.why('cron')})" if facts.cron_pid is not None else " and start a cron daemon"))
    fix = "start a cron daemon (as root: 'cron', or the init system's cron service)"
    if facts.systemd is not None:
        return ("no cron daemon runs here: nothing runs schedules installed for cron",
                fix + "; or, as root, set CKPT_SCHEDULER=systemd (systemd runs here)")
    return (f"no cron daemon runs here and {facts.why('systemd')}: nothing runs schedules",
            fix + "; 'ckpt run --every' checkpoints a program it starts without either")


def warning(scheduler: str, facts: Facts) -> str | None:
    """problem() in one line; None when `scheduler` runs here."""
    found = problem(scheduler, facts)
    return None if found is None else f"{found[0]}; {found[1]}"
