"""ckpt migrate: move a running tree to another host (ckpt/commands/migrate.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, invocation, shared_flags, store_root
from ckpt.cli.output import emit_json, stderr, styled
from ckpt.commands.migrate import (MAX_ROUNDS, MigrateGroupRequest, MigrateGroupResult, MigrateRequest, MigrateResult,
                                   migrate, migrate_group)
from ckpt.errors import UsageError

HELP = """Move a running process tree to another host, with a short pause.

HOST is reached with OpenSSH (your ssh configuration and keys; CKPT_SSH to change the ssh
command, CKPT_REMOTE_CKPT the ckpt command over there) and must reach the same store: an S3
store, or a directory shared at the same path. ckpt first dumps the running tree a few times
(pre-copy: each round stores only the pages the store lacks, until they stop shrinking), then
freezes it for a final dump that sends only the last changes, restores it on HOST (lazily by
default: it runs before its memory is all back), and ends the source tree only once HOST's
copy is restored. Any failure before that thaws the source, which runs on, and ends what HOST
restored: never two copies running, and the final checkpoint is kept.

Established TCP connections come back established where HOST holds their local address (a
floating IP moved with the tree, or the same address in another network namespace); closed
otherwise: the program sees them fail and reconnects. The tree gets its PIDs back on HOST,
which must have them free.

stdout carries the PID on HOST; --json gives the pre-copy rounds (pages sent each) and the
downtime, from the final freeze to the tree running on HOST.

Examples:

  ckpt migrate 4242 --to host-b --store s3://my-bucket/agents

  ckpt migrate 4242 --to admin@10.0.0.7 --json

  ckpt migrate 4242 --to host-b --rounds 0      # no pre-copy: one dump, then the move

  ckpt migrate 4242 --to host-b --eager         # all memory back before it runs on host-b

With --group NAME, several trees of this host move as one consistent cut (as 'ckpt dump
--group'): every member frozen and dumped, then restored at its destination, none running,
before any source is ended; their connections to each other come back established where
their addresses moved with them. --to HOST sends every member there, --to PID=HOST one of them.

  ckpt migrate --group agent 4242 4300 --to host-b

  ckpt migrate --group agent 4242 4300 --to host-b --to 4300=host-c
"""


def register(app: typer.Typer) -> None:
    @app.command("migrate", help=HELP)
    @shared_flags(REPORTING)
    def migrate_command(
        pids: Annotated[list[int], typer.Argument(help="Root PID of the tree to move (with --group: of each member).",
                                                  metavar="PID...")],
        to: Annotated[list[str], typer.Option(
            "--to", metavar="HOST|PID=HOST", help="The host to move it to (as ssh knows it); with --group, "
                                                  "PID=HOST sends one member elsewhere.")],
        name: Annotated[Optional[str], typer.Option("--name", help="Name of the checkpoints.")] = None,
        group: Annotated[Optional[str], typer.Option(
            "--group", metavar="NAME", help="Move the trees as one group of that name.")] = None,
        rounds: Annotated[int, typer.Option(
            "--rounds", min=0, max=MAX_ROUNDS,
            help="Pre-copy rounds at most (dumps of the running tree before the final one); they stop "
                 "earlier once the pages changed stop shrinking.")] = 4,
        lazy: Annotated[Optional[bool], typer.Option(
            "--lazy/--eager", help="Restore on HOST lazily (the default where it can) or all memory first.")] = None,
        tcp_close: Annotated[Optional[bool], typer.Option(
            "--tcp-close/--tcp-established",
            help="Restore established TCP connections closed, or established whatever HOST's addresses. "
                 "Default: established where HOST holds their local address.")] = None,
        hold_limit: Annotated[float, typer.Option(
            "--hold-limit", metavar="SECONDS", min=0.1, max=86400.0,
            help="How long the source stays frozen at most while HOST restores it; past it, it runs on "
                 "and the migration is aborted.")] = 60.0,
        timeout: Annotated[float, typer.Option(
            "--timeout", metavar="SECONDS", min=0.1, max=86400.0,
            help="How long HOST has for each step before the migration is aborted.")] = 120.0,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        host, places = _destinations(to)
        if group is None and (len(pids) != 1 or places):
            raise UsageError("several PIDs, or --to PID=HOST, move as a group", hint="add --group NAME")
        one = MigrateRequest(pid=pids[0], to=host, name=group or name, rounds=rounds, lazy=lazy,
                             tcp_close=tcp_close, hold_limit=hold_limit, phase_timeout=timeout)
        reporter = flags.reporter()
        settings, passwords = invocation().settings(), invocation().passwords()
        try:
            if group is None:
                result: MigrateResult | MigrateGroupResult = migrate(store_root(flags.store), one, reporter,
                                                                     settings=settings, passwords=passwords)
            else:
                result = migrate_group(store_root(flags.store), MigrateGroupRequest.like(one, pids, places), reporter,
                                       settings=settings, passwords=passwords)
        finally:
            reporter.close()
        _render(flags, result)


def _destinations(values: list[str]) -> tuple[str, dict[int, str]]:
    """--to HOST (once) and --to PID=HOST (once per PID)."""
    hosts, places = [], {}
    for value in values:
        pid, sep, host = value.partition("=")
        if not sep:
            hosts.append(value)
        elif pid.isdigit() and host:
            places[int(pid)] = host
        else:
            raise UsageError(f"--to {value!r} is neither HOST nor PID=HOST",
                             hint="e.g. --to host-b or --to 4300=host-c")
    if len(hosts) > 1:
        raise UsageError("--to HOST is given more than once", hint="give --to PID=HOST for each member sent elsewhere")
    if not hosts and not places:
        raise UsageError("--to names no host", hint="e.g. --to host-b")
    return (hosts[0] if hosts else ""), places


def _render(flags: SharedFlags, result: MigrateResult | MigrateGroupResult) -> None:
    if flags.json_out:
        emit_json(result.to_json())
        return
    if isinstance(result, MigrateGroupResult):
        _render_group(flags, result)
        return
    if not flags.quiet:
        where = result.destination["host"]
        if result.restored_at_source:
            stderr.print(styled("migration failed", "yellow", f": the tree runs here again, PID "
                                f"{result.destination['pid']} (checkpoint {result.checkpoint})"))
        else:
            sent = ", ".join(f"{r.new_pages}" for r in result.rounds) or "none"
            stderr.print(styled(f"moved to {where}", "green",
                                f": PID {result.destination['pid']}, down {result.downtime_ms:.0f} ms; pre-copy "
                                f"rounds sent {sent} pages, the final dump {result.final.get('new_pages')}; "
                                f"checkpoint {result.checkpoint}"))
    print(result.destination["pid"])


def _render_group(flags: SharedFlags, result: MigrateGroupResult) -> None:
    if not flags.quiet:
        for member in result.members:
            where = member["destination"]
            if member.get("restored_at_source"):
                stderr.print(styled(f"member {member['pid']} could not run on its destination", "yellow",
                                    f": it runs here again, PID {where['pid']} (checkpoint {member['checkpoint']})"))
                continue
            stderr.print(styled(f"member {member['pid']} moved to {where['host']}", "green",
                                f": PID {where['pid']}, checkpoint {member['checkpoint']}"))
        stderr.print(styled(f"group {result.group} moved", "green", f": down {result.downtime_ms:.0f} ms, "
                            f"pre-copy rounds sent {', '.join(str(r['new_pages']) for r in result.rounds) or 'none'} "
                            "pages"))
    for member in result.members:
        print(member["destination"]["pid"])
