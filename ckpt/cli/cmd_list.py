from datetime import datetime

import typer

from ckpt.cli.options import JsonOption, NameFilterOption, QuietOption, StoreOption, VerboseOption, open_store
from ckpt.cli.output import CliReporter, emit_json, human_bytes, print_table, stderr
from ckpt.commands.list import absent_name, list_checkpoints

HELP = """List the checkpoints in the store, oldest first.

Examples:

  ckpt list

  ckpt list --name agent --json
"""


def register(app: typer.Typer) -> None:
    @app.command("list", help=HELP)
    def list_command(
        name: NameFilterOption = None,
        store: StoreOption = None,
        json_out: JsonOption = False,
        quiet: QuietOption = False,
        verbose: VerboseOption = False,
    ) -> None:
        reporter = CliReporter(quiet=quiet, verbose=verbose)
        st = open_store(store, reporter=reporter)
        rows = list_checkpoints(st, name, reporter)
        if json_out:
            emit_json(rows)
            return
        if not rows:
            if quiet:
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
        if quiet:
            return
        stderr.print(f"{len(rows)} checkpoint(s); the store holds {human_bytes(st.total_bytes())} in all "
                     f"(STORED: what each checkpoint added when it was taken)"
                     + (f"; {', '.join(left_out)} left out to fit the terminal ('ckpt list | cat' has all)"
                        if left_out else ""))
