from typing import Annotated, Optional

from pathlib import Path

import typer
from rich.table import Table

from ckpt.cli.options import (JsonOption, KeepDailyOption, KeepHourlyOption, KeepLastOption, KeepWeeklyOption,
                              KeepWithinOption, PasswordFileOption, QuietOption, StoreOption, retention_policy,
                              store_root, use_password_file)
from ckpt.cli.output import CliReporter, emit_json, stderr, stdout
from ckpt.commands.schedule import add, listing, remove, run
from ckpt.schedule.book import ScheduleBook
from ckpt import settings
from ckpt.store import Store

HELP = """Periodic snapshots with cron: add, list, rm, and run (what cron runs).

Examples:

  ckpt schedule add agent --match 'python3 agent\\.py' --every 5m --keep-last 12

  ckpt schedule list

  ckpt schedule rm agent
"""

ADD_HELP = """Install a cron entry that checkpoints a target and applies retention.

The target is a PID, a pidfile, or a regular expression matched against command lines at each
run (so the schedule survives the program being restarted with a new PID; several matches are
refused). Root's entries are files /etc/cron.d/ckpt-NAME; other users' go to their crontab.

Examples:

  ckpt schedule add agent --match 'python3 agent\\.py' --every 5m --keep-last 12

  ckpt schedule add web --pidfile /run/web.pid --cron '0 * * * *' --keep-daily 7 --keep-within 6h
"""

schedule_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode=None)


def _book(store, opened: bool = True) -> ScheduleBook:
    # Opened as a store so that schedules get the same ownership checks (a schedule names the
    # command cron runs as its owner); `add` makes the store once the schedule is valid.
    location = store_root(store)
    if opened:
        return ScheduleBook(Store.open(location).root, location=location)
    local_dir = Store.local_side(str(location)) if settings.is_remote(location) else Path(location)
    return ScheduleBook(local_dir, location=location)


@schedule_app.command("add", help=ADD_HELP)
def add_command(
    name: Annotated[str, typer.Argument(help="Schedule name; also the name of its checkpoints.")],
    pid: Annotated[Optional[int], typer.Option("--pid", help="Target PID.")] = None,
    pidfile: Annotated[Optional[str], typer.Option("--pidfile", help="File holding the target PID.")] = None,
    match: Annotated[Optional[str], typer.Option("--match", help="Regex matched against command lines.")] = None,
    every: Annotated[Optional[str], typer.Option("--every", help="Period: 1m, 5m, 1h, 1d...")] = None,
    cron_expr: Annotated[Optional[str], typer.Option("--cron", help="A cron expression as Debian's cron reads it: "
                                                     "'*/5 * * * *', '0 9 * * mon-fri', '@daily'.")] = None,
    keep_last: KeepLastOption = 0,
    keep_within: KeepWithinOption = None,
    keep_hourly: KeepHourlyOption = 0,
    keep_daily: KeepDailyOption = 0,
    keep_weekly: KeepWeeklyOption = 0,
    pre_dump: Annotated[Optional[str], typer.Option("--pre-dump", help="Shell command run before each dump.")] = None,
    password_file: PasswordFileOption = None,
    store: StoreOption = None,
    json_out: JsonOption = False,
) -> None:
    target = {k: v for k, v in (("pid", pid), ("pidfile", pidfile), ("match", match)) if v is not None}
    policy = retention_policy(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly)
    use_password_file(password_file)
    book = _book(store, opened=False)
    schedule, where = add(book, name, target, every, cron_expr, policy, pre_dump)
    if json_out:
        emit_json({"name": schedule.name, "cron": schedule.cron, "target": schedule.target,
                   "retention": schedule.retention, "installed": where, "log": str(book.log_path(name))})
        return
    stderr.print(f"schedule '{name}' installed ({where}): {schedule.cron}, {schedule.describe_target()}, "
                 f"keep {schedule.policy.describe()}; log: {book.log_path(name)}")


@schedule_app.command("list", help="Show each schedule: target, timing, next and last run, retention.\n\n"
                                   "Examples:\n\n  ckpt schedule list\n\n  ckpt schedule list --json")
def list_command(store: StoreOption = None, json_out: JsonOption = False) -> None:
    rows = listing(_book(store))
    if json_out:
        emit_json(rows)
        return
    if not rows:
        stderr.print("no schedules: add one with 'ckpt schedule add'")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "TARGET", "WHEN", "NEXT RUN", "LAST RUN", "RETENTION"):
        table.add_column(column)
    for r in rows:
        last = r["last"]
        last_text = "never" if not last else f"{last['time']} {last['outcome']} " + (
            last.get("id") or last.get("error") or "")
        kind, value = next(iter(r["target"].items()))
        next_run = r["next_run"] or "never: cron refuses it"  # made by an older ckpt
        table.add_row(r["name"], f"{kind} {value}", r["every"] and f"every {r['every']}" or r["cron"],
                      next_run, last_text, ", ".join(f"{k}={v}" for k, v in (r["retention"] or {}).items()
                                                           if v) or "keep all")
    stdout.print(table)


@schedule_app.command("rm", help="Remove a schedule's cron entry and definition; its checkpoints stay.\n\n"
                                 "Examples:\n\n  ckpt schedule rm agent\n\n  ckpt schedule rm agent --json")
def rm_command(name: Annotated[str, typer.Argument(help="Schedule name.")], store: StoreOption = None,
               json_out: JsonOption = False, quiet: QuietOption = False) -> None:
    schedule = remove(_book(store), name)
    if json_out:
        emit_json({"name": schedule.name, "cron": schedule.cron, "every": schedule.every, "target": schedule.target,
                   "retention": schedule.retention or None, "pre_dump": schedule.pre_dump})
        return
    if not quiet:
        stderr.print(f"schedule '{name}' removed (its checkpoints are kept)")


@schedule_app.command("run", help="Run a schedule once, as cron does: one dump, then its retention.\n\n"
                                  "Examples:\n\n  ckpt schedule run agent")
def run_command(name: Annotated[str, typer.Argument(help="Schedule name.")], store: StoreOption = None,
                json_out: JsonOption = False, quiet: QuietOption = False) -> None:
    reporter = CliReporter(quiet=quiet)
    try:
        outcome = run(_book(store), name, reporter)
    finally:
        reporter.close()
    if json_out:
        emit_json(outcome)
    else:
        print(outcome["id"])


def register(app: typer.Typer) -> None:
    app.add_typer(schedule_app, name="schedule")
