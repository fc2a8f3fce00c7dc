"""Use cases of `ckpt schedule`: add, rm, list, and the run a systemd timer or cron performs (one
dump of the target plus the schedule's retention). The definitions, timers and cron entries:
ckpt/schedule/book.py; which scheduler, and whether it runs here: ckpt/schedule/schedulers.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

from ckpt import settings
from ckpt.commands.results import JsonResult
from ckpt.errors import CkptError, ProcessNotFound, SectionTimeout, StoreBusy, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.schedule import cron, schedulers
from ckpt.schedule.book import Schedule, ScheduleBook, TargetAmbiguous, check_name, describe_one_target
from ckpt.schedule.retention import Policy
from ckpt.store import opening
from ckpt.system import procs
from ckpt.system.files import atomic_write_bytes, make_private_dir
from ckpt.system.locks import wait_for_flock


@dataclass
class Added:
    schedule: Schedule
    where: str  # the timer unit, the cron file, or "user crontab"
    will_run: bool  # its scheduler runs here
    warning: str | None  # why it will not run, and what to do


@dataclass
class AddRequest:
    name: str
    # exactly one of {"pid": int}, {"pidfile": path}, {"match": regex}; a group schedule:
    # {"group": [one of those, ...]}, its members checkpointed together as one group
    target: dict
    every: str | None = None  # exactly one of every and cron
    cron: str | None = None
    policy: Policy = field(default_factory=Policy)
    pre_dump: str | None = None
    copy_to: str | None = None
    replace: bool = False  # an existing schedule of that name is replaced only when told


def add(book: ScheduleBook, request: AddRequest, facts: schedulers.Facts | None = None) -> Added:
    """Checks, records and installs a schedule, for the scheduler CKPT_SCHEDULER chooses (facts:
    what runs here, looked at when not given)."""
    name, target, every, cron_expr = request.name, request.target, request.every, request.cron
    policy, pre_dump, copy_to, replace = request.policy, request.pre_dump, request.copy_to, request.replace
    check_name(name)
    if book.path(name).exists() and not replace:
        raise UsageError(f"a schedule named '{name}' exists already",
                         hint="pass --replace to replace it, or see 'ckpt schedule list'")
    target = _checked_group(target, pre_dump, copy_to) if "group" in target else _checked_target(target)
    expr = _cron_expression(every, cron_expr)
    if copy_to is not None:
        copy_to = destination_spec(copy_to, book.store_root)
    facts = facts or schedulers.Facts.here()
    scheduler = schedulers.choose(facts, book.settings.scheduler)
    schedule = Schedule(name=name, target=target, cron=expr, every=every, retention=policy.to_json()
                        if not policy.empty() else {}, pre_dump=pre_dump,
                        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), copy_to=copy_to,
                        scheduler=scheduler)
    store = book.open_store(create=True)  # made (and checked) only now that the schedule is valid
    if opening.find_encryption(store.backend) is not None and book.settings.password_file is None:
        # Scheduled runs have no terminal; cron files and units are world-readable: only a file works.
        raise UsageError(f"the store at {store.location} is encrypted, and scheduled runs need its password in a file",
                         hint="pass --password-file FILE (mode 600) or set CKPT_PASSWORD_FILE")
    make_private_dir(book.dir)
    make_private_dir(book.log_dir)
    definition = asdict(schedule)
    if definition["copy_to"] is None:
        del definition["copy_to"]  # a schedule without it stays readable by an older ckpt
    atomic_write_bytes(book.path(name), json.dumps(definition, indent=2).encode())
    where = book.install(schedule, facts.runs("systemd"))
    warning = schedulers.warning(scheduler, facts)
    return Added(schedule, where, warning is None, warning)


def _checked_target(target: dict) -> dict:
    """The schedule's target (one of pid, pidfile, match), checked; a pidfile made absolute."""
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
    return target


def _checked_group(target: dict, pre_dump: str | None, copy_to: str | None) -> dict:
    """A group schedule's members, each checked as a target of its own, none named twice; the
    options a group checkpoint does not take refused (as `ckpt dump --group` refuses them)."""
    members = target["group"]
    if len(target) != 1 or not isinstance(members, list) or not members:
        raise UsageError("a group schedule needs its members: --pid, --pidfile or --match, once per member")
    if pre_dump is not None:
        raise UsageError("--pre-dump is not taken by a group schedule", hint="a group checkpoint runs no hook")
    if copy_to is not None:
        raise UsageError("--copy-to is not taken by a group schedule",
                         hint="copy its group checkpoints with 'ckpt copy GROUP'")
    checked: list[dict] = []
    for member in members:
        one = _checked_target(member)
        if one in checked:
            raise UsageError(f"member {describe_one_target(one)} is named twice")
        checked.append(one)
    return {"group": checked}


