import typer

from ckpt.cli.options import JsonOption, StoreOption, store_root
from ckpt.cli.output import emit_json, stdout, styled
from ckpt.commands.check import as_json, check_readiness, ready
from ckpt.errors import CkptError, ExitCode

HELP = """Report whether checkpoints can be taken and restored here, and how to fix what is missing.

Exit code 0 only when dump and restore can work (optional features may be missing).

Examples:

  ckpt check

  ckpt check --json
"""


class NotReady(CkptError):
    exit_code = ExitCode.NOT_READY


def register(app: typer.Typer) -> None:
    @app.command("check", help=HELP)
    def check_command(store: StoreOption = None, json_out: JsonOption = False) -> None:
        findings = check_readiness(store_root(store))
        if json_out:
            emit_json(as_json(findings))
        else:
            for f in findings:
                label, style = ("ok  ", "green") if f.ok else (("FAIL", "red") if f.required else ("warn", "yellow"))
                fix = f"\n       fix: {f.fix}" if f.fix else ""
                stdout.print(styled(label, style, f" {f.name}: {f.detail}{fix}"))
        if not ready(findings):
            failed = ", ".join(f.name for f in findings if f.required and not f.ok)
            raise NotReady(f"dump and restore cannot work here yet ({failed})", hint="see the fixes above")
