import json
from typing import Annotated, Optional

import typer

from ckpt.cli.options import DryRunOption, JsonOption, QuietOption, StoreOption, VerboseOption, open_store
from ckpt.cli.output import CliReporter, emit_json, plain_table, said_all, stderr, stdout
from ckpt.commands import journal as journal_commands

HELP = """Look at and remove the records of the journal of irreversible actions (ckpt.journal).

An agent's records (one per action: an intent, then its outcome) keep a copy restored from one
of its checkpoints from doing an action again; they are kept per agent, named like its
checkpoints, in the store. `ckpt prune` removes those no checkpoint needs any more.

Examples:

  ckpt journal list

  ckpt journal show poster

  ckpt journal rm poster post-step-3 --dry-run
"""

journal_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode=None)

AgentArgument = Annotated[str, typer.Argument(metavar="AGENT", help="The agent: the name of its checkpoints.")]
KeysArgument = Annotated[Optional[list[str]], typer.Argument(metavar="[KEY]...",
                                                             help="Only the records of these keys.")]


def _time(text: Optional[str]) -> str:
    return text[:19].replace("T", " ") if text else "-"


def _outcome(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@journal_app.command("list", help="List the agents that have records: how many, how many are only intents (started, "
                                  "outcome never recorded), the newest, and the agent's checkpoints.\n\n"
                                  "Examples:\n\n  ckpt journal list\n\n  ckpt journal list --json --store /srv/ckpt")
def list_command(store: StoreOption = None, json_out: JsonOption = False) -> None:
    rows = journal_commands.list_agents(open_store(store))
    if said_all(rows, json_out, "no journal records in the store"):
        return
    table = plain_table("AGENT", "RECORDS", "DONE", "INTENTS", "NEWEST", "CHECKPOINTS")
    for row in rows:
        table.add_row(row["agent"], str(row["records"]), str(row["done"]), str(row["intents"]), _time(row["newest"]),
                      str(row["checkpoints"]))
    stdout.print(table)


@journal_app.command("show", help="Show an agent's records, oldest first: key, state (done, or intent: started, "
                                  "outcome never recorded), when, outcome.\n\n"
                                  "Examples:\n\n  ckpt journal show poster\n\n  ckpt journal show poster post-step-3 "
                                  "--json")
def show_command(agent: AgentArgument, keys: KeysArgument = None, store: StoreOption = None,
                 json_out: JsonOption = False) -> None:
    records = journal_commands.show(open_store(store), agent, keys).to_json()
    if said_all(records, json_out, f"no records of agent {agent}"):
        return
    table = plain_table("KEY", "STATE", "TIME", "OUTCOME", overflow="fold")
    for record in records:
        table.add_row(record["key"], record["state"], _time(record["time"]),
                      _outcome(record["outcome"]) if record["state"] == "done" else "")
    stdout.print(table)


RM_HELP = """Remove an agent's records: all of them, or those of the keys given.

Its next run then does those actions again (a second run of an agent skips what its journal
says was done). Refused when a remaining checkpoint of the agent may need a record (a copy
restored from it would do that action again) unless --force. Prints each removed key.

Examples:

  ckpt journal rm poster --dry-run

  ckpt journal rm poster post-step-3 post-step-4

  ckpt journal rm poster --force
"""


@journal_app.command("rm", help=RM_HELP)
def rm_command(
    agent: AgentArgument,
    keys: KeysArgument = None,
    store: StoreOption = None,
    dry_run: DryRunOption = False,
    force: Annotated[bool, typer.Option("--force", help="Remove records a checkpoint of the agent may still "
                                                        "need.")] = False,
    json_out: JsonOption = False,
    quiet: QuietOption = False,
    verbose: VerboseOption = False,
) -> None:
    reporter = CliReporter(quiet=quiet, verbose=verbose)
    result = journal_commands.remove(open_store(store, reporter=reporter), agent, keys, dry_run=dry_run, force=force,
                                     reporter=reporter)
    if json_out:
        emit_json(result)
        return
    if not quiet:
        stderr.print(f"{'would remove' if dry_run else 'removed'} {len(result['removed'])} record(s) of agent {agent}")
    for record in result["removed"]:
        print(record["key"])


def register(app: typer.Typer) -> None:
    app.add_typer(journal_app, name="journal")
