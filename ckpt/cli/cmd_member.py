import sys
from typing import TextIO

import typer

from ckpt.cli.options import cli_settings

HELP = """The member agent of a group checkpoint (hidden: the coordinator runs it over ssh).

Reads one JSON request per line on stdin (hello, prepare, capture, release, commit, abort; see
docs/design.md, "Groups: the protocol") and answers each with one JSON line on stdout; its
messages go to stderr. End of file on stdin aborts: a held tree is let go, nothing committed.

Examples:

  ssh -T -o BatchMode=yes host-a ckpt _member
"""


class LineReporter:
    """The agent's messages, one plain line each on stderr ("warn: ..."): the coordinator
    relays them, prefixed with the host's name (no status lines or bars over ssh)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def _say(self, kind: str, message: str) -> None:
        try:
            self.stream.write(f"{kind}: {message}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # the channel is gone: the agent notices on stdin

    def step(self, message: str) -> None:
        self._say("step", message)

    def progress(self, done: int, total: int, what: str) -> None:
        pass

    def info(self, message: str) -> None:
        self._say("info", message)

    def warn(self, message: str) -> None:
        self._say("warn", message)


def register(app: typer.Typer) -> None:
    @app.command("_member", help=HELP, hidden=True)
    def member_command() -> None:
        from ckpt.commands.member_agent import MemberAgent

        agent = MemberAgent(cli_settings(), LineReporter(sys.stderr))
        code = agent.serve(sys.stdin.buffer, sys.stdout)
        if code:
            raise typer.Exit(code)
