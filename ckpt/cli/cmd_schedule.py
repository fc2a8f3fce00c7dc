from typing import Annotated, Optional

import typer

from ckpt.cli.options import (JsonOption, KeepDailyOption, KeepHourlyOption, KeepLastOption, KeepWeeklyOption,
                              KeepWithinOption, PasswordFileOption, QuietOption, StoreOption, retention_policy,
                              invocation, store_root, use_password_file)
from ckpt.cli.output import CliReporter, emit_json, plain_table, said_all, shorten, stderr, stdout, styled
from ckpt.commands.schedule import AddRequest, add, listing, remove, run
from ckpt.errors import UsageError
from ckpt.schedule.book import Schedule, ScheduleBook
from ckpt.store import Store, opening

HELP = """Periodic snapshots with systemd timers or cron: add, list, rm, and run (what they run).

Examples:

  ckpt schedule add agent --match 'python3 agent\\.py' --every 5m --keep-last 12

  ckpt schedule list

  ckpt schedule rm agent
"""

ADD_HELP = """Install a systemd timer or a cron entry that checkpoints a target and applies retention.

The target is a PID, a pidfile, or a regular expression matched against command lines at each
run (so the schedule survives the program being restarted with a new PID; several matches are
refused). With --group the schedule has several targets, each resolved at every run, and takes
one group checkpoint of them all, named after the schedule ('ckpt restore NAME' restores the
newest whole); its retention keeps or forgets such groups whole (--pre-dump and --copy-to are
not taken). Where systemd runs, root's schedules are timers (units ckpt-NAME.service and .timer in
/etc/systemd/system); elsewhere root's are files /etc/cron.d/ckpt-NAME and other users' go to
their crontab (CKPT_SCHEDULER chooses). A warning says when neither runs here. An existing
schedule of the same name is replaced only with --replace.

Examples:

  ckpt schedule add agent --match 'python3 agent\\.py' --every 5m --keep-last 12

  ckpt schedule add web --pidfile /run/web.pid --cron '0 * * * *' --keep-daily 7 --keep-within 6h

  ckpt schedule add agent --match 'python3 agent\\.py' --every 15m --copy-to /mnt/backup/ckpt

  ckpt schedule add pair --group --pidfile /run/server.pid --match 'python3 client\\.py' --every 5m --keep-last 6
"""

schedule_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode=None)


def _book(store, opened: bool = True) -> ScheduleBook:
    # Opened as a store so that schedules get the same ownership checks (a schedule names the
    # command cron runs as its owner); `add` makes the store once the schedule is valid.
    location, run = store_root(store), invocation()
    if opened:
        local_dir = Store.open(location, settings=run.settings(), passwords=run.passwords()).root
    else:
        local_dir = opening.local_dir(location, run.settings().cache)
    return ScheduleBook(local_dir, run.settings(), location, run.passwords())


