from typing import Annotated, Optional

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, invocation, shared_flags, store_root
from ckpt.cli.output import emit_json, stdout, styled
from ckpt.commands.check import as_json, check_checkpoint, check_readiness, ready
from ckpt.errors import CkptError, ExitCode

HELP = """Report whether checkpoints can be taken and restored here, and how to fix what is missing.

With REF (a checkpoint ID, name or 'latest'), also whether that checkpoint can be restored on
this host: the files its tree had open or mapped (missing, or of another size, mode or ELF
build id), the CRIU version and the architecture, as 'ckpt restore' checks them before CRIU
runs, each mismatch listed; and whether its TCP connections would come back closed.

Exit code 0 only when dump and restore can work (optional features may be missing). With
-q, only what is not ok is listed.

Examples:

  ckpt check

  ckpt check --json

  ckpt check agent     # before restoring checkpoint 'agent' on this machine
"""


class NotReady(CkptError):
    exit_code = ExitCode.NOT_READY


def register(app: typer.Typer) -> None:
    @app.command("check", help=HELP)
    @shared_flags(REPORTING)
    def check_command(
        ref: Annotated[Optional[str], typer.Argument(
            help="A checkpoint (ID, name or 'latest') to check against this host.")] = None,
        flags: SharedFlags = NO_FLAGS,
    ) -> None:
        reporter = flags.reporter()
        reporter.detail(f"store {store_root(flags.store)}")
        run = invocation()
        findings = check_readiness(store_root(flags.store), run.settings(), run.passwords())
        if ref is not None:
            findings += check_checkpoint(store_root(flags.store), ref, run.settings(), run.passwords())
        if flags.json_out:
            emit_json(as_json(findings))
        else:
            for f in findings:
                if flags.quiet and f.ok:
                    continue
                label, style = ("ok  ", "green") if f.ok else (("FAIL", "red") if f.required else ("warn", "yellow"))
                fix = f"\n       fix: {f.fix}" if f.fix else ""
                stdout.print(styled(label, style, f" {f.name}: {f.detail}{fix}"))
        reporter.close()
        if not ready(findings):
            failed = list(dict.fromkeys(f.name for f in findings if f.required and not f.ok))
            if all(name.startswith("checkpoint ") for name in failed):
                raise NotReady(f"{failed[0]} cannot be restored on this host", hint="see the fixes above")
            raise NotReady(f"dump and restore cannot work here yet ({', '.join(failed)})", hint="see the fixes above")
