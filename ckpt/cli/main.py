"""Entry point: builds the typer app and turns errors into messages and exit codes."""

from __future__ import annotations

import copy
import errno
import getpass
import importlib
import os
import sys
import traceback
from functools import cache
from typing import Any, Callable, Iterable

import typer
from typer._click.exceptions import NoArgsIsHelpError, UsageError as ClickUsageError
from typer.exceptions import Abort, Exit, TyperException

from ckpt import __version__, settings
from ckpt.cli import options
from ckpt.cli.options import DebugOption, PasswordFileOption, use_password_file
from ckpt.errors import DISK_FULL_HINT, CkptError, CriuFailed, DiskFull, ExitCode, UsageError

# Each command's module (ckpt/cli/cmd_*.py), by the name it registers, in the order `ckpt
# --help` lists them: a command line that names one has only that module imported, not every
# command's (which cost each `ckpt dump` 0.13 s). `_member` is hidden: the far end of a group's
# ssh channel.
COMMAND_MODULES = {
    "init": "cmd_init", "check": "cmd_check", "dump": "cmd_dump", "restore": "cmd_restore",
    "migrate": "cmd_migrate", "clone": "cmd_clone", "list": "cmd_list", "show": "cmd_show", "diff": "cmd_diff",
    "rm": "cmd_rm", "verify": "cmd_verify", "forget": "cmd_forget", "prune": "cmd_prune", "copy": "cmd_copy",
    "schedule": "cmd_schedule", "run": "cmd_run", "key": "cmd_key", "journal": "cmd_journal",
    "copy-info": "cmd_copy_info", "cache": "cmd_cache", "_member": "cmd_member",
}
# The root's options that take a value (the command's name is the first word after the others).
ROOT_OPTIONS_WITH_VALUE = {"--password-file"}

