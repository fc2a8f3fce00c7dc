from typing import Annotated, Optional

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, invocation, output_file_flag, shared_flags, store_root
from ckpt.cli.output import emit_json, stderr, styled
from ckpt.commands.clone import MAX_COPIES, CloneRequest, RunningCopy, check_request, clone

HELP = f"""Restore one checkpoint N times at once: N copies that run side by side.

Each copy runs in a PID namespace of its own (the tree keeps its PIDs inside; the host sees
others) and, when the tree listened on a TCP port (or with --net own), in a network namespace
of its own with an address of its own (10.214.X.Y), from which it reaches what the original
reached. --net host keeps the host's network (the copies' ports then clash). Established
connections come back closed in every copy.

All or nothing: if any copy fails, the copies already running are ended, and the error says
which copy failed and why. --copies is 1 to {MAX_COPIES}. A program tells which copy it is with
ckpt.copy_info() or 'ckpt copy-info'; its ckpt.checkpoint() returns copy=k; its journal
(ckpt.journal) is its own from the checkpoint on. 'ckpt list' and 'ckpt show REF' show the
running copies. stdout carries one line per copy: its number, root PID, init PID and address
(with --json, one JSON object). 'ckpt restore REF --copies N' is the same.

Examples:

  ckpt clone agent --copies 4

  ckpt clone latest --copies 2 --net host --json

  nsenter --net=/run/netns/ckpt-CLONE-1 curl -s localhost:8080   # copy 1's port, in its namespace
"""

CopiesOption = Annotated[int, typer.Option(
    "--copies", metavar="N", help=f"How many copies to run (1 to {MAX_COPIES}).")]
NetOption = Annotated[str, typer.Option(
    "--net", metavar="auto|own|host",
    help="A network namespace per copy (own), the host's network (host), or own when the tree listened on a "
         "TCP port (auto).")]
CloneOutputOption = Annotated[Optional[str], output_file_flag(
    "Where the copies write what the tree wrote into pipes or sockets to programs outside it: FILE "
    "(appended), or '-' for ckpt's own stdout and stderr. Default: a file in the checkpoint's log directory.")]


def register(app: typer.Typer) -> None:
    @app.command("clone", help=HELP)
    @shared_flags(REPORTING)
    def clone_command(
        ref: Annotated[str, typer.Argument(help="Checkpoint ID, name, or 'latest'.")],
        copies: CopiesOption = 2,
        net: NetOption = "auto",
        output: CloneOutputOption = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        run_clone(flags, CloneRequest(ref=ref, copies=copies, network=net, output=output))


def run_clone(flags: SharedFlags, request: CloneRequest) -> None:
    """Parses nothing more: runs the clone and prints it (ckpt clone, ckpt restore --copies)."""
    check_request(request)  # before the store is opened: a bad --copies is one line of error
    reporter = flags.reporter()
    try:
        result = clone(store_root(flags.store), request, reporter, settings=invocation().settings(),
                       passwords=invocation().passwords())
    finally:
        reporter.close()
    if flags.json_out:
        emit_json(result.to_json())
        return
    if not flags.quiet:
        stderr.print(styled(f"cloned {result.manifest.id}", "green",
                            f": {len(result.copies)} copies running (clone {result.clone}, network "
                            f"{result.network}), took {result.duration_ms} ms"))
        for copy in result.copies:
            for line in reach(copy, result.ports):
                stderr.print(f"  copy {copy.index}: {line}")
    for copy in result.copies:
        print(f"{copy.index} {copy.pid} {copy.init_pid} {copy.address or '-'}")


def reach(copy: RunningCopy, ports: list[int]) -> list[str]:
    """How to reach a copy: its PIDs, and its ports (in its namespace, or at its address)."""
    lines = [f"root PID {copy.pid} ({copy.pid_in_namespace} in its PID namespace), init PID {copy.init_pid}"]
    if copy.netns:
        where = copy.netns if copy.netns.startswith("/") else f"/run/netns/{copy.netns}"
        shown = ", ".join(f"{copy.address}:{p}" for p in ports) if copy.address and ports else copy.address
        lines.append(f"address {copy.address or '?'}; from the host connect to {shown or 'its address'}, "
                     f"or run 'nsenter --net={where} COMMAND' in its network")
    elif ports:
        listed = ", ".join(str(p) for p in ports)
        lines.append(f"host network: ports {listed} are the host's (they clash between copies)")
    return lines