@schedule_app.command("add", help=ADD_HELP)
def add_command(
    name: Annotated[str, typer.Argument(help="Schedule name; also the name of its checkpoints.")],
    pid: Annotated[Optional[list[int]], typer.Option("--pid", help="Target PID.")] = None,
    pidfile: Annotated[Optional[list[str]], typer.Option("--pidfile", help="File holding the target PID.")] = None,
    match: Annotated[Optional[list[str]], typer.Option("--match", help="Regex matched against command lines.")] = None,
    group: Annotated[bool, typer.Option(
        "--group", help="One group checkpoint of several targets (named after the schedule): give --pid, "
                        "--pidfile or --match once per member.")] = False,
    every: Annotated[Optional[str], typer.Option("--every", help="Period: 1m, 5m, 1h, 1d...")] = None,
    cron_expr: Annotated[Optional[str], typer.Option("--cron", help="A cron expression as Debian's cron reads it: "
                                                     "'*/5 * * * *', '0 9 * * mon-fri', '@daily'.")] = None,
    keep_last: KeepLastOption = 0,
    keep_within: KeepWithinOption = None,
    keep_hourly: KeepHourlyOption = 0,
    keep_daily: KeepDailyOption = 0,
    keep_weekly: KeepWeeklyOption = 0,
    pre_dump: Annotated[Optional[str], typer.Option("--pre-dump", help="Shell command run before each dump.")] = None,
    copy_to: Annotated[Optional[str], typer.Option(
        "--copy-to", metavar="STORE",
        help="Copy each checkpoint to this store right after its dump; a copy that fails is tried "
             "again by the next run.")] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="Replace the schedule of that name; without it an existing name is refused.")] = False,
    password_file: PasswordFileOption = None,
    store: StoreOption = None,
    json_out: JsonOption = False,
) -> None:
    targets = [{kind: value} for kind, values in (("pid", pid), ("pidfile", pidfile), ("match", match))
               for value in values or []]
    if not group and len(targets) > 1:
        raise UsageError(f"{len(targets)} targets given: a schedule has one",
                         hint="pass --group to checkpoint them together as one group")
    target: dict = {"group": targets} if group else (targets[0] if targets else {})
    policy = retention_policy(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly)
    use_password_file(password_file)
    book = _book(store, opened=False)
    added = add(book, AddRequest(name, target, every, cron_expr, policy, pre_dump, copy_to, replace))
    schedule = added.schedule
    if added.warning:  # also under --json: a schedule that will not run must not pass unseen
        stderr.print(styled("Warning:", "yellow", f" schedule '{name}' will not run: {added.warning}"))
    if json_out:
        emit_json({"name": schedule.name, "cron": schedule.cron, "target": schedule.target,
                   "retention": schedule.retention, "copy_to": schedule.copy_to, "installed": added.where,
                   "scheduler": schedule.scheduler, "will_run": added.will_run, "log": str(book.log_path(name))})
        return
    keep = "keep everything" if schedule.policy.empty() else f"keep {schedule.policy.describe()}"
    stderr.print(f"schedule '{name}' installed for {schedule.scheduler} ({added.where}): {schedule.cron}, "
                 f"{schedule.describe_target()}, {keep}"
                 + (f", copied to {schedule.copy_to}" if schedule.copy_to else "") + f"; log: {book.log_path(name)}")


@schedule_app.command("list", help="Show each schedule: target, timing, next and last run, retention, and "
                                   "what runs it (systemd or cron), with a warning when nothing will.\n\n"
                                   "Examples:\n\n  ckpt schedule list\n\n  ckpt schedule list --json")
def list_command(store: StoreOption = None, json_out: JsonOption = False) -> None:
    rows = listing(_book(store))
    if said_all(rows, json_out, "no schedules: add one with 'ckpt schedule add'"):
        return
    table = plain_table("NAME", "TARGET", "WHEN", "RUN BY", "NEXT RUN", "LAST RUN", "RETENTION")
    shortened = False
    for r in rows:
        last = r["last"]
        # An error is one line of 40 characters here; --json and the schedule's log have it whole.
        said = last.get("id") or shorten(last.get("error") or "", 40) if last else ""
        shortened = shortened or (bool(last) and said != (last.get("id") or last.get("error") or ""))
        last_text = "never" if not last else f"{last['time']} {last['outcome']} {said}"
        next_run = r["next_run"] or "never: cron refuses it"  # made by an older ckpt
        run_by = r["scheduler"] if r["will_run"] or not r["next_run"] else f"{r['scheduler']}: will not run"
        target = Schedule(r["name"], r["target"], r["cron"]).describe_target()
        table.add_row(r["name"], target, r["every"] and f"every {r['every']}" or r["cron"], run_by,
                      next_run, last_text, ", ".join(f"{k}={v}" for k, v in (r["retention"] or {}).items()
                                                           if v) or "keep all")
    stdout.print(table)
    if shortened:
        stderr.print("errors shortened: 'ckpt schedule list --json' has them whole, as has each schedule's log")
    for problem in dict.fromkeys(r["problem"] for r in rows if r["problem"]):
        names = [f"'{r['name']}'" for r in rows if r["problem"] == problem]
        label = "schedule" if len(names) == 1 else "schedules"
        stderr.print(styled("Warning:", "yellow", f" {label} {', '.join(names)} will not run: {problem}"))


@schedule_app.command("rm", help="Remove a schedule's timer or cron entry and definition; its checkpoints stay.\n\n"
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


@schedule_app.command("run", help="Run a schedule once, as its timer or cron does: one dump, then its retention.\n\n"
                                  "Examples:\n\n  ckpt schedule run agent")
def run_command(name: Annotated[str, typer.Argument(help="Schedule name.")], store: StoreOption = None,
                json_out: JsonOption = False, quiet: QuietOption = False) -> None:
    reporter = CliReporter(quiet=quiet)
    try:
        outcome = run(_book(store), name, reporter)
    finally:
        reporter.close()
    if json_out:
        emit_json(outcome.to_json())
    else:
        print(outcome.id)


def register(app: typer.Typer) -> None:
    app.add_typer(schedule_app, name="schedule")
