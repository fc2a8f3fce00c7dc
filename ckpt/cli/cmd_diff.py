from typing import Annotated

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stdout
from ckpt.commands.diff import diff

HELP = """Show what changed between two checkpoints: processes, mappings, pages, files, sockets.

Examples:

  ckpt diff 20261130-230102-123-3fa9c1 latest

  ckpt diff agent latest --json
"""


def _fd_text(fd: dict) -> str:
    detail = fd.get("path") or (f"{fd.get('local')} -> {fd.get('remote')} {fd.get('state')}" if "local" in fd else "")
    offset = f" @{fd['offset']}" if "offset" in fd else ""
    return f"fd {fd['fd']} {fd['type']} {detail}{offset}".rstrip()


def register(app: typer.Typer) -> None:
    @app.command("diff", help=HELP)
    @shared_flags(REPORTING)
    def diff_command(
        first: Annotated[str, typer.Argument(help="The older checkpoint (ID, name, latest).")],
        second: Annotated[str, typer.Argument(help="The newer checkpoint.")],
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        result = diff(open_store(flags.store, create=False, reporter=reporter), first, second)
        reporter.detail(f"{first} is checkpoint {result.from_id}, {second} is {result.to_id}")
        if flags.json_out:
            emit_json(result.to_json())
            return
        stdout.print(f"{result.from_id} -> {result.to_id}")
        if result.added or result.removed:
            stdout.print(f"processes: +{result.added} -{result.removed}")
        for p in result.per_process:
            pages, maps = p["pages"], p["mappings"]
            stdout.print(f"PID {p['pid']} {p['command']}")
            stdout.print(f"  pages: {pages['changed']} changed ({human_bytes(pages['bytes_changed'])}), "
                         f"{pages['added']} added, {pages['removed']} removed")
            stdout.print(f"  mappings: {maps['added']} added ({human_bytes(maps['bytes_added'])}), "
                         f"{maps['removed']} removed ({human_bytes(maps['bytes_removed'])}); "
                         f"threads {p['threads']['from']} -> {p['threads']['to']}")
            for fd in p["files"]["opened"]:
                stdout.print(f"  + {_fd_text(fd)}")
            for fd in p["files"]["closed"]:
                stdout.print(f"  - {_fd_text(fd)}")
            for change in p["files"]["changed"]:
                stdout.print(f"  ~ {_fd_text(change['from'])}  =>  {_fd_text(change['to'])}")
