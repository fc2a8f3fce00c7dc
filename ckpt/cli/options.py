"""Options shared by several commands, defined once so they read the same everywhere."""

from pathlib import Path
from typing import Optional

import typer
from typing import Annotated

from ckpt.config import resolve_store_path
from ckpt.store import Store

StoreOption = Annotated[Optional[Path], typer.Option(
    "--store", envvar="CKPT_STORE", show_envvar=True,
    help="Checkpoint store directory [default: /var/lib/ckpt for root, $XDG_DATA_HOME/ckpt otherwise].")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress messages on stderr.")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be done, change nothing.")]


def open_store(path: Optional[Path], create: bool = False) -> Store:
    return Store.open(resolve_store_path(path), create=create)


def retention_policy(keep_last: int, keep_within: Optional[str], keep_hourly: int, keep_daily: int,
                     keep_weekly: int):
    from ckpt.retention import Policy, parse_duration

    return Policy(keep_last=keep_last, keep_within=parse_duration(keep_within) if keep_within else None,
                  keep_hourly=keep_hourly, keep_daily=keep_daily, keep_weekly=keep_weekly)
