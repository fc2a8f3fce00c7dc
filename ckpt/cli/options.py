"""Options shared by several commands, defined once so they read the same everywhere.

Each checks its value while the command line is parsed: a bad one is a one-line usage error
(exit 2) before the command does anything."""

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer
from typing import Annotated

from ckpt import settings
from ckpt.errors import InvalidReference
from ckpt.store import Store, ids

# No envvar= here: CKPT_STORE is read, with every other setting, by ckpt.settings.
# A str, not a Path: Path('') would turn an empty --store into the current directory.
StoreOption = Annotated[Optional[str], typer.Option(
    "--store", metavar="DIR|s3://BUCKET/PREFIX",
    help="Checkpoint store: a directory or an S3 bucket (created by `ckpt init`) [env var: CKPT_STORE; "
         "default: /var/lib/ckpt for root, $XDG_DATA_HOME/ckpt otherwise].")]
PasswordFileOption = Annotated[Optional[str], typer.Option(
    "--password-file", metavar="FILE",
    help="The encrypted store's password: the first line of FILE (mode 600) [env var: CKPT_PASSWORD_FILE; "
         "or CKPT_PASSWORD].")]
# --debug and --password-file are the root's options; ckpt.cli.main gives every command them too.
DebugOption = Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
# Every command that reports takes both: -q for scripts and cron, -v to see where the time goes.
QuietOption = Annotated[bool, typer.Option("--quiet", "-q",
                                           help="No progress messages on stderr (warnings and errors still).")]
VerboseOption = Annotated[bool, typer.Option(
    "--verbose", "-v", help="More detail on stderr: the store used, each step with the seconds since the "
                            "command began.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be done, change nothing.")]


def _count(value: int) -> int:
    if value < 0:
        raise typer.BadParameter(f"{value} is negative; give 0 or more")
    return value


def _name(value: Optional[str]) -> Optional[str]:
    if value is not None:
        try:
            ids.check_name(value)
        except InvalidReference as exc:  # no checkpoint can have it: a typo, not an empty result
            raise typer.BadParameter(str(exc)) from None
    return value


# --name of `list` and `forget`: which checkpoints to look at.
NameFilterOption = Annotated[Optional[str], typer.Option("--name", help="Only the checkpoints with this name.",
                                                         callback=_name)]


# The *_flag functions make the typer.Option of an `Annotated[int, ...]` / `Annotated[Optional[str], ...]`
# (written out where used, so that the type checker sees a type and not a call).
def count_flag(flag: str, help: str) -> Any:
    """A whole number of 0 or more (a count of checkpoints, restores...)."""
    return typer.Option(flag, help=help, callback=_count, metavar="N")


def duration_flag(flag: str, help: str) -> Any:
    """30s, 5m, 2h, 7d, 4w: checked by retention_policy(), before the command does anything."""
    return typer.Option(flag, help=help, metavar="DURATION")


# Retention, as `forget` and `schedule add` take it.
KeepLastOption = Annotated[int, count_flag("--keep-last", "Keep the N newest.")]
KeepWithinOption = Annotated[Optional[str], duration_flag("--keep-within", "Keep all newer than DURATION (30m, 2d).")]
KeepHourlyOption = Annotated[int, count_flag("--keep-hourly", "Keep the newest of N hours.")]
KeepDailyOption = Annotated[int, count_flag("--keep-daily", "Keep the newest of N days.")]
KeepWeeklyOption = Annotated[int, count_flag("--keep-weekly", "Keep the newest of N weeks.")]


def output_file_flag(help: str, created_parent: bool = False) -> Any:
    """A file to write into ('-' allowed), not a directory; its directory must exist unless the
    command creates it (created_parent)."""
    return typer.Option("--output", metavar="FILE", help=help, callback=_output_file(created_parent))


def _output_file(created_parent: bool):
    def check(value: Optional[str]) -> Optional[str]:
        if value is None or value == "-":
            return value
        if value.strip() == "":
            raise typer.BadParameter("'' names no file; give a file")
        path = Path(value).expanduser().absolute()
        if path.is_dir():
            raise typer.BadParameter(f"{value} is a directory; give a file, e.g. {path / 'output.log'}")
        if not created_parent and not path.parent.is_dir():
            raise typer.BadParameter(f"{path.parent} is not a directory; give a file in an existing directory")
        return value
    return check


def store_root(flag: Optional[str]) -> settings.StoreLocation:
    """The store: --store, else CKPT_STORE, else the default (ckpt.settings)."""
    return settings.store_from_flag(flag) if flag is not None else settings.current().store


def use_password_file(flag: Optional[str]) -> None:
    """--password-file wins over CKPT_PASSWORD_FILE and CKPT_PASSWORD."""
    if flag is not None:
        if not flag.strip():
            raise typer.BadParameter("'' names no file; give the file holding the password")
        settings.use(replace(settings.current(), password=None, password_file=Path(flag).expanduser().absolute()))


def open_store(path: Optional[str], create: bool = False, reporter: Any = None) -> Store:
    """The store of --store (or CKPT_STORE...); --verbose says which (reporter.detail)."""
    store = Store.open(store_root(path), create=create)
    if reporter is not None:
        reporter.detail(f"store {store.location}")
    return store


def retention_policy(keep_last: int, keep_within: Optional[str], keep_hourly: int, keep_daily: int,
                     keep_weekly: int):
    from ckpt.schedule.retention import Policy, parse_duration

    return Policy(keep_last=keep_last, keep_within=parse_duration(keep_within) if keep_within else None,
                  keep_hourly=keep_hourly, keep_daily=keep_daily, keep_weekly=keep_weekly)
