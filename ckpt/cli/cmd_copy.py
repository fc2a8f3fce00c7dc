from typing import Annotated, Optional

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, NameFilterOption, SharedFlags, invocation, open_store, shared_flags
from ckpt.cli.output import CliReporter, emit_json, human_bytes, stderr, styled
from ckpt.commands.copy import CopyReport, copy, finish_pending, open_destination, select
from ckpt.errors import DamagedCheckpoint, StoreError, UsageError

HELP = """Copy checkpoints to another store, sending only what it lacks.

Objects the destination has are skipped by name, pages by id: only the pages the destination
does not hold yet are read from the source and written, into one new pack per checkpoint. A
checkpoint is committed in the destination last (its manifest, with the same ID), so an
interrupted copy shows nothing half copied and the next copy finishes it; a checkpoint the
destination has is skipped. The destination is made if there is none.

A group checkpoint (its name or ID) is copied whole: every member, then the group, last. A
member alone is not copied (exit code 2): copy its group. --all copies groups too.

With --pending, copies what schedules and 'ckpt run' with --copy-to still owe (their copies
that failed), and removes each record once its copy is committed.

Examples:

  ckpt copy latest --to /mnt/backup/ckpt

  ckpt copy --all --to /mnt/backup/ckpt --json

  ckpt copy --all --name agent --to /mnt/backup/ckpt

  ckpt copy my-group --to /mnt/backup/ckpt

  ckpt copy 20261130-230102-123-3fa9c1 agent --store /var/lib/ckpt --to /mnt/backup/ckpt

  ckpt copy --pending
"""


def register(app: typer.Typer) -> None:
    @app.command("copy", help=HELP)
    @shared_flags(REPORTING)
    def copy_command(
        refs: Annotated[Optional[list[str]], typer.Argument(help="Checkpoint or group checkpoint IDs or names "
                                                                 "(a name: its newest).",
                                                            show_default=False)] = None,
        to: Annotated[Optional[str], typer.Option("--to", metavar="STORE",
                                                  help="The store to copy into.")] = None,
        all_: Annotated[bool, typer.Option("--all", help="Copy every checkpoint (with --name: every one "
                                                         "of that name).")] = False,
        name: NameFilterOption = None,
        pending_: Annotated[bool, typer.Option("--pending", help="Finish the copies --copy-to left "
                                                                 "pending.")] = False,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        if pending_:
            if refs or all_ or to or name:
                raise UsageError("--pending takes no checkpoints and no --to (each record names its destination)",
                                 hint="run 'ckpt copy --pending' alone")
            _pending(flags.store, flags.json_out, flags.quiet)
            return
        if not to:
            raise UsageError("give the destination with --to STORE", hint="e.g. 'ckpt copy latest --to /backup/ckpt'")
        source = open_store(flags.store, create=False)
        selection = select(source, refs or [], all_, name)
        reporter = flags.reporter()
        try:
            destination = open_destination(to, source.settings, invocation().passwords())
            report = copy(source, destination, selection.checkpoints, reporter, groups=selection.groups)
        finally:
            reporter.close()
        if flags.json_out:
            emit_json(report.to_json())
        elif not flags.quiet:
            _print_report(report)
        failed = [(r.id, r.error) for r in report.failed] + [(g.id, g.error) for g in report.failed_groups]
        if failed:
            raise DamagedCheckpoint(f"{len(failed)} of {len(report.results) + len(report.groups)} checkpoint(s) and "
                                    "group(s) not copied: " + "; ".join(f"{i}: {error}" for i, error in failed),
                                    hint="see 'ckpt verify' in the source store")


def _print_report(report: CopyReport) -> None:
    for r in report.results:
        if r.status == "copied":
            stderr.print(styled("copied", "green", f" {r.id}: {r.pages_sent} of {r.pages} pages sent, "
                                                   f"{human_bytes(r.bytes_sent)} written"))
        elif r.status == "present":
            stderr.print(styled("present", "dim", f" {r.id}: the destination has it"))
    for g in report.groups:
        if g.status != "failed":
            stderr.print(styled(g.status, "green" if g.status == "copied" else "dim",
                                f" group {g.id}: " + ("committed, after its members" if g.status == "copied"
                                                      else "the destination has it")))
    total = report.to_json()["bytes_sent"]
    groups = f" and {len(report.groups) - len(report.failed_groups)} group(s)" if report.groups else ""
    stderr.print(f"{len(report.results) - len(report.failed)} of {len(report.results)} checkpoint(s){groups} in "
                 f"{report.destination}, {human_bytes(total)} sent")


def _pending(store, json_out: bool, quiet: bool) -> None:
    reporter = CliReporter(quiet=quiet)
    try:
        outcomes = finish_pending(open_store(store, create=False), None, reporter, invocation().passwords())
    finally:
        reporter.close()
    if json_out:
        emit_json({"pending": outcomes})
    elif not quiet:
        if not outcomes:
            stderr.print("no pending copies")
        for o in outcomes:
            stderr.print(f"{o['status']} {o['id']} -> {o['to']}" + (f": {o['error']}" if o["error"] else ""))
    failed = [o for o in outcomes if o["status"] == "failed"]
    if failed:
        raise StoreError(f"{len(failed)} pending copie(s) failed again: {failed[0]['error']}",
                         hint="their records stay; the next run (or 'ckpt copy --pending') tries again")
