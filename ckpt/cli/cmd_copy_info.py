import shlex

import typer

from ckpt.agent.identity import copies_dir, read_identity
from ckpt.cli.options import JsonOption, cli_settings
from ckpt.cli.output import emit_json

HELP = """Say which copy of a clone this is (run inside a copy 'ckpt clone' restored).

Prints shell assignments, one a line, for 'eval': CKPT_COPY (1..N), CKPT_COPIES (N),
CKPT_CLONE (the clone's ID), CKPT_CHECKPOINT (the checkpoint the copies were restored from).
Outside a copy (the original, a plain restore) it prints nothing and exits 0. With --json:
the copy's identity as one object (docs/api.md), or null.

Examples:

  eval "$(ckpt copy-info)"; echo "I am copy ${CKPT_COPY:-none}"

  ckpt copy-info --json
"""


def register(app: typer.Typer) -> None:
    @app.command("copy-info", help=HELP)
    def copy_info_command(json_out: JsonOption = False) -> None:
        found = read_identity(copies_dir(cli_settings()))
        if json_out:
            emit_json(found)
            return
        for line in assignments(found):
            print(line)


def assignments(found: dict | None) -> list[str]:
    """The identity as shell assignments (values quoted for the shell); none outside a copy."""
    if found is None:
        return []
    values = {"CKPT_COPY": found["copy"], "CKPT_COPIES": found.get("copies", ""), "CKPT_CLONE": found["clone"],
              "CKPT_CHECKPOINT": found["checkpoint"]}
    return [f"{name}={shlex.quote(str(value))}" for name, value in values.items()]
