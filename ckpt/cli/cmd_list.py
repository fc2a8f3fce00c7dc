from datetime import datetime

import typer

from ckpt.agent.identity import copies_dir
from ckpt.cli.options import (NO_FLAGS, REPORTING, NameFilterOption, SharedFlags, cli_settings, open_store,
                              shared_flags)
from ckpt.cli.output import emit_json, human_bytes, print_table, stderr
from ckpt.commands.list import absent_name, list_checkpoints

HELP = """List the checkpoints in the store, oldest first.

A group checkpoint is one entry (its ID, name, members, hosts and freeze skew) with its
members indented beneath it.

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
        rows = list_checkpoints(st, name, reporter, copies_dir(cli_settings()))
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
        left_out = print_table(["ID", "NAME", "CREATED", "PID", "COMMAND", "PROCS", "SIZE", "STORED"],
                               _table(rows), shrink=4, optional=(5, 3, 2))
        _print_running_copies(rows)
        if flags.quiet:
            return
        group_count = len({r["group"]["id"] for r in rows if r["group"]})
        stderr.print(f"{len(rows)} checkpoint(s)"
                     + (f" ({group_count} group checkpoint(s), their members indented)" if group_count else "")
                     + f"; the store holds {human_bytes(st.objects.total_bytes())} in all "
                     f"(STORED: what each checkpoint added when it was taken)"
                     + (f"; {', '.join(left_out)} left out to fit the terminal ('ckpt list | cat' has all)"
                        if left_out else ""))


def _print_running_copies(rows: list[dict]) -> None:
    """A line per checkpoint that clones run copies of, under the table (on stdout: data)."""
    for r in rows:
        if r["running_copies"]:
            copies = r["running_copies"]
            clones = sorted({c["clone"] for c in copies})
            print(f"{r['id']}: {len(copies)} running cop{'y' if len(copies) == 1 else 'ies'} "
                  f"(clone {', '.join(clones)}): " + ", ".join(f"copy {c['index']} PID {c['pid']}" for c in copies))


def _when(created: str) -> str:
    return datetime.fromisoformat(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[dict]) -> list[list[str]]:
    """A row per checkpoint, oldest first; a group checkpoint as one row where its first member
    would be, its members indented beneath it."""
    members: dict[str, list[dict]] = {}
    for r in rows:
        if r["group"]:
            members.setdefault(r["group"]["id"], []).append(r)
    table = []
    for r in rows:
        group = r["group"]
        if group is None:
            table.append(_checkpoint_row(r))
        elif members[group["id"]][0] is r:
            table.append(_group_row(group, members[group["id"]]))
            table += [_checkpoint_row(m, indent="  ") for m in members[group["id"]]]
    return table


def _checkpoint_row(r: dict, indent: str = "") -> list[str]:
    return [indent + r["id"], r["name"] or "", _when(r["created"]), str(r["pid"]), r["command"], str(r["processes"]),
            human_bytes(r["bytes_total"]), human_bytes(r["bytes_stored"])]


def _group_row(group: dict, members: list[dict]) -> list[str]:
    skew = group["stats"].get("freeze_skew_ms")
    what = (f"group: {group['members']} members on {', '.join(group['hosts'])}"
            + (f", freeze skew {skew} ms" if skew is not None else ""))
    return [group["id"], group["name"] or "", _when(group["created"]), "-", what,
            str(sum(m["processes"] for m in members)), human_bytes(sum(m["bytes_total"] for m in members)),
            human_bytes(sum(m["bytes_stored"] for m in members))]
