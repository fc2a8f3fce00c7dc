"""Scheduled snapshots: definitions in the store, real cron entries, and the run cron performs.

A schedule lives in <store>/schedules/<name>.json (what to dump, when, what to keep) with its
last outcome in <name>.state.json. Cron runs `ckpt schedule run NAME`: root's entries are files
/etc/cron.d/ckpt-<name>; other users' are two lines in their crontab (a marker comment, the entry).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

from ckpt import settings
from ckpt.errors import CkptError, ProcessNotFound, StoreBusy, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.schedule import cron
from ckpt.schedule.retention import Policy
from ckpt.store.fsutil import atomic_write_bytes, make_private_dir
from ckpt.system import procs

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")  # cron.d ignores file names with dots
CRON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TargetAmbiguous(CkptError):
    exit_code = 2


@dataclass
class Schedule:
    name: str
    target: dict  # exactly one of {"pid": int}, {"pidfile": path}, {"match": regex}
    cron: str
    every: str | None = None
    retention: dict = field(default_factory=dict)
    pre_dump: str | None = None
    created: str = ""

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

    def __init__(self, store_root: Path, cron_dir: Path | None = None):
        self.store_root = store_root
        self.dir = store_root / "schedules"
        self.log_dir = store_root / "logs" / "schedules"
        self.cron_dir = cron_dir or settings.current().cron_dir

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.json"

    def state_path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.state.json"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{check_name(name)}.log"

    def load(self, name: str) -> Schedule:
        try:
            return Schedule(**json.loads(self.path(name).read_text()))
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
        # Absolute paths only: cron's PATH is bare and its working directory is $HOME.
        return (f"{sys.executable} -m ckpt schedule run {name} --store {self.store_root} --quiet "
                f">> {self.log_path(name)} 2>&1")

    def cron_file(self, name: str) -> Path:
        return self.cron_dir / f"ckpt-{name}"

    def render_cron_file(self, schedule: Schedule) -> str:
        return (f"# ckpt schedule '{schedule.name}': {schedule.describe_target()}. Managed by ckpt;\n"
                f"# remove it with: ckpt schedule rm {schedule.name} --store {self.store_root}\n"
                f"SHELL=/bin/sh\nPATH={CRON_PATH}\n"
                f"{schedule.cron} root {self.cron_command(schedule.name)}\n")

    def install_cron(self, schedule: Schedule) -> str:
        if os.geteuid() == 0:
            path = self.cron_file(schedule.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")  # cron ignores names with dots
            tmp.write_text(self.render_cron_file(schedule))
            os.chmod(tmp, 0o644)  # cron refuses group- or world-writable files
            os.rename(tmp, path)
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


def add(book: ScheduleBook, name: str, target: dict, every: str | None, cron_expr: str | None,
        policy: Policy, pre_dump: str | None = None) -> tuple[Schedule, str]:
    check_name(name)
    if len(target) != 1:
        raise UsageError("give exactly one target: --pid, --pidfile or --match")
    if "pid" in target:
        procs.check_pid(target["pid"])
        if target["pid"] == 1:
            raise UsageError("PID 1 (init) cannot be checkpointed", hint="give the PID of the process tree to save")
    if "pidfile" in target:
        # Cron runs ckpt from $HOME: a relative path would name another file there.
        target = {"pidfile": str(Path(target["pidfile"]).expanduser().absolute())}
    if "match" in target:
        try:
            re.compile(target["match"])
        except re.error as exc:
            raise UsageError(f"invalid --match regular expression: {exc}") from None
    if bool(every) == bool(cron_expr):
        raise UsageError("give exactly one of --every DURATION and --cron 'EXPR'")
    if every:
        from ckpt.schedule.retention import parse_duration

        expr = cron.every_to_cron(parse_duration(every))
    else:
        expr = cron.check(cron_expr)
    schedule = Schedule(name=name, target=target, cron=expr, every=every, retention=policy.to_json()
                        if not policy.empty() else {}, pre_dump=pre_dump,
                        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    from ckpt.store import Store

    Store.open(book.store_root, create=True)  # made (and checked) only now that the schedule is valid
    make_private_dir(book.dir)
    make_private_dir(book.log_dir)
    atomic_write_bytes(book.path(name), json.dumps(asdict(schedule), indent=2).encode())
    where = book.install_cron(schedule)
    return schedule, where


def remove(book: ScheduleBook, name: str) -> Schedule:
    """Removes the cron entry and the definition; checkpoints already taken stay. Returns the
    definition removed."""
    schedule = book.load(name)
    book.remove_cron(name)
    book.path(name).unlink(missing_ok=True)
    book.state_path(name).unlink(missing_ok=True)
    return schedule


def _next_run(expr: str, now: datetime) -> str | None:
    try:
        return cron.next_run(cron.check(expr), now).isoformat(timespec="minutes")
    except UsageError:
        return None  # a schedule made by an older ckpt that cron refuses (e.g. '5/10'): it never runs


def listing(book: ScheduleBook, now: datetime | None = None) -> list[dict]:
    now = now or cron.cron_now()
    rows = []
    for name in book.names():
        schedule = book.load(name)
        rows.append({
            "name": name, "target": schedule.target, "cron": schedule.cron, "every": schedule.every,
            "next_run": _next_run(schedule.cron, now),
            "last": book.state(name) or None, "retention": schedule.retention or None,
            "pre_dump": schedule.pre_dump,
            "installed": book.cron_file(name).exists() if os.geteuid() == 0 else None,
        })
    return rows


def resolve_target(target: dict) -> int:
    """The PID a schedule's target means right now."""
    if "pid" in target:
        pid = int(target["pid"])
        if procs.process_state(pid) in (None, "Z"):
            raise ProcessNotFound(f"target PID {pid} is gone")
        return pid
    if "pidfile" in target:
        try:
            pid = int(Path(target["pidfile"]).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            raise ProcessNotFound(f"cannot read a PID from {target['pidfile']}") from None
        if procs.process_state(pid) in (None, "Z"):
            raise ProcessNotFound(f"PID {pid} from {target['pidfile']} is gone")
        return pid
    pattern = re.compile(target["match"])
    me = os.getpid()
    mine = {me} | {p.pid for p in psutil.Process(me).parents()}
    matches = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["pid"] in mine or proc.info["status"] == psutil.STATUS_ZOMBIE or not proc.info["cmdline"]:
            continue
        if pattern.search(" ".join(proc.info["cmdline"])):
            matches.append(proc.info["pid"])
    if not matches:
        raise ProcessNotFound(f"no process matches '{target['match']}'")
    if len(matches) > 1:
        raise TargetAmbiguous(f"{len(matches)} processes match '{target['match']}' (PIDs "
                              f"{', '.join(map(str, matches[:10]))}); refusing to guess",
                              hint="make --match more specific, or use --pidfile")
    return matches[0]


def run(book: ScheduleBook, name: str, reporter: Reporter = NullReporter(), wait_s: float | None = None) -> dict:
    """What cron runs: one dump of the target plus the schedule's retention. Records the outcome."""
    from ckpt.commands.dump import DumpRequest, dump
    from ckpt.commands.forget import forget
    from ckpt.store import Store

    schedule = book.load(name)
    wait_s = settings.current().schedule_wait if wait_s is None else wait_s
    started = datetime.now(timezone.utc)
    outcome = {"time": started.isoformat(timespec="seconds"), "outcome": None}
    make_private_dir(book.dir)
    lock_fd = os.open(book.dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    outcome.update(outcome="skipped", error=f"the previous run was still going after {wait_s:.0f} s")
                    book.record(name, outcome)
                    raise StoreBusy(f"schedule '{name}': skipped, the previous run is still going")
                time.sleep(0.2)
        try:
            pid = resolve_target(schedule.target)
            outcome["pid"] = pid
            result = dump(book.store_root, DumpRequest(pid=pid, name=name, pre_dump_hook=schedule.pre_dump), reporter)
            outcome.update(outcome="ok", id=result.manifest.id, bytes_stored=result.manifest.bytes_stored,
                           freeze_ms=result.manifest.stats.get("freeze_ms"))
            if schedule.retention:
                forgotten = forget(Store.open(book.store_root), schedule.policy, name=name, prune=True,
                                   allow_remove_all=False)
                outcome["forgot"] = [r["id"] for r in forgotten["remove"]]
        except ProcessNotFound as exc:
            outcome.update(outcome="target-gone", error=str(exc))
            raise
        except CkptError as exc:
            outcome.update(outcome="failed", error=str(exc))
            raise
        finally:
            outcome["duration_ms"] = round((datetime.now(timezone.utc) - started).total_seconds() * 1000)
            book.record(name, outcome)
    finally:
        os.close(lock_fd)
    return outcome
