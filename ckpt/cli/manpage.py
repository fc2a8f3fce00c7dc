"""ckpt(1), generated from the CLI itself (every command's help, usage and options), so that the
man page can never say something the commands do not: `python -m ckpt.cli.manpage > ckpt.1`.
`make setup` installs it where man finds it."""

from __future__ import annotations

import sys
from datetime import date

from typer._click.core import Command, Context  # typer vendors click (main.py imports from it too)
import typer.main

from ckpt import __version__

SEE_ALSO = "criu(8), crontab(5), systemd.timer(5)"


def _roff(text: str) -> str:
    """Text safe in roff: backslashes doubled, a leading dot or quote escaped, dashes literal."""
    lines = []
    for line in text.replace("\\", "\\e").replace("-", "\\-").splitlines():
        lines.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(lines)


def _paragraphs(text: str) -> str:
    """click's help text (paragraphs apart, examples indented) as roff: indented lines verbatim."""
    out = []
    for block in text.strip().split("\n\n"):
        if block.startswith("  "):
            out.append(".RS 4\n.nf\n" + _roff("\n".join(line.strip() for line in block.splitlines())) + "\n.fi\n.RE")
        else:
            out.append(".PP\n" + _roff(" ".join(line.strip() for line in block.splitlines())))
    return "\n".join(out)


def _options(command: Command, context: Context) -> str:
    out = []
    for param in command.get_params(context):
        record = param.get_help_record(context)
        if record is None or getattr(param, "param_type_name", "") == "argument":
            continue
        names, help_text = record
        out.append(f".TP\n.B {_roff(names)}\n{_roff(help_text)}")
    return "\n".join(out)


def _commands(group, context: Context, prefix: str) -> list[str]:
    """A section per command of group (a typer group: list_commands, get_command), subgroups' too."""
    sections = []
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if command is None or getattr(command, "hidden", False):
            continue
        full = f"{prefix} {name}"
        sub = Context(command, info_name=name, parent=context)
        usage = " ".join(command.collect_usage_pieces(sub))
        sections.append(f".SS {_roff(full)}\n.B {_roff(full)}\n{_roff(usage)}\n"
                        f"{_paragraphs(command.help or '')}\n{_options(command, sub)}")
        if hasattr(command, "list_commands"):
            sections += _commands(command, sub, full)
    return sections


def render() -> str:
    from ckpt.cli.main import app  # the whole CLI, as `ckpt` builds it

    root = typer.main.get_command(app)
    if not hasattr(root, "list_commands"):
        raise TypeError("ckpt's CLI is expected to be a group of commands")
    context = Context(root, info_name="ckpt")
    summary, _, rest = (root.help or "").partition("\n\n")
    return "\n".join([
        f'.TH CKPT 1 "{date.today().isoformat()}" "ckpt {__version__}" "User Commands"',
        ".SH NAME", "ckpt \\- " + _roff(summary.strip()[0].lower() + summary.strip()[1:].rstrip(".")),
        ".SH SYNOPSIS", ".B ckpt", "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION", _paragraphs(rest),
        ".SH OPTIONS", _options(root, context),
        ".SH COMMANDS", *_commands(root, context, "ckpt"),
        ".SH ENVIRONMENT", ".PP", "The CKPT_* settings are listed in docs/commands.md (\"Settings\"); a flag "
        "wins over its variable, which wins over the default.",
        ".SH EXIT STATUS", ".PP", "0 on success; the codes of failures are listed in docs/commands.md "
        "(\"Exit codes\").",
        ".SH SEE ALSO", SEE_ALSO, "",
    ])


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
