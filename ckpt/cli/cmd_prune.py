import typer

from ckpt.cli.options import CHANGING, NO_FLAGS, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stderr
from ckpt.commands.prune import PruneResult, prune

HELP = """Reclaim the space of data no checkpoint references any more.

Computes a plan (packs to drop, packs to repack, unreferenced objects, the members of group
checkpoints that never committed), prints it, and executes it under the store's exclusive lock.
An interrupted prune leaves every checkpoint intact.

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
            emit_json(result.to_json())
        elif not flags.quiet:
            stderr.print(_summary(result))


def _summary(result: PruneResult) -> str:
    plan = result.to_json()
    return (f"{'would free' if result.dry_run else 'freed'} {human_bytes(plan['bytes_freed'])}: "
            f"{len(plan['drop_packs'])} pack(s) dropped, {len(plan['repack'])} repacked, {plan['objects']} object(s) "
            f"and {len(plan['unindexed_packs'])} leftover pack(s) removed"
            + (f", {len(plan['unfinished_members'])} unfinished group member(s) removed" if plan["unfinished_members"]
               else "")
            + f", {result.duration_ms} ms")
