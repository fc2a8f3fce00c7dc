"""Terminal output: data to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.text import Text

from ckpt.system.textutil import printable

# No markup: what ckpt prints carries commands, paths and arguments of other programs, and a
# "[/]" in one of them must print as it is, not be read as markup (or fail). Styles are set
# explicitly with styled().
stderr = Console(stderr=True, highlight=False, markup=False, soft_wrap=not sys.stderr.isatty())
# Piped output is not cut at 80 columns: scripts and pagers get whole lines.
stdout = Console(highlight=False, markup=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def styled(label: str, style: str, rest: str = "") -> Text:
    """label in style, then rest as it is."""
    return Text.assemble((label, style), rest)


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def emit_json_line(data) -> None:
    """One object on one line (JSON Lines), flushed at once: for a stream of events that a
    program reads while the command still runs."""
    sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class CliReporter:
    """The core's Reporter, drawn on stderr: a status line per step, a bar for long steps."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._what: str | None = None

    def _close_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def step(self, message: str) -> None:
        self._close_bar()
        if not self.quiet:
            stderr.print(styled("ckpt:", "dim", f" {message}"))

    def progress(self, done: int, total: int, what: str) -> None:
        if self.quiet or not stderr.is_terminal or total < (64 << 20):
            return
        if self._progress is None or self._what != what:
            self._close_bar()
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TimeRemainingColumn(), console=stderr, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(what, total=total)
            self._what = what
        if self._task is not None:
            self._progress.update(self._task, completed=done)

    def info(self, message: str) -> None:
        self._close_bar()
        if not self.quiet:
            stderr.print(styled("ckpt:", "dim", f" {message}"))

    def warn(self, message: str) -> None:
        self._close_bar()
        stderr.print(styled("Warning:", "yellow", f" {message}"))

    def close(self) -> None:
        self._close_bar()


def print_table(headers: list[str], rows: list[list[str]], widest: dict[int, int] | None = None) -> None:
    """A plain aligned table on stdout. Rich's tables take seconds for a thousand rows; this is
    data for people and for `grep`/`awk`, so plain text serves both."""
    widest = widest or {}
    rows = [[printable(c) for c in row] for row in rows]  # one line per row, whatever a command holds
    cells = [[c if len(c) <= widest.get(i, 10**6) else c[:widest[i] - 1] + "…" for i, c in enumerate(row)]
             for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    sys.stdout.write("\n".join(lines) + "\n")
