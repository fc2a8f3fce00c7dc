"""Schedules: their definitions in the store and their entries for the scheduler that runs them.

A schedule lives in <store>/schedules/<name>.json (what to dump, when, what to keep, which
scheduler) with its last outcome in <name>.state.json. A systemd timer or cron runs `ckpt schedule
run NAME`: root's timers are units ckpt-<name>.service and ckpt-<name>.timer in
/etc/systemd/system; root's cron entries are files /etc/cron.d/ckpt-<name>; other users' are two
lines in their crontab (a marker comment, the entry).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.settings import Settings, StoreLocation, s3_location_environment
from ckpt.errors import CkptError, ProcessNotFound, UsageError
from ckpt.schedule import systemd
from ckpt.schedule.retention import Policy
from ckpt.store import Store
from ckpt.store.password import PasswordSource
from ckpt.system.files import atomic_write_bytes, make_private_dir

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")  # cron.d ignores file names with dots
CRON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TargetAmbiguous(CkptError):
    exit_code = UsageError.exit_code


@dataclass
class Schedule:
    name: str
    # exactly one of {"pid": int}, {"pidfile": path}, {"match": regex}; a group schedule's is
    # {"group": [target, ...]}: its members, each resolved at every run, checkpointed as one group
    target: dict
    cron: str
    every: str | None = None
    retention: dict = field(default_factory=dict)
    pre_dump: str | None = None
    created: str = ""
    copy_to: str | None = None  # a store each checkpoint is copied to after its dump
    scheduler: str = "cron"  # what runs it: "systemd" (a timer) or "cron"; older ckpts knew only cron

    @property
    def policy(self) -> Policy:
        return Policy.from_json(self.retention) if self.retention else Policy()

    @property
    def members(self) -> list[dict] | None:
        """A group schedule's member targets (None: a schedule of one target)."""
        group = self.target.get("group")
        return list(group) if isinstance(group, list) else None

    def describe_target(self) -> str:
        if self.members is not None:
            return "group of " + ", ".join(describe_one_target(member) for member in self.members)
        return describe_one_target(self.target)


def describe_one_target(target: dict) -> str:
    """'pid 42', 'pidfile /run/web.pid', 'match agent\\.py'."""
    kind, value = next(iter(target.items()))
    return f"{kind} {value}"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise UsageError(f"invalid schedule name '{name}'",
                         hint="use 1-64 letters, digits, '_' or '-', starting with a letter (no dots: cron "
                              "ignores such files)")
    return name


