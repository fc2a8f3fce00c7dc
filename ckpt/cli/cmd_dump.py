import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.text import Text

from ckpt.cli.options import (NO_FLAGS, REPORTING, HoldLimitOption, PhaseTimeoutOption, SharedFlags, cli_settings,
                              invocation, shared_flags, store_root, with_members)
from ckpt.cli.output import emit_json, human_bytes, stderr, styled
from ckpt.agent import results
from ckpt.commands.dump import DumpRequest, DumpResult, dump
from ckpt.commands.group import GroupDumpRequest, GroupDumpResult, group_dump, read_members_file
from ckpt.errors import CkptError, ExitCode, UsageError, to_record
from ckpt.store import Origin, ids
from ckpt.store.blocks.segments import CODECS

HELP = """Checkpoint the process tree rooted at PID into the store (several trees as one group).

By default the tree keeps running (a safety snapshot). With --stop it is ended once its
checkpoint is committed (to move it elsewhere). Options real programs need (--shell-job,
--tcp-established, --ext-unix-sk, --file-locks) are detected; the flags force them on or off.
On success stdout carries the new checkpoint's ID alone (with --json, one JSON object).

Examples:

  ckpt dump 4242

  ckpt dump 4242 --name agent --json

  ckpt dump 4242 --stop              # checkpoint, then end the tree

  ckpt dump 4242 --pre-dump 'kill -USR1 $CKPT_PID; sleep 1'   # let it flush first

  ckpt dump 4242 --section-timeout 5   # wait at most 5 s for no_checkpoint() sections

With --group NAME, several trees (PID PID...) are checkpointed as one group: one consistent
cut, every tree frozen (and its TCP connections locked) before any is let go, committed
entirely or not at all; any failure lets every tree run on and leaves nothing. stdout carries
the group's ID; 'ckpt restore NAME' restores every member.

  ckpt dump --group agent 4242 4300            # an agent and its tool server

  ckpt dump --group agent 4242 4300 --stop --json

  ckpt dump --group web 4242 host-b:5151 --store s3://bucket/agents   # 5151 on host-b, over ssh

  ckpt dump --group web --members web.members   # one PID or HOST:PID a line
"""


def _codec(value: str) -> str:
    if value not in CODECS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(CODECS)}")
    return value


PidsArgument = Annotated[Optional[list[str]], typer.Argument(
    metavar="PID...", help="PID of the root of the tree to checkpoint (with --group: of each member, "
                           "HOST:PID for one on another host, reached with ssh).")]
MembersFileOption = Annotated[Optional[Path], typer.Option(
    "--members", metavar="FILE", help="With --group: a file of members, one PID or HOST:PID a line ('#' comments), "
                                      "besides any given as arguments.")]
DirtyTrackingOption = Annotated[bool, typer.Option(
    "--dirty-tracking/--no-dirty-tracking",
    help="On kernels with soft-dirty, read only the pages written since this process's last "
         "checkpoint while it is frozen [default: on where the kernel has it].")]
GroupOption = Annotated[Optional[str], typer.Option(
    "--group", metavar="NAME", help="Checkpoint every PID as one group of this name.")]
PreDumpOption = Annotated[Optional[str], typer.Option(
    "--pre-dump", help="Shell command run before the dump (CKPT_PID, CKPT_ID in its environment); "
                       "if it fails, nothing is dumped.")]
SectionTimeoutOption = Annotated[Optional[float], typer.Option(
    "--section-timeout", metavar="SECONDS", min=0,
    help="How long to wait for the tree's no_checkpoint() sections to end before giving up "
         "(exit 7, nothing frozen) [default: CKPT_SECTION_TIMEOUT, 60].")]
ExtUnixSkOption = Annotated[Optional[bool], typer.Option(
    "--ext-unix-sk/--no-ext-unix-sk",
    help="Save UNIX datagram sockets that send outside the tree (syslog's /dev/log); a restore "
         "connects them to the same path [default: detect].")]