def _cron_expression(every: str | None, cron_expr: str | None) -> str:
    """The cron expression of --every DURATION or --cron EXPR (exactly one of them), checked."""
    if bool(every) == bool(cron_expr):
        raise UsageError("give exactly one of --every DURATION and --cron 'EXPR'")
    if every:
        from ckpt.schedule.retention import parse_duration

        return cron.every_to_cron(parse_duration(every))
    return cron.check(cron_expr or "")  # given: exactly one of the two is (checked above)


def destination_spec(copy_to: str, store_root: settings.StoreLocation) -> str:
    """--copy-to as it is recorded: a URL as given, a directory as an absolute path (cron runs
    in $HOME); never the store itself."""
    path = settings.store_from_flag(copy_to)
    if isinstance(path, str) or isinstance(store_root, str):
        if str(path) == str(store_root):
            raise UsageError(f"--copy-to {copy_to} is the store itself", hint="give another store")
        return str(path)
    if os.path.realpath(path) == os.path.realpath(store_root):
        raise UsageError(f"--copy-to {copy_to} is the store itself", hint="give another store")
    return str(path)


def remove(book: ScheduleBook, name: str, facts: schedulers.Facts | None = None) -> Schedule:
    """Removes the timer or cron entry and the definition; checkpoints already taken stay.
    Returns the definition removed."""
    schedule = book.load(name)
    book.uninstall(name, (facts or schedulers.Facts.here()).runs("systemd"))
    book.path(name).unlink(missing_ok=True)
    book.state_path(name).unlink(missing_ok=True)
    return schedule


def _next_run(expr: str, now: datetime) -> str | None:
    try:
        return cron.next_run(cron.check(expr), now).isoformat(timespec="minutes")
    except UsageError:
        return None  # a schedule made by an older ckpt that cron refuses (e.g. '5/10'): it never runs


