from typing import Annotated

import typer

from ckpt.cli.options import DryRunOption, JsonOption, QuietOption, StoreOption, VerboseOption, open_store
from ckpt.cli.output import CliReporter, emit_json, human_bytes, stderr
from ckpt.commands.rm import remove

HELP = """Remove checkpoints and reclaim the space no remaining checkpoint uses.

Data shared with other checkpoints is kept: removing one never breaks another.

Examples:

  ckpt rm 20261130-230102-123-3fa9c1

  ckpt rm agent old-run --dry-run
"""


def register(app: typer.Typer) -> None:
    @app.command("rm", help=HELP)
    def rm_command(
        refs: Annotated[list[str], typer.Argument(help="Checkpoint IDs or names (a name removes its newest).")],
        store: StoreOption = None,
        dry_run: DryRunOption = False,
        json_out: JsonOption = False,
        quiet: QuietOption = False,
        verbose: VerboseOption = False,
    ) -> None:
        reporter = CliReporter(quiet=quiet, verbose=verbose)
        result = remove(open_store(store, create=False, reporter=reporter), refs, dry_run=dry_run, reporter=reporter)
        if json_out:
            emit_json(result)
            return
        if not quiet:
            verb = "would remove" if dry_run else "removed"
            stderr.print(f"{verb} {len(result['removed'])} checkpoint(s)"
                         + ("" if dry_run else f", freed {human_bytes(result['bytes_freed'])}"))
        for checkpoint_id in result["removed"]:
            print(checkpoint_id)