class ScheduleBook:
    """The schedules of one store, and their cron entries."""

    def __init__(self, local_dir: Path, settings: Settings, location: StoreLocation | None = None,
                 passwords: PasswordSource | None = None):
        # The store as commands name it (its directory or s3:// URL), and the local directory
        # that holds its schedules (for a remote store: its local side in the cache).
        self.store_root: StoreLocation = location if location is not None else local_dir
        self.settings = settings
        self.passwords = PasswordSource.passed_or_settings(passwords, settings)
        self.dir = local_dir / "schedules"
        self.log_dir = local_dir / "logs" / "schedules"
        self.cron_dir = settings.cron_dir
        self.systemd_dir = settings.systemd_dir

    def open_store(self, create: bool = False) -> Store:
        """The store these schedules are of, opened with the book's settings and passwords."""
        return Store.open(self.store_root, create, settings=self.settings, passwords=self.passwords)

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.json"

    def state_path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.state.json"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{check_name(name)}.log"

    def load(self, name: str) -> Schedule:
        try:
            data = json.loads(self.path(name).read_text())
            # Keys a newer ckpt added are ignored, as readers of manifests ignore them.
            return Schedule(**{k: v for k, v in data.items() if k in Schedule.__dataclass_fields__})
        except FileNotFoundError:
            raise ProcessNotFound(f"no schedule named '{name}'", hint="see 'ckpt schedule list'") from None

    def names(self) -> list[str]:
        if not self.dir.exists():
            return []
        return sorted(p.name[:-5] for p in self.dir.glob("*.json") if not p.name.endswith(".state.json"))

    def state(self, name: str) -> dict:
        try:
            return json.loads(self.state_path(name).read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def record(self, name: str, outcome: dict) -> None:
        make_private_dir(self.dir)
        atomic_write_bytes(self.state_path(name), json.dumps(outcome, indent=2).encode())

    # ---- cron entries ------------------------------------------------------------------------

    def cron_command(self, name: str) -> str:
        # Absolute paths only: cron's PATH is bare and its working directory is $HOME. Not
        # --quiet: the log is where a run says what it did, the checkpoints it forgot included.
        return (f"{sys.executable} -m ckpt schedule run {name} --store {self.store_root} "
                f">> {self.log_path(name)} 2>&1")

    def run_environment(self) -> dict[str, str]:
        """What a remote or encrypted store needs and the bare environment of cron and systemd
        lacks: where the cache, the password file and the S3 server are. Never a secret (cron
        files and units are world-readable): credentials belong in ~/.aws/credentials, the
        password in a file (schedule add refuses CKPT_PASSWORD alone for an encrypted store)."""
        environment = {"CKPT_CACHE": str(self.settings.cache)}
        if self.settings.password_file is not None:
            environment["CKPT_PASSWORD_FILE"] = str(self.settings.password_file)
        return environment | s3_location_environment()

    def cron_environment(self) -> str:
        """run_environment() as cron's lines VAR=value."""
        return "".join(f"{name}={value}\n" for name, value in self.run_environment().items())

    def cron_file(self, name: str) -> Path:
        return self.cron_dir / f"ckpt-{name}"

    def _header(self, schedule: Schedule) -> str:
        return (f"# ckpt schedule '{schedule.name}': {schedule.describe_target()}. Managed by ckpt;\n"
                f"# remove it with: ckpt schedule rm {schedule.name} --store {self.store_root}\n")

    def render_cron_file(self, schedule: Schedule) -> str:
        return (f"{self._header(schedule)}SHELL=/bin/sh\nPATH={CRON_PATH}\n{self.cron_environment()}"
                f"{schedule.cron} root {self.cron_command(schedule.name)}\n")

    def install_cron(self, schedule: Schedule) -> str:
        if os.geteuid() == 0:
            path = self.cron_file(schedule.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            # cron refuses group- or world-writable files, and ignores the temp file (a dot in its name)
            atomic_write_bytes(path, self.render_cron_file(schedule).encode(), mode=0o644)
            return str(path)
        lines = [line for line in self._user_crontab() if not self._is_ours(line, schedule.name)]
        lines += [f"# ckpt:{schedule.name}", f"{schedule.cron} PATH={CRON_PATH} {self.cron_command(schedule.name)}"]
        self._write_user_crontab(lines)
        return "user crontab"

    def remove_cron(self, name: str) -> None:
        if os.geteuid() == 0:
            self.cron_file(name).unlink(missing_ok=True)
            return
        lines = self._user_crontab()
        kept = [line for line in lines if not self._is_ours(line, name)]
        if kept != lines:
            self._write_user_crontab(kept)

    def cron_installed(self, name: str) -> bool | None:
        """Root: whether its cron file is in place; other users: None (their crontab is not read)."""
        return self.cron_file(name).exists() if os.geteuid() == 0 else None

    def _is_ours(self, line: str, name: str) -> bool:
        return line == f"# ckpt:{name}" or f"-m ckpt schedule run {name} --store {self.store_root} " in line

    # The user's crontab is edited line by line, touching only ckpt's own lines. python-crontab
    # was tried (3.4) and rewrites the lines of others: it crashes on 'fri-7', comments out
    # '5-2' and '0#2' as "DISABLED LINE", drops 'FOO = a b', and turns an escaped '\%' into
    # a bare '%' (a newline to cron): all lines Debian's crontab accepts.
    def _user_crontab(self) -> list[str]:
        proc = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout.splitlines()
        if "no crontab for" in proc.stderr:
            return []
        # Anything else must stop here: going on would replace the crontab with ckpt's lines only.
        raise CkptError(f"cannot read your crontab: {proc.stderr.strip() or f'crontab -l exited {proc.returncode}'}",
                        hint="check that 'crontab -l' works for this user")

    def _write_user_crontab(self, lines: list[str]) -> None:
        proc = subprocess.run(["crontab", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
        if proc.returncode != 0:
            raise CkptError(f"crontab refused the entry: {proc.stderr.strip()}")


    # ---- systemd timers ------------------------------------------------------------------------

    def unit_path(self, name: str, kind: str) -> Path:
        """ckpt-NAME.service or ckpt-NAME.timer in the systemd directory (kind: service, timer)."""
        return self.systemd_dir / f"ckpt-{check_name(name)}.{kind}"

    def _wants_link(self, name: str) -> Path:
        # What `systemctl enable` makes of [Install] WantedBy=timers.target.
        return self.systemd_dir / "timers.target.wants" / f"ckpt-{name}.timer"

    def render_units(self, schedule: Schedule) -> tuple[str, str]:
        """The texts of the schedule's .service and .timer."""
        name = schedule.name
        argv = [sys.executable, "-m", "ckpt", "schedule", "run", name, "--store", str(self.store_root)]
        service = systemd.render_service(
            f"ckpt schedule {name}: checkpoint {schedule.describe_target()}", self._header(schedule), argv,
            {"PATH": CRON_PATH, **self.run_environment()}, str(self.log_path(name)))
        timer = systemd.render_timer(f"ckpt schedule {name} ({schedule.cron})", self._header(schedule),
                                     schedule.cron, f"ckpt-{name}.service")
        return service, timer

    def install_timer(self, schedule: Schedule, systemd_runs: bool) -> str:
        """Writes the units; enables and starts the timer when systemd runs, else only links it
        into timers.target (as `systemctl enable` would) for when the machine boots with it."""
        name = schedule.name
        service, timer = self.render_units(schedule)
        self.systemd_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.unit_path(name, "service"), service.encode(), mode=0o644)
        atomic_write_bytes(self.unit_path(name, "timer"), timer.encode(), mode=0o644)
        if systemd_runs:
            systemctl("daemon-reload")
            systemctl("enable", "--now", f"ckpt-{name}.timer")
            # enable --now leaves a running timer with its old calendar: a replaced schedule's
            # timer must take its new one.
            systemctl("restart", f"ckpt-{name}.timer")
        else:
            link = self._wants_link(name)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(f"../ckpt-{name}.timer")
        return str(self.unit_path(name, "timer"))

    def remove_timer(self, name: str, systemd_runs: bool) -> None:
        timer = self.unit_path(name, "timer")
        if systemd_runs and timer.exists():
            systemctl("disable", "--now", f"ckpt-{name}.timer")
        existed = timer.exists() or self.unit_path(name, "service").exists()
        for path in (self._wants_link(name), timer, self.unit_path(name, "service")):
            path.unlink(missing_ok=True)
        if systemd_runs and existed:
            systemctl("daemon-reload")

    def timer_installed(self, name: str, systemd_runs: bool) -> bool:
        """Its units are in place and, where systemd runs, its timer is active."""
        if not (self.unit_path(name, "timer").exists() and self.unit_path(name, "service").exists()):
            return False
        if not systemd_runs:
            return self._wants_link(name).is_symlink()
        return systemctl("is-active", "--quiet", f"ckpt-{name}.timer", check=False) == 0

    # ---- either ---------------------------------------------------------------------------------

    def install(self, schedule: Schedule, systemd_runs: bool) -> str:
        """Installs the schedule for its scheduler, and removes any entry the other one had for
        that name (a replaced schedule never runs twice). Returns where it went."""
        if schedule.scheduler == "systemd":
            self.remove_cron(schedule.name)
            return self.install_timer(schedule, systemd_runs)
        self.remove_timer(schedule.name, systemd_runs)
        return self.install_cron(schedule)

    def uninstall(self, name: str, systemd_runs: bool) -> None:
        self.remove_timer(name, systemd_runs)
        self.remove_cron(name)


def systemctl(*args: str, check: bool = True) -> int:
    """Runs systemctl (bounded); a failure it was asked to check raises CkptError with its words."""
    try:
        proc = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not check:
            return -1
        raise CkptError(f"systemctl {' '.join(args)} failed: {exc}") from None
    if check and proc.returncode != 0:
        words = proc.stderr.strip().splitlines()
        raise CkptError(f"systemctl {' '.join(args)} failed: {words[-1] if words else f'exit {proc.returncode}'}")
    return proc.returncode