def listing(book: ScheduleBook, now: datetime | None = None, facts: schedulers.Facts | None = None) -> list[dict]:
    """Each schedule with its next and last run, the scheduler that runs it, and whether it
    will run: installed, for a scheduler that runs here (the reason when not)."""
    now = now or cron.cron_now()
    names = book.names()
    if not names:
        return []  # nothing to look at /proc and systemd for
    facts = facts or schedulers.Facts.here()
    rows = []
    for name in names:
        schedule = book.load(name)
        runs = facts.runs("systemd")
        installed = book.timer_installed(name, runs) if schedule.scheduler == "systemd" \
            else book.cron_installed(name)
        problem = schedulers.warning(schedule.scheduler, facts)
        if installed is False:
            problem = f"its {'timer' if schedule.scheduler == 'systemd' else 'cron entry'} is not installed" \
                + (f" ({problem})" if problem else f": 'ckpt schedule add {name} --replace ...' installs it again")
        next_run = _next_run(schedule.cron, now)
        rows.append({
            "name": name, "target": schedule.target, "cron": schedule.cron, "every": schedule.every,
            "next_run": next_run,
            "last": book.state(name) or None, "retention": schedule.retention or None,
            "pre_dump": schedule.pre_dump, "copy_to": schedule.copy_to,
            "installed": installed, "scheduler": schedule.scheduler,
            "will_run": problem is None and next_run is not None, "problem": problem,
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


def _copy_pending(book: ScheduleBook, origin: str, outcome: dict, reporter: Reporter) -> None:
    from ckpt.commands.copy import finish_pending
    from ckpt.store import opening, pending

    if not pending.records(opening.local_dir(book.store_root, book.settings.cache), origin):
        return
    try:
        copies = finish_pending(book.open_store(), origin, reporter, book.passwords)
    except CkptError as exc:  # the source store itself
        outcome["copy_error"] = str(exc)
        return
    outcome["copies"] = copies
    failed = [c for c in copies if c["status"] == "failed"]
    if failed:
        outcome["copy_error"] = failed[0]["error"]
        reporter.warn(f"copy to {failed[0]['to']} failed (the next run tries again): {failed[0]['error']}")


@dataclass(frozen=True)
class ScheduleRunResult(JsonResult):
    """A run that made its checkpoint, as the schedule's log records it."""

    time: str
    outcome: str
    id: str  # the checkpoint taken; a group schedule's: the group checkpoint
    bytes_stored: int
    freeze_ms: float | None  # a group's: its longest member freeze
    duration_ms: int
    pid: int | None = None  # the PID the target meant (None: a group schedule, see members)
    group: str | None = None  # a group schedule's: the group checkpoint taken (as id)
    members: list[dict] | None = None  # a group schedule's: each member's pid and checkpoint
    copies: list[dict] | None = None  # the pending copies this run finished or tried (None: there were none)
    copy_error: str | None = None
    forgot: list[str] | None = None  # what the retention forgot (None: the schedule has none)

    def to_json(self) -> dict:
        record = {"time": self.time, "outcome": self.outcome, "pid": self.pid, "id": self.id,
                  "bytes_stored": self.bytes_stored, "freeze_ms": self.freeze_ms}
        if self.pid is None:
            del record["pid"]
        for key in ("group", "members", "copies", "copy_error", "forgot"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        return {**record, "duration_ms": self.duration_ms}


def run(book: ScheduleBook, name: str, reporter: Reporter = NullReporter(),
        wait_s: float | None = None) -> ScheduleRunResult:
    """What cron runs: one dump of the target plus the schedule's retention. Records the outcome."""
    schedule = book.load(name)
    wait_s = book.settings.schedule_wait if wait_s is None else wait_s
    started = datetime.now(timezone.utc)
    outcome: dict = {"time": started.isoformat(timespec="seconds"), "outcome": None}
    make_private_dir(book.dir)
    lock_fd = os.open(book.dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)

    def skipped() -> StoreBusy:
        outcome.update(outcome="skipped", error=f"the previous run was still going after {wait_s:.0f} s")
        book.record(name, outcome)
        return StoreBusy(f"schedule '{name}': skipped, the previous run is still going")

    try:
        wait_for_flock(lock_fd, fcntl.LOCK_EX, time.monotonic() + wait_s, skipped)
        _run_recorded(book, schedule, outcome, started, reporter)
    finally:
        os.close(lock_fd)
    return ScheduleRunResult(**outcome)


def _run_recorded(book: ScheduleBook, schedule: Schedule, outcome: dict, started: datetime,
                  reporter: Reporter) -> None:
    """The run under the schedule's lock: its outcome, whatever it is, recorded in the book."""
    name = schedule.name
    origin = f"schedule {name}"
    copied = False
    try:
        if schedule.members is None:
            _dump(book, schedule, outcome, reporter)
        else:
            _group_dump(book, schedule, outcome, reporter)
        # Copied before retention runs, which could forget an older checkpoint still to copy.
        copied = True
        _copy_pending(book, origin, outcome, reporter)
        if schedule.retention:
            _forget(book, schedule, outcome, reporter)
    except ProcessNotFound as exc:
        outcome.update(outcome="target-gone", error=str(exc))
        raise
    except SectionTimeout as exc:
        # The program asked not to be frozen now: not a failure, a skipped run.
        outcome.update(outcome="skipped", error=exc.message)
        raise
    except CkptError as exc:
        outcome.update(outcome="failed", error=str(exc))
        raise
    finally:
        # The copies earlier runs could not make, even when this dump failed: a failed copy
        # leaves its record for the next run and never fails the dump.
        if not copied:
            _copy_pending(book, origin, outcome, reporter)
        outcome["duration_ms"] = round((datetime.now(timezone.utc) - started).total_seconds() * 1000)
        book.record(name, outcome)


def _dump(book: ScheduleBook, schedule: Schedule, outcome: dict, reporter: Reporter) -> None:
    from ckpt.commands.dump import DumpRequest, dump
    from ckpt.store import Origin

    pid = resolve_target(schedule.target)
    outcome["pid"] = pid
    result = dump(book.store_root, DumpRequest(pid=pid, name=schedule.name, pre_dump_hook=schedule.pre_dump,
                                               copy_to=schedule.copy_to, copy_origin=f"schedule {schedule.name}",
                                               origin=Origin("schedule", schedule.name)), reporter,
                  settings=book.settings, passwords=book.passwords)
    outcome.update(outcome="ok", id=result.manifest.id, bytes_stored=result.manifest.bytes_stored,
                   freeze_ms=result.manifest.stats.get("freeze_ms"))


def _group_dump(book: ScheduleBook, schedule: Schedule, outcome: dict, reporter: Reporter) -> None:
    """One group checkpoint of the schedule's members, each target resolved now; the group is
    named after the schedule and made by it (its origin), as its retention judges it."""
    from ckpt.commands.group import GroupDumpRequest, group_dump
    from ckpt.store import Origin

    pids = [resolve_target(member) for member in schedule.members or []]
    request = GroupDumpRequest(members=[str(pid) for pid in pids], name=schedule.name,
                               origin=Origin("schedule", schedule.name))
    result = group_dump(book.store_root, request, reporter, settings=book.settings, passwords=book.passwords)
    group = result.group
    freezes = [m.freeze_ms for m in group.members if m.freeze_ms is not None]
    outcome.update(outcome="ok", id=group.id, group=group.id,
                   members=[{"pid": m.pid, "checkpoint": m.checkpoint} for m in group.members],
                   bytes_stored=sum(int(r.get("bytes_stored") or 0) for r in result.members),
                   freeze_ms=max(freezes) if freezes else None)


def _forget(book: ScheduleBook, schedule: Schedule, outcome: dict, reporter: Reporter) -> None:
    """The schedule's retention. Only what this schedule made: a checkpoint of the same name
    dumped by hand, by `ckpt run` or before origins were recorded is not the schedule's to forget.
    A group schedule's group checkpoints go through the same call: forget judges each group as
    one item by its name, time and origin, and keeps or removes it whole."""
    from ckpt.commands.forget import forget
    from ckpt.store import Origin

    forgotten = forget(book.open_store(), schedule.policy, name=schedule.name, prune=True,
                       allow_remove_all=False, origin=Origin("schedule", schedule.name), reporter=reporter)
    outcome["forgot"] = [d.id for d in forgotten.removed]
