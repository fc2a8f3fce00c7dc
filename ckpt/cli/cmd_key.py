from typing import Annotated, Callable, Optional

import typer
from rich.table import Table

from ckpt.cli.options import JsonOption, StoreOption, invocation, open_store
from ckpt.cli.output import emit_json, stderr, stdout
from ckpt.commands import key as key_commands
from ckpt.errors import UsageError
from ckpt.store import Store, password

HELP = """Manage the passwords of an encrypted store.

Every password opens the same store: adding, removing or changing one rewrites a small key
file, never the checkpoints. The current password (CKPT_PASSWORD, CKPT_PASSWORD_FILE,
--password-file or the terminal) opens the store; the new one comes from --new-password-file
or the terminal.

Examples:

  ckpt key list --store s3://backups/agents

  ckpt key add --new-password-file /root/.ckpt-password-2

  ckpt key remove 3fa9c1d2

  ckpt key passwd --new-password-file /root/.ckpt-password-new
"""

key_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode=None)

NewPasswordFile = Annotated[Optional[str], typer.Option(
    "--new-password-file", metavar="FILE", help="The new password: the first line of FILE (mode 600).")]


def _new_password(path: Optional[str]) -> bytes:
    if path is not None:
        return password.read_password_file(path)
    ask = invocation().ask
    if ask is None:
        raise UsageError("no new password given", hint="pass --new-password-file FILE (or run on a terminal)")
    return ask("new password", True).encode()


@key_app.command("list", help="List the store's keys (one per password).\n\nExamples:\n\n  ckpt key list")
def list_command(store: StoreOption = None, json_out: JsonOption = False) -> None:
    found = key_commands.list_keys(open_store(store))
    if json_out:
        emit_json(found)
        return
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "CURRENT", "CREATED", "HOST", "USER", "KDF"):
        table.add_column(column)
    for key in found:
        table.add_row(key["id"], "*" if key["current"] else "", key["created"][:19].replace("T", " "), key["host"],
                      key["user"], f"{key['kdf']} n={key['n']} r={key['r']} p={key['p']}")
    stdout.print(table)


@key_app.command("add", help="Add a password.\n\nExamples:\n\n  ckpt key add --new-password-file /root/pw2")
def add_command(new_password_file: NewPasswordFile = None, store: StoreOption = None,
                json_out: JsonOption = False) -> None:
    _new_key(key_commands.add_key, new_password_file, store, json_out,
             lambda key_id, location: f"added key {key_id}: the new password opens {location} too")


@key_app.command("remove", help="Remove a password (never the one in use, never the last).\n\n"
                                "Examples:\n\n  ckpt key remove 3fa9c1d2")
def remove_command(key_id: Annotated[str, typer.Argument(help="The key's id (or a unique prefix of 4+).")],
                   store: StoreOption = None, json_out: JsonOption = False) -> None:
    removed = key_commands.remove_key(open_store(store), key_id)
    if json_out:
        emit_json({"removed": removed})
        return
    stderr.print(f"removed key {removed}: its password no longer opens the store")
    print(removed)


@key_app.command("passwd", help="Change the password in use (a new key replaces the current one).\n\n"
                                "Examples:\n\n  ckpt key passwd --new-password-file /root/pw-new")
def passwd_command(new_password_file: NewPasswordFile = None, store: StoreOption = None,
                   json_out: JsonOption = False) -> None:
    _new_key(key_commands.change_password, new_password_file, store, json_out,
             lambda key_id, location: f"changed the password: key {key_id} replaces the one in use")


def _new_key(action: Callable[[Store, bytes], str], new_password_file: Optional[str], store: StoreOption,
             json_out: bool, message: Callable[[str, str], str]) -> None:
    """`key add` and `key passwd`: a new key for a new password, reported the same way."""
    opened = open_store(store)
    key_id = action(opened, _new_password(new_password_file))
    if json_out:
        emit_json({"added": key_id})
        return
    stderr.print(message(key_id, opened.location))
    print(key_id)


def register(app: typer.Typer) -> None:
    app.add_typer(key_app, name="key")
