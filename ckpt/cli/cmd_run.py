from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt.cli.output import CliReporter
from ckpt.cli.options import StoreOption
from ckpt.config import resolve_store_path
from ckpt.retention import parse_duration
from ckpt.store import ids
from ckpt.supervise import RunRequest, Supervisor, default_name

HELP = """Run COMMAND, checkpoint it periodically, and restore it when it dies.

When the command is killed by a signal or exits non-zero, the newest checkpoint is restored
and supervision goes on, up to --max-restores times; a clean exit ends supervision with the
command's status. SIGINT and SIGTERM are forwarded to it. Its output goes to --output (a
terminal or pipe shared with ckpt could not be restored). Events are told on stderr.

Examples:

  ckpt run --every 5m --name agent -- python3 agent.py

  ckpt run --every 2s --max-restores 10 --output /tmp/job.log -- ./long-job --resume
"""


def register(app: typer.Typer) -> None:
    @app.command("run", help=HELP, context_settings={"allow_interspersed_args": False})
    def run_command(
        command: Annotated[list[str], typer.Argument(help="The command and its arguments (after --).")],
        every: Annotated[str, typer.Option("--every", help="Checkpoint period: 30s, 5m, 1h.")] = "5m",
        name: Annotated[Optional[str], typer.Option("--name", help="Checkpoint name [default: the program's].")] = None,
        keep_last: Annotated[int, typer.Option("--keep-last", help="Checkpoints to keep (0: all).")] = 3,
        max_restores: Annotated[int, typer.Option("--max-restores", help="Restores before giving up.")] = 3,
        output: Annotated[Optional[Path], typer.Option("--output", help="File for the command's output "
                                                       "[default: <store>/logs/run-NAME.out].")] = None,
        pre_dump: Annotated[Optional[str], typer.Option("--pre-dump", help="Shell command run before each dump.")] = None,
        post_restore: Annotated[Optional[str], typer.Option("--post-restore",
                                                            help="Shell command run after each restore.")] = None,
        store: StoreOption = None,
    ) -> None:
        store_root = resolve_store_path(store)
        run_name = ids.check_name(name or default_name(command))
        request = RunRequest(command=command, every=parse_duration(every), name=run_name, keep_last=keep_last,
                             max_restores=max_restores,
                             output=(output or store_root / "logs" / f"run-{run_name}.out").absolute(),
                             pre_dump_hook=pre_dump, post_restore_hook=post_restore)
        reporter = CliReporter()
        try:
            code = Supervisor(store_root, request, reporter).run()
        finally:
            reporter.close()
        raise typer.Exit(code)
