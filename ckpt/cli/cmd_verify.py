from typing import Annotated, Optional

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, stderr, styled
from ckpt.commands.verify import verify
from ckpt.errors import DamagedCheckpoint, UsageError

HELP = """Recompute the hash of every image of a checkpoint (or of all) and name what is damaged.

A group checkpoint (its name or ID) is verified member by member; a group whose member is
missing is damaged (with --all too).

Exit code 0 when everything is intact, 6 when something is damaged. Damage found is recorded
in the store: later dumps never reuse damaged data, and a dump that meets the same content
again stores a fresh copy, which heals the older checkpoints that named it.

Examples:

  ckpt verify latest

  ckpt verify my-group

  ckpt verify --all --json
"""


def register(app: typer.Typer) -> None:
    @app.command("verify", help=HELP)
    @shared_flags(REPORTING)
    def verify_command(
        ref: Annotated[Optional[str], typer.Argument(help="Checkpoint or group checkpoint: ID or name.")] = None,
        all_: Annotated[bool, typer.Option("--all", help="Verify every checkpoint.")] = False,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        if bool(ref) == all_:
            raise UsageError("give either a checkpoint ID or --all", hint="e.g. 'ckpt verify latest'")
        reporter = flags.reporter()
        try:
            results = verify(open_store(flags.store, create=False), None if all_ else ref, reporter)
        finally:
            reporter.close()
        damaged = [r for r in results if r["problems"]]
        if flags.json_out:
            emit_json(results)
        else:
            for r in results:
                if r["problems"]:
                    for p in r["problems"]:
                        stderr.print(styled("DAMAGED", "red", f" {r['id']}: {p}"))
                elif not flags.quiet:
                    stderr.print(styled("ok", "green", f" {r['id']} ({r['files']} files)"))
        if damaged:
            raise DamagedCheckpoint(f"{len(damaged)} of {len(results)} checkpoint(s) damaged: "
                                    + ", ".join(r["id"] for r in damaged),
                                    hint="damaged data is never reused: the next dump of a process "
                                         "holding the same content stores it again and heals these; "
                                         "otherwise remove them with 'ckpt rm'")