def register(app: typer.Typer) -> None:
    @app.command("dump", help=HELP)
    @shared_flags(REPORTING)
    def dump_command(
        pids: PidsArgument = None,
        name: Annotated[Optional[str], typer.Option("--name",
                                                    help="Label; 'ckpt restore NAME' takes the newest.")] = None,
        stop: Annotated[bool, typer.Option("--stop", help="End the tree after a successful dump.")] = False,
        shell_job: Annotated[Optional[bool], typer.Option("--shell-job/--no-shell-job",
                             help="Tree is a job of a terminal session it does not lead [default: detect].")] = None,
        tcp_established: Annotated[Optional[bool], typer.Option("--tcp-established/--no-tcp-established",
                                   help="Save established TCP connections [default: detect].")] = None,
        ext_unix_sk: ExtUnixSkOption = None,
        file_locks: Annotated[Optional[bool], typer.Option("--file-locks/--no-file-locks",
                              help="Save file locks [default: detect].")] = None,
        dirty_tracking: DirtyTrackingOption = True,
        compression: Annotated[str, typer.Option("--compression", help="zstd, lz4 or none.",
                                                  callback=_codec)] = "zstd",
        pre_dump: PreDumpOption = None,
        section_timeout: SectionTimeoutOption = None,
        group: GroupOption = None,
        members_file: MembersFileOption = None,
        hold_limit: HoldLimitOption = 60.0,
        timeout: PhaseTimeoutOption = 120.0,
        flags: SharedFlags = NO_FLAGS,
        # What ckpt.checkpoint() passes to the dumper it starts (docs/design.md, "Checkpoints a
        # program asks for"); not for people.
        checkpoint_id: Annotated[Optional[str], typer.Option("--id", hidden=True)] = None,
        result_file: Annotated[Optional[str], typer.Option("--result-file", hidden=True)] = None,
    ) -> None:
        pids = _members(pids or [], members_file)
        if group is not None or len(pids) > 1:
            _refuse_for_groups(group, pids, name=name, pre_dump=pre_dump, checkpoint_id=checkpoint_id,
                               result_file=result_file, shell_job=shell_job, tcp_established=tcp_established,
                               ext_unix_sk=ext_unix_sk, file_locks=file_locks, section_timeout=section_timeout)
            _run_group(flags, GroupDumpRequest(members=pids, name=group, stop=stop, hold_limit=hold_limit,
                                               phase_timeout=timeout))
            return
        pid = _single_pid(pids[0])
        answer = _result_file(result_file, checkpoint_id, pid)
        result = _dump(flags, answer, pid=pid, name=name, stop=stop, codec=compression, shell_job=shell_job,
                       tcp_established=tcp_established, ext_unix_sk=ext_unix_sk, file_locks=file_locks,
                       pre_dump_hook=pre_dump, dirty_tracking=dirty_tracking, checkpoint_id=checkpoint_id,
                       section_timeout=section_timeout)
        if answer is not None:
            answer.succeeded(result)
        _show(flags, result, stop)


def _show(flags: SharedFlags, result: DumpResult, stop: bool) -> None:
    if flags.json_out:
        emit_json(result.to_json())
        return
    if not flags.quiet:
        stderr.print(_summary(result.manifest, stop))
    print(result.manifest.id)


def _members(pids: list[str], members_file: Optional[Path]) -> list[str]:
    """The PIDs given, then those of --members; at least one."""
    if members_file is not None:
        pids = pids + read_members_file(members_file)
    if not pids:
        raise UsageError("no PID given", hint="ckpt dump PID, or ckpt dump --group NAME PID PID... (or --members FILE)")
    return pids


def _single_pid(text: str) -> int:
    try:
        return int(text)  # a bad number is refused by the dump, with the others
    except ValueError:
        raise UsageError(f"'{text}' is not a PID", hint="HOST:PID members are for --group") from None


def _refuse_for_groups(group: Optional[str], pids: list[str], **given: Any) -> None:
    if group is None:
        raise UsageError(f"{len(pids)} PIDs need --group NAME", hint="ckpt dump --group NAME PID PID...")
    for option, value in given.items():
        if value is not None:
            raise UsageError(f"--{option.replace('_', '-')} is not taken with --group",
                             hint="a group's members are dumped with the options detected for each")


def _run_group(flags: SharedFlags, request: GroupDumpRequest) -> None:
    result: GroupDumpResult = with_members(flags, group_dump, request, phase_timeout=request.phase_timeout)
    if flags.json_out:
        emit_json(result.to_json())
        return
    if not flags.quiet:
        for line in _group_summary(result):
            stderr.print(line)
    print(result.group.id)


