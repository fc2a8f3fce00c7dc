from datetime import datetime

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, NameFilterOption, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, print_table, stderr
from ckpt.commands.list import absent_name, list_checkpoints

HELP = """List the checkpoints in the store, oldest first.

Examples:

  ckpt list

  ckpt list --name agent --json
"""


def register(app: typer.Typer) -> None:
    @app.command("list", help=HELP)
    @shared_flags(REPORTING)
    def list_command(
        name: NameFilterOption = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        st = open_store(flags.store, reporter=reporter)
        rows = list_checkpoints(st, name, reporter)
        if flags.json_out:
            emit_json(rows)
            return
        if not rows:
            if flags.quiet:
                return
            stderr.print(absent_name(st, name) if name else
                         "no checkpoints in the store yet: create one with 'ckpt dump PID'")
            return
        # On a terminal too narrow for all: PROCS, then PID, then CREATED (the ID holds the time, in UTC).
        left_out = print_table(
            ["ID", "NAME", "CREATED", "PID", "COMMAND", "PROCS", "SIZE", "STORED"],
            [[r["id"], r["name"] or "",
              datetime.fromisoformat(r["created"]).astimezone().strftime("%Y-%m-%d %H:%M:%S"),
              str(r["pid"]), r["command"], str(r["processes"]), human_bytes(r["bytes_total"]),
              human_bytes(r["bytes_stored"])] for r in rows],
            shrink=4, optional=(5, 3, 2))
        if flags.quiet:
            return
        stderr.print(f"{len(rows)} checkpoint(s); the store holds {human_bytes(st.objects.total_bytes())} in all "
                     f"(STORED: what each checkpoint added when it was taken)"
                     + (f"; {', '.join(left_out)} left out to fit the terminal ('ckpt list | cat' has all)"
                        if left_out else ""))
