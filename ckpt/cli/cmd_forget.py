from typing import Annotated

import typer

from ckpt.cli.options import (DryRunOption, JsonOption, KeepDailyOption, KeepHourlyOption, KeepLastOption,
                              KeepWeeklyOption, KeepWithinOption, NameFilterOption, QuietOption, StoreOption,
                              VerboseOption, open_store, retention_policy)
from ckpt.cli.output import CliReporter, emit_json, human_bytes, stderr, stdout
from ckpt.commands.forget import forget

HELP = """Forget checkpoints by a retention policy, per group (name, or command when unnamed).

Each kept checkpoint is listed with the rules that keep it. Removing every checkpoint of a
group needs --allow-remove-all. With --prune the space nothing references any more is
reclaimed at once.

Examples:

  ckpt forget --keep-last 5 --prune

  ckpt forget --name agent --keep-within 2d --keep-daily 7 --dry-run
"""


def register(app: typer.Typer) -> None:
    @app.command("forget", help=HELP)
    def forget_command(
        name: NameFilterOption = None,
        keep_last: KeepLastOption = 0,
        keep_within: KeepWithinOption = None,
        keep_hourly: KeepHourlyOption = 0,
        keep_daily: KeepDailyOption = 0,
        keep_weekly: KeepWeeklyOption = 0,
        prune: Annotated[bool, typer.Option("--prune", help="Reclaim unreferenced space afterwards.")] = False,
        allow_remove_all: Annotated[bool, typer.Option("--allow-remove-all",
                                                       help="Allow removing every checkpoint of a group.")] = False,
        store: StoreOption = None,
        dry_run: DryRunOption = False,
        json_out: JsonOption = False,
        quiet: QuietOption = False,
        verbose: VerboseOption = False,
    ) -> None:
        policy = retention_policy(keep_last, keep_within, keep_hourly, keep_daily, keep_weekly)
        result = forget(open_store(store, create=False), policy, name=name, prune=prune, dry_run=dry_run,
                        allow_remove_all=allow_remove_all, reporter=CliReporter(quiet=quiet, verbose=verbose))
        if json_out:
            emit_json(result)
            return
        for kept in result["keep"]:
            stdout.print(f"keep    {kept['id']}  {kept['group']}  ({', '.join(kept['reasons'])})")
        for removed in result["remove"]:
            stdout.print(f"{'would remove' if dry_run else 'remove'}  {removed['id']}  {removed['group']}")
        if not quiet:
            stderr.print(f"{len(result['keep'])} kept, {len(result['remove'])} "
                         f"{'to remove' if dry_run else 'removed'}"
                         + (f", {human_bytes(result['bytes_freed'])} freed" if result["pruned"] else ""))
