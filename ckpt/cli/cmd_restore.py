from typing import Annotated, Optional

import typer

from ckpt.cli.options import (NO_FLAGS, REPORTING, SharedFlags, invocation, output_file_flag, shared_flags,
                              store_root)
from ckpt.cli.output import emit_json, stderr, styled
from ckpt.commands.restore import RestoreRequest, restore

HELP = """Restore a checkpoint: the tree continues where it stopped, detached from ckpt.

REF is a checkpoint ID (or a unique prefix of one), a name (the newest checkpoint with it),
or 'latest'. The checkpoint is verified first; a damaged one is refused. The tree gets its
original PIDs back: if one is held by another process, ckpt says which; --new-pidns then
restores the tree into a PID namespace of its own, where it keeps its PIDs (the host sees
others; stdout then carries the host's PID of the root).
stdout carries the restored root PID alone (with --json, one JSON object).
A pipe or UNIX socket from the tree to a program outside it ('agent | tee log', a service's
stdout to journald) has nobody at its other end after a restore: what the tree writes there
goes to a file instead (--output).
A large tree is restored lazily where the kernel can (userfaultfd): it runs again before its
memory is all back, and a page server that ckpt leaves running fills the memory in from the
store, where the tree touches it first, then the rest in the background (seconds for GiBs).
--eager restores all memory first; --lazy restores lazily whatever the size.
Before CRIU runs, ckpt checks that this host has what the checkpoint needs (the files the
tree had open or mapped, with the same size, mode and ELF build id; a CRIU as new; the same
architecture) and names every mismatch in one error (exit code 10). On another host,
established TCP connections come back closed (--tcp-established keeps them); on this one, a
connection whose peer here no longer holds it (the peer saw it end) comes back closed, the
others established ('ckpt check REF' says which).

Examples:

  ckpt restore latest

  ckpt restore agent --json

  ckpt restore 20261130-230102-123-3fa9c1

  ckpt restore agent --new-pidns     # the original is still running

  ckpt restore agent --output agent.log   # was 'agent | tee agent.log'

  ckpt restore agent --tcp-close   # its connections fail, it reconnects (the default on another host)

  ckpt restore agent --tcp-established   # on another host too: its peers moved with it

  ckpt restore agent --eager       # all memory in place before the tree runs
"""

OutputOption = Annotated[Optional[str], output_file_flag(
    "Where the tree now writes what it wrote into pipes or sockets to programs outside it ('agent | tee log'): "
    "FILE (appended), or '-' for ckpt's own stdout and stderr. Default: output-TIME.log in the checkpoint's "
    "log directory.")]


def register(app: typer.Typer) -> None:
    @app.command("restore", help=HELP)
    @shared_flags(REPORTING)
    def restore_command(
        ref: Annotated[str, typer.Argument(help="Checkpoint ID, name, or 'latest'.")],
        post_restore: Annotated[Optional[str], typer.Option(
            "--post-restore", help="Shell command run once the tree runs again (CKPT_PID, CKPT_ID in its "
                                   "environment); its failure is reported, the tree keeps running.")] = None,
        new_pidns: Annotated[bool, typer.Option(
            "--new-pidns", help="Restore into a new PID namespace, for when the tree's PIDs are taken.")] = False,
        tcp_close: Annotated[Optional[bool], typer.Option(
            "--tcp-close/--tcp-established",
            help="Restore established TCP connections closed (the program sees them fail and reconnects) or "
                 "established as they were. Default: closed when the checkpoint was taken on another host; "
                 "on its own host established, but for each whose peer on this host no longer holds it; "
                 "--tcp-close also for a restore long after remote peers gave up.")] = None,
        output: OutputOption = None,
        lazy: Annotated[Optional[bool], typer.Option(
            "--lazy/--eager",
            help="Restore memory lazily (the tree runs at once, a page server fills its memory in) or all "
                 "of it first. Default: lazily for trees with 64 MiB or more of private memory, where the "
                 "kernel can.")] = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        try:
            result = restore(store_root(flags.store), RestoreRequest(ref=ref, new_pidns=new_pidns,
                                                               post_restore_hook=post_restore,
                                                               output=output, tcp_close=tcp_close,
                                                               lazy=lazy), reporter,
                             settings=invocation().settings(), passwords=invocation().passwords())
        finally:
            reporter.close()
        if flags.json_out:
            emit_json(result.to_json())
            return
        if not flags.quiet:
            inside = f" ({result.pid_in_namespace} in its PID namespace)" if result.pid_in_namespace else ""
            stderr.print(styled(f"restored {result.manifest.id}", "green", f": root PID {result.pid}{inside}, "
                                f"{len(result.manifest.processes)} process(es), took {result.duration_ms} ms"))
            if result.lazy:
                stderr.print(f"{result.lazy['bytes'] / (1 << 20):.0f} MiB of its memory is being filled in by page "
                             f"server {result.lazy['server_pid']} (log: {result.lazy['log']})")
        print(result.pid)
