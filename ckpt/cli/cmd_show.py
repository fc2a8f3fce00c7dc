from typing import Annotated

import typer
from rich.text import Text
from rich.tree import Tree

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stdout
from ckpt.commands.show import inspect
from ckpt.restore.lazywatch import describe
from ckpt.store import Origin

HELP = """Show what a checkpoint holds: process tree, threads, memory, open files and sockets.

Examples:

  ckpt show latest

  ckpt show agent --json
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
        ref: Annotated[str, typer.Argument(help="Checkpoint ID, name, or 'latest'.")],
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        described = inspect(open_store(flags.store, create=False, reporter=reporter), ref)
        reporter.detail(f"{ref} is checkpoint {described.manifest.id}")
        for failure in described.lazy_restore_failures:
            reporter.warn(f"{describe(failure)} ({failure.get('time', '?')})")
        data = described.to_json()  # what follows shows the --json form, field by field
        if flags.json_out:
            emit_json(data)
            return
        stats = data.get("stats", {})
        stdout.print(f"checkpoint {data['id']}" + (f" ({data['name']})" if data.get("name") else ""))
        stdout.print(f"  created {data['created']} on {data['host']} with CRIU {data['criu'].get('version')}")
        origin = Origin.from_json(data.get("origin"))
        stdout.print(f"  made by {origin.describe() if origin else 'an older ckpt, which did not record by what'}")
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
