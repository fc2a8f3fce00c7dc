import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ckpt.cli.options import (NO_FLAGS, REPORTING, HoldLimitOption, PhaseTimeoutOption, SharedFlags, invocation,
                              output_file_flag, shared_flags, store_root, with_members)
from ckpt.cli.cmd_clone import NetOption, run_clone
from ckpt.cli.output import emit_json, stderr, styled
from ckpt.commands.clone import CloneRequest, check_request
from ckpt.commands.group_remote import parse_on
from ckpt.commands.group import GroupRestoreRequest, GroupRestoreResult, existing_store, group_restore, named_group
from ckpt.commands.restore import RestoreRequest, RestoreResult, restore, wait_for_memory
from ckpt.errors import UsageError

if TYPE_CHECKING:
    from ckpt.store import Store

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
--eager restores all memory first (ckpt copies it in from the store through userfaultfd
before the tree runs, where the kernel can: no pages image is written); --lazy restores
lazily whatever the size.
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

  ckpt restore agent --copies 4    # four copies at once, as 'ckpt clone agent --copies 4'

REF may name a group checkpoint (ckpt dump --group): every member is restored, none runs
until every one is back, connections between members come back established, and if any
member fails none runs. stdout then carries each member's root PID, one per line.

  ckpt restore agent-group --json

  ckpt restore web --on host-a=host-c   # host-a's member on host-c, the others where they were

  ckpt restore web --on host-b=         # host-b's member on this host
