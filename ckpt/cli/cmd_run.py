from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpt.cli.options import (NO_FLAGS, REPORTING, SharedFlags, count_flag, duration_flag, output_file_flag,
                              invocation, shared_flags, store_root)
from ckpt.cli.output import emit_json_line, outlive_readers
from ckpt.commands.run import RunRequest, Supervisor, default_name, split_commands
from ckpt.commands.run_group import GroupSupervisor
from ckpt.commands.schedule import destination_spec
from ckpt.schedule.retention import parse_duration
from ckpt.store import ids

HELP = """Run COMMAND, checkpoint it periodically, and restore it when it dies.

The first checkpoint is taken --first-after the start, then one every --every. When the
command is killed by a signal or exits non-zero, the newest checkpoint is restored and
supervision goes on, up to --max-restores times; a tree that dies within a minute of its restore
is restored again only after a pause (1 s, 2 s, 4 s... up to 60 s). A clean exit ends
supervision with the command's status. SIGINT and SIGTERM are forwarded to it. Its output goes
to a file, one per run (a terminal or pipe shared with ckpt could not be restored). Events are
told on stderr and in ckpt's log beside that file; with --json, also on stdout as one JSON
object per line (started, checkpoint, died, restored, exit...; see docs/json.md). ckpt goes on
supervising when the reader of its stdout or stderr goes away (`| head`) and on a hang-up.

Several commands separated by ':::' run as one group: each command its own process
tree, every checkpoint one group checkpoint of all of them (one consistent cut: their
connections to each other come back established), and when any of them dies the others are
ended and the whole group is restored from the newest group checkpoint. A clean exit of any
of them ends the run (the others get SIGTERM, then SIGKILL after 10 s). A separator rather
than a repeated option taking a command string: each command keeps its arguments word for
word, as after '--', with no second level of shell quoting; ':::' because it is the separator
GNU parallel users know and no program takes it as an argument (a command here cannot). A
group run does not take --pre-dump, --post-restore or --copy-to, and its commands get no
CKPT_SOCKET.

Examples:

  ckpt run --every 5m --name agent -- python3 agent.py

  ckpt run --every 1m --name pair -- python3 server.py --port 9000 ::: python3 client.py --port 9000

  ckpt run --every 2s --max-restores 10 --output /tmp/job.log -- ./long-job --resume

  ckpt run --every 1m --json -- python3 agent.py > events.jsonl

  ckpt run --every 5m --copy-to /mnt/backup/ckpt -- python3 agent.py
"""

KeepLastOption = Annotated[int, count_flag("--keep-last", "Checkpoints to keep (0: all).")]
MaxRestoresOption = Annotated[int, count_flag("--max-restores", "Restores before giving up.")]
OutputOption = Annotated[Optional[str], output_file_flag(
    "File the command's output is appended to [default: a new <store>/logs/run-NAME/output-TIME.log "
    "each run].", created_parent=True)]


def register(app: typer.Typer) -> None:
    @app.command("run", help=HELP, context_settings={"allow_interspersed_args": False})
    @shared_flags(REPORTING)
    def run_command(
        command: Annotated[list[str], typer.Argument(
            help="The command and its arguments (after --); several: separated by ':::'.")],
        every: Annotated[str, typer.Option("--every", help="Checkpoint period: 30s, 5m, 1h.")] = "5m",
        first_after: Annotated[str, duration_flag(
            "--first-after", "The first checkpoint, this long after the start (or after --every if sooner).")] = "3s",
        name: Annotated[Optional[str], typer.Option("--name", help="Checkpoint name [default: the program's].")] = None,
        keep_last: KeepLastOption = 3,
        max_restores: MaxRestoresOption = 3,
        output: OutputOption = None,
        pre_dump: Annotated[Optional[str], typer.Option("--pre-dump",
                                                        help="Shell command run before each dump.")] = None,
        post_restore: Annotated[Optional[str], typer.Option("--post-restore",
                                                            help="Shell command run after each restore.")] = None,
        copy_to: Annotated[Optional[str], typer.Option(
            "--copy-to", metavar="STORE",
            help="Copy each checkpoint to this store right after it is taken (a failed copy is tried "
                 "again after the next one; 'ckpt copy --pending' finishes it by hand).")] = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        root = store_root(flags.store)
        first, *also = split_commands(command)
        run_name = ids.check_name(name or default_name(first))
        request = RunRequest(command=first, also=also, every=parse_duration(every),
                             first_after=parse_duration(first_after), name=run_name, keep_last=keep_last,
                             max_restores=max_restores,
                             output=Path(output).absolute() if output else None,
                             pre_dump_hook=pre_dump, post_restore_hook=post_restore,
                             copy_to=destination_spec(copy_to, root) if copy_to else None)
        outlive_readers()  # a supervisor that died with its reader would leave the command unsupervised
        reporter = flags.reporter()
        try:
            supervisor = GroupSupervisor if also else Supervisor
            code = supervisor(root, request, invocation().settings(), reporter,
                              on_event=emit_json_line if flags.json_out else None,
                              passwords=invocation().passwords()).run()
        finally:
            reporter.close()
        raise typer.Exit(code)