TYPER_SETTINGS: dict[str, Any] = dict(
    name="ckpt",
    help="Checkpoint running Linux process trees with CRIU and restore them where they stopped.\n\n"
         "Examples:\n\n"
         "  ckpt check                      # is this machine ready?\n\n"
         "  ckpt dump 4242 --name agent     # checkpoint PID 4242, leave it running\n\n"
         "  ckpt list                       # what is in the store\n\n"
         "  ckpt restore agent              # restore the newest checkpoint named 'agent'",
    no_args_is_help=True,
    add_completion=True,  # ckpt --install-completion (docs/commands.md, "Shell completion")
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_debug = {"on": False}


def _version(value: bool) -> None:
    if value:
        print(f"ckpt {__version__}")
        raise typer.Exit()


def root(
    debug: DebugOption = False,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print ckpt's version and exit."),
    password_file: PasswordFileOption = None,
) -> None:
    # Built once, before the command parses its options: a bad CKPT_* value stops every
    # command here, before anything is frozen or written.
    built = settings.Settings.from_environment()
    options.begin(built, _ask_password if sys.stdin.isatty() else None)
    use_password_file(password_file)
    if debug or built.debug:
        _debug["on"] = True


def build_app(names: Iterable[str] | None = None) -> typer.Typer:
    """The typer app with the commands of `names` (default: every one)."""
    built = typer.Typer(**TYPER_SETTINGS)
    built.callback()(root)
    for name in COMMAND_MODULES if names is None else names:
        importlib.import_module(f"ckpt.cli.{COMMAND_MODULES[name]}").register(built)
    return built


@cache
def whole_app() -> typer.Typer:
    """Every command: help, completion, the manual page, the tests."""
    return build_app()


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole CLI, built when first asked for
        return whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def named_command(args: list[str]) -> str | None:
    """The command a command line names, if it is one of COMMAND_MODULES (its first word that is
    neither an option of the root nor that option's value); None: help, completion, a typo."""
    words = iter(args)
    for word in words:
        if word in ("--", "-h", "--help", "--version"):  # `ckpt --help dump`: the whole help
            return None
        if word in ROOT_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMAND_MODULES else None
    return None


# The root's options that every command takes too, before or after its name: the password
# error says "pass --password-file", and people type it after the command.
GLOBAL_OPTIONS: dict[str, Callable[[Any], None]] = {
    "debug": lambda value: _debug.update(on=True) if value else None,
    "password_file": use_password_file,
}


def command(of: typer.Typer | None = None) -> Any:
    """The click command that main() runs: typer's (of `of`, by default every command's), with
    GLOBAL_OPTIONS on every subcommand."""
    root_command = typer.main.get_command(of or whole_app())
    shared = [p for p in root_command.params if p.name in GLOBAL_OPTIONS]

    def add_to(cmd: Any) -> None:
        for sub in getattr(cmd, "commands", {}).values():
            taken = {p.name for p in sub.params} | {o for p in sub.params for o in p.opts}
            for param in shared:
                if param.name in taken or set(param.opts) & taken:
                    continue  # a command with an option of its own of that name (schedule add, init)
                sub.params.append(_applied_at_parse(param, GLOBAL_OPTIONS[str(param.name)]))
            add_to(sub)

    add_to(root_command)
    _keep_examples_whole(root_command)
    return root_command


def _keep_examples_whole(cmd: Any) -> None:
    """Marks each example paragraph of every help text for click not to rewrap: rewrapped to
    the terminal, an example broke inside a flag ('--keep-' / 'daily 7') and could not be copied."""
    if cmd.help:
        cmd.help = "\n\n".join(f"\b\n{paragraph}" if paragraph.lstrip(" ").startswith("ckpt ") else paragraph
                                for paragraph in cmd.help.split("\n\n"))
    for sub in getattr(cmd, "commands", {}).values():
        _keep_examples_whole(sub)


def _applied_at_parse(param: Any, apply: Callable[[Any], None]) -> Any:
    clone = copy.copy(param)
    clone.expose_value = False

    # Called after the root's callback has made the settings (click invokes a group before it
    # parses its subcommand's options).
    def callback(_ctx: Any, _param: Any, value: Any) -> None:
        apply(value)

    clone.callback = callback
    return clone


def _ask_password(what: str, confirm: bool) -> str:
    text = getpass.getpass(f"{what}: ")
    if confirm and getpass.getpass("again: ") != text:
        raise UsageError("the two passwords differ", hint="type the same password twice")
    return text


def _error(message: str) -> None:
    sys.stderr.write(f"Error: {message}\n")


def main(argv: list[str] | None = None) -> None:
    try:
        name = named_command(sys.argv[1:] if argv is None else argv)
        runs = command(build_app([name]) if name is not None else whole_app())
        result = runs.main(args=argv, prog_name="ckpt", standalone_mode=False)
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except CriuFailed as exc:
        _error(str(exc) if not exc.log_path or exc.log_path in str(exc) else f"{exc} (full log: {exc.log_path})")
        for line in exc.log_lines[-5:-1]:
            sys.stderr.write(f"  criu: {line}\n")
        code = exc.exit_code
    except CkptError as exc:
        _error(str(exc))
        code = exc.exit_code
    except Exit as exc:
        code = exc.exit_code
    except (Abort, KeyboardInterrupt):
        _error("interrupted")
        code = 130
    except NoArgsIsHelpError as exc:  # `ckpt` or `ckpt schedule` alone: the help
        exc.show()
        code = exc.exit_code
    except ClickUsageError as exc:  # bad usage: one line, as every other error, and where to read more
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _error(exc.format_message().rstrip(".") + where)
        code = exc.exit_code
    except TyperException as exc:
        _error(exc.format_message())
        code = exc.exit_code
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # A full disk is never a bug, wherever ckpt met it (docs/commands.md: exit code 1).
            if _debug["on"]:
                traceback.print_exc()
            where = f" ({exc.filename})" if exc.filename else ""
            _error(str(DiskFull(f"no space left on the disk{where}", hint=DISK_FULL_HINT)))
            code = DiskFull.exit_code
        else:  # a bug: say so, with the traceback only on request
            if _debug["on"]:
                traceback.print_exc()
            _error(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback and report it)")
            code = ExitCode.INTERNAL
    finally:
        # main() may run again in this process (tests), with another environment.
        options.end()
        _debug["on"] = False
    sys.exit(int(code))


def run() -> None:
    """The `ckpt` command itself: main(), then an exit that skips the interpreter's teardown.

    Tearing down numpy, protobuf and the loaded index cost a dump 0.15 s after its work was
    done (measured with strace: from the last write to exit_group). Everything that matters is
    finished by then: files and locks are closed by context managers, worker threads joined,
    and output is flushed here. Tests call main(), which exits normally."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more can be said
        code = code or 1
    os._exit(code)
