"""Schedules: their definitions in the store and their cron entries.

A schedule lives in <store>/schedules/<name>.json (what to dump, when, what to keep) with its
last outcome in <name>.state.json. Cron runs `ckpt schedule run NAME`: root's entries are files
/etc/cron.d/ckpt-<name>; other users' are two lines in their crontab (a marker comment, the entry).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ckpt import settings
from ckpt.errors import CkptError, ProcessNotFound, UsageError
from ckpt.schedule.retention import Policy
from ckpt.system.files import atomic_write_bytes, make_private_dir

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")  # cron.d ignores file names with dots
CRON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TargetAmbiguous(CkptError):
    exit_code = UsageError.exit_code


@dataclass
class Schedule:
    name: str
    target: dict  # exactly one of {"pid": int}, {"pidfile": path}, {"match": regex}
    cron: str
    every: str | None = None
    retention: dict = field(default_factory=dict)
    pre_dump: str | None = None
    created: str = ""
    copy_to: str | None = None  # a store each checkpoint is copied to after its dump

    @property
    def policy(self) -> Policy:
        return Policy.from_json(self.retention) if self.retention else Policy()

    def describe_target(self) -> str:
        kind, value = next(iter(self.target.items()))
        return f"{kind} {value}"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise UsageError(f"invalid schedule name '{name}'",
                         hint="use 1-64 letters, digits, '_' or '-', starting with a letter (no dots: cron "
                              "ignores such files)")
    return name


class ScheduleBook:
    """The schedules of one store, and their cron entries."""

    def __init__(self, local_dir: Path, cron_dir: Path | None = None, location: settings.StoreLocation | None = None):
        # The store as commands name it (its directory or s3:// URL), and the local directory
        # that holds its schedules (for a remote store: its local side in the cache).
        self.store_root: settings.StoreLocation = location if location is not None else local_dir
        self.dir = local_dir / "schedules"
        self.log_dir = local_dir / "logs" / "schedules"
        self.cron_dir = cron_dir or settings.current().cron_dir

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

    @staticmethod
    def cron_environment() -> str:
        """Lines VAR=value for cron of what a remote or encrypted store needs and cron's bare
        environment lacks: where the cache, the password file and the S3 server are. Never a
        secret (cron files are world-readable): credentials belong in ~/.aws/credentials, the
        password in a file (schedule add refuses CKPT_PASSWORD alone for an encrypted store)."""
        current = settings.current()
        lines = [f"CKPT_CACHE={current.cache}"]
        if current.password_file is not None:
            lines.append(f"CKPT_PASSWORD_FILE={current.password_file}")
        lines += [f"{name}={value}" for name, value in settings.s3_location_environment().items()]
        return "".join(line + "\n" for line in lines)

    def cron_file(self, name: str) -> Path:
        return self.cron_dir / f"ckpt-{name}"

    def render_cron_file(self, schedule: Schedule) -> str:
        return (f"# ckpt schedule '{schedule.name}': {schedule.describe_target()}. Managed by ckpt;\n"
                f"# remove it with: ckpt schedule rm {schedule.name} --store {self.store_root}\n"
                f"SHELL=/bin/sh\nPATH={CRON_PATH}\n{self.cron_environment()}"
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
