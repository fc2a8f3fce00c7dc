import typer

from ckpt.cli.options import CHANGING, NO_FLAGS, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stderr
from ckpt.commands.prune import prune

HELP = """Reclaim the space of data no checkpoint references any more.

Computes a plan (packs to drop, packs to repack, unreferenced objects), prints it, and executes
it under the store's exclusive lock. An interrupted prune leaves every checkpoint intact.

Examples:

  ckpt prune --dry-run

  ckpt prune --json
"""


def register(app: typer.Typer) -> None:
    @app.command("prune", help=HELP)
    @shared_flags(CHANGING)
    def prune_command(flags: SharedFlags = NO_FLAGS) -> None:
        reporter = flags.reporter()
        result = prune(open_store(flags.store, create=False, reporter=reporter), dry_run=flags.dry_run,
                       reporter=reporter)
        if flags.json_out:
            emit_json(result)
            return
        if not flags.quiet:
            verb = "would free" if flags.dry_run else "freed"
            stderr.print(f"{verb} {human_bytes(result['bytes_freed'])}: {len(result['drop_packs'])} pack(s) dropped, "
                         f"{len(result['repack'])} repacked, {result['objects']} object(s) and "
                         f"{len(result['unindexed_packs'])} leftover pack(s) removed, "
                         f"{result['duration_ms']} ms")
