from typing import Annotated

import typer

from ckpt.cli.options import CHANGING, NO_FLAGS, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stderr
from ckpt.commands.rm import remove

HELP = """Remove checkpoints and reclaim the space no remaining checkpoint uses.

Data shared with other checkpoints is kept: removing one never breaks another. A group
checkpoint (its name or ID) is removed whole: the group first, then its members. A member of a
group is not removed alone (exit code 2): remove its group.

Examples:

  ckpt rm 20261130-230102-123-3fa9c1

  ckpt rm agent old-run --dry-run

  ckpt rm my-group
"""


def register(app: typer.Typer) -> None:
    @app.command("rm", help=HELP)
    @shared_flags(CHANGING)
    def rm_command(
        refs: Annotated[list[str], typer.Argument(help="Checkpoint or group checkpoint IDs or names (a name "
                                                       "removes its newest).")],
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
            groups = f"{len(result.groups)} group checkpoint(s) and " if result.groups else ""
            stderr.print(f"{verb} {groups}{len(result.removed)} checkpoint(s)"
                         + ("" if result.dry_run else f", freed {human_bytes(result.bytes_freed)}"))
        for checkpoint_id in result.groups + result.removed:
            print(checkpoint_id)
