import typer

from ckpt.cli.options import DryRunOption, JsonOption, QuietOption, StoreOption, VerboseOption, open_store
from ckpt.cli.output import CliReporter, emit_json, human_bytes, stderr
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
    def prune_command(store: StoreOption = None, dry_run: DryRunOption = False, json_out: JsonOption = False,
                      quiet: QuietOption = False, verbose: VerboseOption = False) -> None:
        reporter = CliReporter(quiet=quiet, verbose=verbose)
        result = prune(open_store(store, create=False, reporter=reporter), dry_run=dry_run, reporter=reporter)
        if json_out:
            emit_json(result)
            return
        if not quiet:
            verb = "would free" if dry_run else "freed"
            stderr.print(f"{verb} {human_bytes(result['bytes_freed'])}: {len(result['drop_packs'])} pack(s) dropped, "
                         f"{len(result['repack'])} repacked, {result['objects']} object(s) and "
                         f"{len(result['unindexed_packs'])} leftover pack(s) removed, "
                         f"{result['duration_ms']} ms")
