from typing import Annotated

import typer
from rich.text import Text
from rich.tree import Tree

from ckpt.agent.identity import copies_dir
from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, cli_settings, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, print_table, stdout
from ckpt.commands.show import CheckpointDescription, GroupDescription, inspect
from ckpt.restore.lazywatch import describe
from ckpt.store import Origin
from ckpt.store.groups import GroupManifest

HELP = """Show what a checkpoint holds: process tree, threads, memory, open files and sockets.

Of a group checkpoint (its name or ID): its members (checkpoint, host, PID, command, when each
was frozen, dumped and let go) and how close together they were frozen.

Examples:

  ckpt show latest

  ckpt show agent --json

  ckpt show my-group
"""


def _fd_line(fd: dict) -> str:
    kind = fd["type"]
    if kind == "file":
        return f"fd {fd['fd']}: {fd['path']} (offset {fd['offset']})"
    if kind in ("tcp", "udp"):
        return f"fd {fd['fd']}: {kind} {fd['local']} -> {fd['remote']} {fd['state']}"
    if kind == "unix":
        return f"fd {fd['fd']}: unix socket {fd['path'] or '(unnamed)'}"
    return f"fd {fd['fd']}: {kind}"


def register(app: typer.Typer) -> None:
    @app.command("show", help=HELP)
    @shared_flags(REPORTING)
    def show_command(
        ref: Annotated[str, typer.Argument(help="Checkpoint or group checkpoint: ID, name, or 'latest'.")],
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        described = inspect(open_store(flags.store, create=False, reporter=reporter), ref,
                            copies_dir=copies_dir(cli_settings()))
        if isinstance(described, GroupDescription):
            if flags.json_out:
                emit_json(described.to_json())
            else:
                _print_group(described.group)
            return
        reporter.detail(f"{ref} is checkpoint {described.manifest.id}")
        for failure in described.lazy_restore_failures:
            reporter.warn(f"{describe(failure)} ({failure.get('time', '?')})")
        if flags.json_out:
            emit_json(described.to_json())
        else:
            _print_checkpoint(described)


def _print_checkpoint(described: CheckpointDescription) -> None:
    data = described.to_json()  # what follows shows the --json form, field by field
    stats = data.get("stats", {})
    stdout.print(f"checkpoint {data['id']}" + (f" ({data['name']})" if data.get("name") else ""))
    stdout.print(f"  created {data['created']} on {data['host']} with CRIU {data['criu'].get('version')}")
    origin = Origin.from_json(data.get("origin"))
    stdout.print(f"  made by {origin.describe() if origin else 'an older ckpt, which did not record by what'}")
    if described.group is not None:
        stdout.print(f"  a member of group checkpoint {described.group.label}, with "
                     f"{len(described.group.members) - 1} other member(s) (see 'ckpt show {described.group.id}')")
    stdout.print(f"  images {human_bytes(data['bytes_total'])}, stored {human_bytes(data['bytes_stored'])}, "
                 f"frozen {stats.get('freeze_ms')} ms")
    opts = [k for k, v in data["criu"].get("options", {}).items() if v is True]
    stdout.print(f"  options: {', '.join(opts) or 'none'}")
    for pipe in data["criu"].get("external_pipes", []):
        peer = pipe.get("peer") or "a process outside the tree"
        verb = "writes into" if pipe["end"] == "write" else "reads from"
        stdout.print(f"  PID {pipe['pid']} fd {pipe['fd']} {verb} a pipe to {peer} (restore --output)")
    for sock in data["criu"].get("external_sockets", []):
        peer = sock.get("peer") or "a process outside the tree"
        stdout.print(f"  PID {sock['pid']} fd {sock['fd']} is a UNIX stream socket connected to {peer} "
                     "(restore --output)")
    for sock in data["criu"].get("external_datagram_sockets", []):
        holder = f" ({sock['peer']})" if sock.get("peer") else ""
        stdout.print(f"  PID {sock['pid']} fd {sock['fd']} sends datagrams to "
                     f"{sock.get('peer_path') or 'an unnamed socket'}{holder} (connected again on restore)")
    tree = Tree("processes")
    nodes: dict[int, Tree] = {}
    for proc in data["processes"]:
        label = (f"{proc['pid']} {proc['command']}  [{len(proc['threads'])} thread(s), "
                 f"{proc['mappings']} mappings, {human_bytes(proc['mapped_bytes'])} mapped, "
                 f"{proc['pages']} pages dumped]")
        parent = nodes.get(proc["ppid"], tree)
        node = parent.add(Text(label))
        nodes[proc["pid"]] = node
        for fd in proc["fds"]:
            node.add(Text(_fd_line(fd)))
    stdout.print(tree)
    _print_running_copies(data["running_copies"])


def _print_running_copies(copies: list[dict]) -> None:
    if not copies:
        return
    stdout.print(f"running copies ({len(copies)})")
    for c in copies:
        where = f", network namespace {c['netns']} address {c['address']}" if c["netns"] else ", host network"
        stdout.print(f"  copy {c['index']} of clone {c['clone']}: root PID {c['pid']} ({c['pid_in_namespace']} "
                     f"in its namespace), init PID {c['init_pid']}{where}")


def _print_group(group: GroupManifest) -> None:
    """The group, then a row per member; times in ms from the group's first freeze."""
    stats = group.stats
    stdout.print(f"group checkpoint {group.label}")
    stdout.print(f"  created {group.created}, made by {group.origin.describe() if group.origin else 'unknown'}"
                 + (", every member ended after the checkpoint (--stop)" if group.stopped else ""))
    stdout.print(f"  {len(group.members)} member(s) on {', '.join(group.hosts)}; freeze skew "
                 f"{stats.get('freeze_skew_ms')} ms, span {stats.get('span_ms')} ms, longest freeze "
                 f"{stats.get('longest_freeze_ms')} ms; member times in ms from the first freeze")
    start = min((m.frozen_at for m in group.members), default=0.0)

    def since(moment: float) -> str:
        return f"+{(moment - start) * 1000:.1f}"

    print_table(["CHECKPOINT", "HOST", "PID", "COMMAND", "FROZEN", "DUMPED", "THAWED", "FREEZE_MS"],
                [[m.checkpoint, m.hostname or m.host or "(this host)", str(m.pid), m.command, since(m.frozen_at),
                  since(m.dumped_at), since(m.thawed_at), "" if m.freeze_ms is None else str(m.freeze_ms)]
                 for m in group.members], shrink=3)
