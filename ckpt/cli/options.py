"""Options shared by several commands, defined once so they read the same everywhere.

Each checks its value while the command line is parsed: a bad one is a one-line usage error
(exit 2) before the command does anything."""

import functools
import inspect
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typing import Annotated

from ckpt import settings
from ckpt.errors import InvalidReference
from ckpt.store import Store, ids
from ckpt.store.password import PasswordSource

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
# A group checkpoint's and a group restore's bounds (ckpt dump --group, ckpt restore GROUP).
HoldLimitOption = Annotated[float, typer.Option(
    "--hold-limit", metavar="SECONDS", min=0.1, max=86400.0,
    help="Groups: how long a member waits, frozen (dump) or not yet running (restore), for the others "
         "before it gives up and the group is aborted.")]
PhaseTimeoutOption = Annotated[float, typer.Option(
    "--timeout", metavar="SECONDS", min=0.1, max=86400.0,
    help="Groups: how long every member has for each phase (prepare, freeze and dump or restore, "
         "commit) before the group is aborted.")]

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


class Invocation:
    """One run of the CLI: what its global flags said, and the settings and password source it
    passes down to every use case (httpie's Environment). The settings are built once, from the
    environment and those flags, when the command first asks for them: after every flag is
    parsed, and never changed after."""

    def __init__(self, environment: settings.Settings, ask: Callable[[str, bool], str] | None):
        self.environment = environment  # built by the root callback: a bad CKPT_* value stops every command
        # The terminal's password prompt (None: stdin is no terminal), asked once per store: a
        # group checkpoint opens its store once per member, and nobody should type it each time.
        self.ask = _asked_once(ask) if ask is not None else None
        self.password_file: Path | None = None
        self._settings: settings.Settings | None = None

    def settings(self) -> settings.Settings:
        if self._settings is None:
            self._settings = self.environment if self.password_file is None else replace(
                self.environment, password=None, password_file=self.password_file)
        return self._settings

    def passwords(self) -> PasswordSource:
        return PasswordSource.from_settings(self.settings(), self.ask)


def _asked_once(ask: Callable[[str, bool], str]) -> Callable[[str, bool], str]:
    """The prompt, remembering each store's answer for the rest of this run (a new password,
    confirmed, is never taken from memory)."""
    answers: dict[str, str] = {}
    lock = threading.Lock()  # members are opened from threads: one prompt at a time

    def asked(what: str, confirm: bool) -> str:
        with lock:
            if confirm or what not in answers:
                answers[what] = ask(what, confirm)
            return answers[what]
    return asked


_runs: list[Invocation] = []  # the one of this run of main() (a list: tests run main() again)


def begin(environment: settings.Settings, ask: Callable[[str, bool], str] | None) -> None:
    _runs[:] = [Invocation(environment, ask)]


def end() -> None:
    _runs.clear()


def invocation() -> Invocation:
    if not _runs:  # a command function called without main() (typer's test runner): as main() would
        begin(settings.Settings.from_environment(), None)
    return _runs[0]


def cli_settings() -> settings.Settings:
    """The settings of this run: what every use case gets passed."""
    return invocation().settings()


def store_root(flag: Optional[str]) -> settings.StoreLocation:
    """The store: --store, else CKPT_STORE, else the default (ckpt.settings)."""
    return settings.store_from_flag(flag) if flag is not None else cli_settings().store


def use_password_file(flag: Optional[str]) -> None:
    """--password-file wins over CKPT_PASSWORD_FILE and CKPT_PASSWORD."""
    if flag is not None:
        if not flag.strip():
            raise typer.BadParameter("'' names no file; give the file holding the password")
        invocation().password_file = Path(flag).expanduser().absolute()


def open_store(path: Optional[str], create: bool = False, reporter: Any = None) -> Store:
    """The store of --store (or CKPT_STORE...); --verbose says which (reporter.detail)."""
    run = invocation()
    store = Store.open(store_root(path), create=create, settings=run.settings(), passwords=run.passwords())
    if reporter is not None:
        reporter.detail(f"store {store.location}")
    return store


@dataclass(frozen=True)
class SharedFlags:
    """The flags most commands share (--store, --dry-run, --json, -q, -v), as one value: declared
    once by shared_flags() and handed to the command in its `flags` parameter."""

    store: Optional[str] = None
    dry_run: bool = False
    json_out: bool = False
    quiet: bool = False
    verbose: bool = False

    def reporter(self) -> Any:
        from ckpt.cli.output import CliReporter

        return CliReporter(quiet=self.quiet, verbose=self.verbose)


# Only the placeholder default of a command's `flags` parameter: shared_flags() always passes the real ones.
NO_FLAGS = SharedFlags()

# In the order they appear in every command's help (after its own arguments and options).
_SHARED_FLAGS: dict[str, tuple[Any, Any]] = {
    "store": (StoreOption, None),
    "dry_run": (DryRunOption, False),
    "json_out": (JsonOption, False),
    "quiet": (QuietOption, False),
    "verbose": (VerboseOption, False),
}
REPORTING = ("store", "json_out", "quiet", "verbose")
CHANGING = ("store", "dry_run", "json_out", "quiet", "verbose")


def shared_flags(names: tuple[str, ...] = REPORTING) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared flags `names` where its `flags: SharedFlags` parameter stands.

    typer reads a command's parameters from its signature: the wrapper shows typer the command's
    own parameters with the shared ones in place of `flags`, and passes them back as one SharedFlags."""
    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        at = [p.name for p in own].index("flags")
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_SHARED_FLAGS[name][1],
                                    annotation=_SHARED_FLAGS[name][0]) for name in names]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        params[at:at + 1] = shared

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            flags = SharedFlags(**{name: kwargs.pop(name) for name in names})
            command(**kwargs, flags=flags)

        run.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer must see the signature above, not the command's own
        return run
    return decorate


def retention_policy(keep_last: int, keep_within: Optional[str], keep_hourly: int, keep_daily: int,
                     keep_weekly: int):
    from ckpt.schedule.retention import Policy, parse_duration

    return Policy(keep_last=keep_last, keep_within=parse_duration(keep_within) if keep_within else None,
                  keep_hourly=keep_hourly, keep_daily=keep_daily, keep_weekly=keep_weekly)


def with_members(flags: SharedFlags, use_case: Callable[..., Any], request: Any, *, phase_timeout: float,
                 restore: bool = False) -> Any:
    """A group use case (group_dump, group_restore) with this run's settings and password source,
    its members made here or, for HOST:PID members, over ssh (group_remote.members_anywhere)."""
    from ckpt.commands.group_remote import members_anywhere

    reporter = flags.reporter()
    settings, passwords = invocation().settings(), invocation().passwords()
    try:
        root = store_root(flags.store)
        factory = members_anywhere(root, reporter, settings=settings, passwords=passwords, restore=restore,
                                   timeout=phase_timeout)
        return use_case(root, request, reporter, settings=settings, passwords=passwords, member_factory=factory)
    finally:
        reporter.close()