def _group_summary(result: GroupDumpResult) -> list[Text]:
    group = result.group
    first = min(m.frozen_at for m in group.members)
    lines = [styled(f"member {m.host + ':' if m.host else ''}{m.pid}", "green",
                    f": checkpoint {m.checkpoint} ({m.command}), frozen at +{(m.frozen_at - first) * 1000:.1f} ms "
                    f"for {(m.thawed_at - m.frozen_at) * 1000:.1f} ms (CRIU: {m.freeze_ms} ms)"
                    + (", ended" if group.stopped else ""))
             for m in group.members]
    stats = group.stats
    lines.append(styled(f"group {group.id}", "green", f" ({group.name}): {len(group.members)} members, freeze skew "
                        f"{stats['freeze_skew_ms']} ms, first freeze to last thaw {stats['span_ms']} ms"))
    return lines


def _dump(flags: SharedFlags, answer: "Optional[_Answer]", **request: Any) -> DumpResult:
    """The dump; its failure, whatever it is, is told to the program waiting for the result file."""
    reporter = flags.reporter()
    try:
        return dump(store_root(flags.store), DumpRequest(
            **request,
            # --result-file: the dumper that ckpt.checkpoint() started, not a person
            origin=Origin("api" if answer is not None else "dump")), reporter,
            settings=invocation().settings(), passwords=invocation().passwords())
    except BaseException as exc:
        if answer is not None:
            answer.failed(exc)
        raise
    finally:
        reporter.close()


def _summary(m, stop: bool) -> Text:
    ratio = m.stats.get("compression_ratio")
    return styled(f"checkpoint {m.id}", "green", f": {len(m.processes)} process(es), "
                  f"{m.stats.get('pages')} pages ({m.stats.get('pages_new')} new), "
                  f"{human_bytes(m.bytes_stored)} new in the store, "
                  f"{human_bytes(m.stats.get('bytes_dedup'))} deduplicated"
                  + (f", compression {ratio}x" if ratio else "")
                  + _tracking_note(m)
                  + f", frozen {m.stats.get('freeze_ms')} ms, took {m.stats.get('duration_ms')} ms"
                  + (", target ended" if stop else ""))


class _Answer:
    """The result file of a dump that ckpt.checkpoint() asked for: written once, at the end,
    success or failure (the program waits for it), owned by the program's user."""

    def __init__(self, path: Path, checkpoint_id: str, uid: int | None):
        self.path, self.checkpoint_id, self.uid = path, checkpoint_id, uid

    def succeeded(self, result: DumpResult) -> None:
        m = result.manifest
        results.write(self.path, {"id": m.id, "ok": True, "freeze_ms": m.stats.get("freeze_ms"),
                                  "duration_ms": m.stats.get("duration_ms")}, self.uid)

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, CkptError):
            record = {**to_record(exc), "error": str(exc)}
        elif isinstance(exc, KeyboardInterrupt):
            record = {"error": "interrupted", "exit_code": 130}
        else:
            record = {"error": f"internal error: {type(exc).__name__}: {exc}", "exit_code": int(ExitCode.INTERNAL)}
        results.write(self.path, {"id": self.checkpoint_id, "ok": False, **record}, self.uid)


def _result_file(result_file: Optional[str], checkpoint_id: Optional[str], pid: int) -> Optional[_Answer]:
    """--result-file, checked before anything else: it must be <agent dir>/<pid>-<id>.json with
    this dump's --id (a root dumper writes only there)."""
    if result_file is None:
        return None
    if checkpoint_id is None:
        raise UsageError("--result-file needs --id", hint="give the ID the result is for")
    agent_dir = cli_settings().agent_dir
    path = results.check_result_file(Path(result_file), agent_dir, ids.check_id(checkpoint_id))
    try:
        uid: Optional[int] = os.stat(f"/proc/{pid}").st_uid  # the user of the program that waits
    except OSError:
        uid = None
    return _Answer(path, checkpoint_id, uid)


def _tracking_note(manifest) -> str:
    tracking = manifest.criu.get("tracking")
    if not tracking or not tracking.get("parent"):
        return ""
    return (f", {manifest.stats.get('pages_dumped')} dirty pages read while frozen "
            f"({tracking['pages_from_parent']} unchanged since {tracking['parent']})")
