from typing import Annotated

import typer

from ckpt.cli.options import (CHANGING, NO_FLAGS, KeepDailyOption, KeepHourlyOption, KeepLastOption, KeepWeeklyOption,
                              KeepWithinOption, NameFilterOption, SharedFlags, open_store, retention_policy,
                              shared_flags)
from ckpt.cli.output import emit_json, human_bytes, stderr, stdout
from ckpt.commands.forget import forget

HELP = """Forget checkpoints by a retention policy, per series (name, or command when unnamed).

A group checkpoint is judged as one (its name, its time) in a series of its own ('group: NAME')
and kept or removed whole: the group, then its members.

Each kept checkpoint is listed with the rules that keep it. Removing every checkpoint of a
series needs --allow-remove-all. With --prune the space nothing references any more is
reclaimed at once.

Examples:

  ckpt forget --keep-last 5 --prune

  ckpt forget --name agent --keep-within 2d --keep-daily 7 --dry-run
"""


def register(app: typer.Typer) -> None:
    @app.command("forget", help=HELP)
    @shared_flags(CHANGING)
    def forget_command(
        name: NameFilterOption = None,
        keep_last: KeepLastOption = 0,
        keep_within: KeepWithinOption = None,
        keep_hourly: KeepHourlyOption = 0,
        keep_daily: KeepDailyOption = 0,
        keep_weekly: KeepWeeklyOption = 0,
        prune: Annotated[bool, typer.Option("--prune", help="Reclaim unreferenced space afterwards.")] = False,
        allow_remove_all: Annotated[bool, typer.Option("--allow-remove-all",
                                                       help="Allow removing every checkpoint of a series.")] = False,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        policy = retention_policy(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly)
        result = forget(open_store(flags.store, create=False), policy, name=name, prune=prune, dry_run=flags.dry_run,
                        allow_remove_all=allow_remove_all, reporter=flags.reporter())
        if flags.json_out:
            emit_json(result.to_json())
            return
        members = {d.id: f"  ({len(m)} members)" for d in result.decisions if (m := result.members.get(d.id))}
        for kept in result.kept:
            stdout.print(f"keep    {kept.id}  {kept.group}  ({', '.join(kept.reasons)}){members.get(kept.id, '')}")
        for removed in result.removed:
            stdout.print(f"{'would remove' if flags.dry_run else 'remove'}  {removed.id}  {removed.group}"
                         + members.get(removed.id, ""))
        if not flags.quiet:
            stderr.print(f"{len(result.kept)} kept, {len(result.removed)} "
                         f"{'to remove' if flags.dry_run else 'removed'}"
                         + (f", {human_bytes(result.bytes_freed)} freed" if result.pruned else ""))
