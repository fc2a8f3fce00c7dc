from typing import Annotated

import typer

from ckpt.cli.options import CHANGING, NO_FLAGS, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stderr
from ckpt.commands.rm import remove

HELP = """Remove checkpoints and reclaim the space no remaining checkpoint uses.

Data shared with other checkpoints is kept: removing one never breaks another.

Examples:

  ckpt rm 20261130-230102-123-3fa9c1

  ckpt rm agent old-run --dry-run
"""


def register(app: typer.Typer) -> None:
    @app.command("rm", help=HELP)
    @shared_flags(CHANGING)
    def rm_command(
        refs: Annotated[list[str], typer.Argument(help="Checkpoint IDs or names (a name removes its newest).")],
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        result = remove(open_store(flags.store, create=False, reporter=reporter), refs, dry_run=flags.dry_run,
                        reporter=reporter)
        if flags.json_out:
            emit_json(result.to_json())
            return
        if not flags.quiet:
            verb = "would remove" if result.dry_run else "removed"
            stderr.print(f"{verb} {len(result.removed)} checkpoint(s)"
                         + ("" if result.dry_run else f", freed {human_bytes(result.bytes_freed)}"))
        for checkpoint_id in result.removed:
            print(checkpoint_id)