"""

OutputOption = Annotated[Optional[str], output_file_flag(
    "Where the tree now writes what it wrote into pipes or sockets to programs outside it ('agent | tee log'): "
    "FILE (appended), or '-' for ckpt's own stdout and stderr. Default: output-TIME.log in the checkpoint's "
    "log directory.")]


PostRestoreOption = Annotated[Optional[str], typer.Option(
    "--post-restore", help="Shell command run once the tree runs again (CKPT_PID, CKPT_ID in its "
                           "environment); its failure is reported, the tree keeps running.")]


RestoreCopiesOption = Annotated[Optional[int], typer.Option(
    "--copies", metavar="N",
    help="Restore N copies at once, each in namespaces of its own (as 'ckpt clone REF --copies N').")]


NewPidnsOption = Annotated[bool, typer.Option(
    "--new-pidns", help="Restore into a new PID namespace, for when the tree's PIDs are taken.")]

TcpCloseOption = Annotated[Optional[bool], typer.Option(
    "--tcp-close/--tcp-established",
    help="Restore established TCP connections closed (the program sees them fail and reconnects) or "
         "established as they were. Default: closed when the checkpoint was taken on another host; "
         "on its own host established, but for each whose peer on this host no longer holds it; "
         "--tcp-close also for a restore long after remote peers gave up.")]

LazyOption = Annotated[Optional[bool], typer.Option(
    "--lazy/--eager",
    help="Restore memory lazily (the tree runs at once, a page server fills its memory in) or all "
         "of it first. Default: lazily for trees with 64 MiB or more of private memory, where the "
         "kernel can.")]

WaitOption = Annotated[Optional[bool], typer.Option(
    "--wait/--no-wait",
    help="After a lazy restore, wait until the page server has put the last page back, showing "
         "the pages coming in (and bytes fetched from a remote store); --json then adds the times "
         "to running and to the last page. Default: wait when stderr is a terminal (without --json "
         "or --quiet). The tree runs all along; Ctrl-C ends only the wait.")]

OnOption = Annotated[Optional[list[str]], typer.Option(
    "--on", metavar="FROM=TO",
    help="A group's members taken on host FROM are restored on host TO instead (reached with ssh; "
         "'FROM=' restores them on this host). Once per host.")]


def register(app: typer.Typer) -> None:
    @app.command("restore", help=HELP)
    @shared_flags(REPORTING)
    def restore_command(
        ref: Annotated[str, typer.Argument(help="Checkpoint ID, name, or 'latest'.")],
        post_restore: PostRestoreOption = None,
        new_pidns: NewPidnsOption = False,
        tcp_close: TcpCloseOption = None,
        output: OutputOption = None,
        lazy: LazyOption = None,
        hold_limit: HoldLimitOption = 60.0,
        timeout: PhaseTimeoutOption = 120.0,
        copies: RestoreCopiesOption = None,
        net: NetOption = "auto",
        wait: WaitOption = None,
        on: OnOption = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        if copies is not None:
            _refuse_for_copies(new_pidns=new_pidns, post_restore=post_restore, on=on)
            _restore_copies(flags, CloneRequest(ref=ref, copies=copies, network=net, lazy=lazy, output=output,
                                                tcp_close=tcp_close))
            return
        settings, passwords = invocation().settings(), invocation().passwords()
        # Opened once, for both the question and the restore: unlocking an encrypted store
        # derives its key from the password, 0.1 s of CPU on purpose.
        store = existing_store(store_root(flags.store), settings=settings, passwords=passwords)
        if named_group(store, ref) is not None:
            _refuse_for_groups(new_pidns=new_pidns, post_restore=post_restore)
            _restore_group(flags, GroupRestoreRequest(ref=ref, tcp_close=tcp_close, lazy=lazy, output=output,
                                                      hold_limit=hold_limit, phase_timeout=timeout,
                                                      on=parse_on(on or [])))
            return
        if net != "auto":
            raise UsageError("--net is taken only with --copies", hint="a plain restore keeps the host's network")
        if on:
            raise UsageError("--on is taken only for a group checkpoint",
                             hint=f"'{ref}' names a checkpoint: run 'ckpt restore' on the host it is to run on")
        if wait is None:
            wait = sys.stderr.isatty() and not flags.json_out and not flags.quiet
        _restore_one(flags, RestoreRequest(ref=ref, new_pidns=new_pidns, post_restore_hook=post_restore,
                                           output=output, tcp_close=tcp_close, lazy=lazy), wait, store)


def _restore_one(flags: SharedFlags, request: RestoreRequest, wait: bool = False,
                 store: "Store | None" = None) -> None:
    reporter = flags.reporter()
    memory = None
    try:
        result = restore(store_root(flags.store), request, reporter, settings=invocation().settings(),
                         passwords=invocation().passwords(), store=store)
        if not flags.json_out:
            _tell_restored(flags, result, waiting=wait)
            print(result.pid, flush=True)  # the tree runs: its PID now, for whoever reads stdout
        if wait and result.lazy is not None:
            try:
                memory = wait_for_memory(result, invocation().settings(), reporter)
            except KeyboardInterrupt:  # Ctrl-C ends the wait alone: the restore succeeded
                stderr.print("stopped waiting: the tree runs on, and its page server goes on filling its memory in")
                wait = False
    finally:
        reporter.close()
    if flags.json_out:
        data = result.to_json()
        if memory is not None:
            data["lazy"]["figures"] = memory
        emit_json(data)
    elif memory is not None and not flags.quiet:
        last, lazy = memory["last_page_ms"], result.lazy or {}
        fetched = (f", {memory['bytes_fetched'] / (1 << 20):.0f} MiB fetched in {memory['store_requests']} "
                   "requests" if memory["bytes_fetched"] else "")
        stderr.print(f"its memory is all back{f' after {last / 1000:.2f} s' if last is not None else ''}"
                     f" ({lazy.get('bytes', 0) / (1 << 20):.0f} MiB filled in by the page server{fetched})")


def _tell_restored(flags: SharedFlags, result: RestoreResult, waiting: bool) -> None:
    if flags.quiet:
        return
    inside = f" ({result.pid_in_namespace} in its PID namespace)" if result.pid_in_namespace else ""
    stderr.print(styled(f"restored {result.manifest.id}", "green", f": root PID {result.pid}{inside}, "
                        f"{len(result.manifest.processes)} process(es), took {result.duration_ms} ms"))
    if result.lazy and waiting:
        stderr.print(f"{result.lazy['bytes'] / (1 << 20):.0f} MiB of its memory is being filled in while it runs "
                     "(Ctrl-C ends only this wait)")
    elif result.lazy:
        stderr.print(f"{result.lazy['bytes'] / (1 << 20):.0f} MiB of its memory is being filled in by page "
                     f"server {result.lazy['server_pid']} (log: {result.lazy['log']})")
    elif result.filled:
        stderr.print(f"{result.filled['bytes'] / (1 << 20):.0f} MiB of its memory was copied in before it ran "
                     f"({result.filled['seconds']:.2f} s, {result.filled['threads']} thread(s))")


def _restore_copies(flags: SharedFlags, request: CloneRequest) -> None:
    check_request(request)  # a bad --copies is one line of error, before the store is opened
    store = existing_store(store_root(flags.store), settings=invocation().settings(),
                           passwords=invocation().passwords())
    if named_group(store, request.ref) is not None:
        raise UsageError("--copies is not taken for a group", hint="clone the group's members one by one")
    run_clone(flags, request)


def _refuse_for_copies(**given: object) -> None:
    for option, value in given.items():
        if value:
            raise UsageError(f"--{option.replace('_', '-')} is not taken with --copies",
                             hint="each copy gets a PID namespace of its own; hooks are for one restore")


def _refuse_for_groups(**given: object) -> None:
    for option, value in given.items():
        if value:
            raise UsageError(f"--{option.replace('_', '-')} is not taken for a group",
                             hint="a group's members are restored with their own PIDs, without hooks")


def _restore_group(flags: SharedFlags, request: GroupRestoreRequest) -> None:
    result: GroupRestoreResult = with_members(flags, group_restore, request, phase_timeout=request.phase_timeout,
                                              restore=True)
    if flags.json_out:
        emit_json(result.to_json())
        return
    if not flags.quiet:
        for member in result.members:
            stderr.print(styled(f"restored member {member['label']}", "green",
                                f": checkpoint {member['checkpoint']}, root PID {member['pid']}"))
        stderr.print(styled(f"restored group {result.group.id}", "green",
                            f" ({result.group.name}): {len(result.members)} members, let run within "
                            f"{result.stats['release_skew_ms']} ms of each other"))
    for member in result.members:
        print(member["pid"])
