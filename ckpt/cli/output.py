"""Terminal output: data to stdout, messages and progress to stderr."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Literal

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.console import OverflowMethod
from rich.table import Table
from rich.text import Text

from ckpt.errors import UsageError
from ckpt.system.textutil import human_bytes, printable

__all__ = ["human_bytes"]  # sizes for people, one convention (binary units) in the core and here

# NO_COLOR (no-color.org): rich then drops colours but still sends dim and bold; no styling at all.
_COLOR_SYSTEM: Literal["auto"] | None = None if os.environ.get("NO_COLOR") else "auto"


class _Console(Console):
    """rich's Console, but with outlive_reader set (`ckpt run`, by outlive_readers()) a reader
    that goes away does not end the program: rich's default ends it (SystemExit), after moving
    /dev/null onto stdout even when the broken stream is stderr."""

    outlive_reader = False

    def on_broken_pipe(self) -> None:
        if not self.outlive_reader:
            super().on_broken_pipe()
            return
        self.quiet = True
        _to_devnull(self.file)
        raise BrokenPipeError(errno.EPIPE, "the reader of ckpt's output is gone")


def _to_devnull(stream) -> None:
    """/dev/null in place of a stream whose reader is gone: what is still buffered, what ckpt's
    children (hooks, CRIU) and the exit handler write there, is dropped instead of failing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def outlive_readers() -> None:
    """For a command that must go on when the reader of its stdout or stderr exits (`ckpt run
    ... 2>&1 | head -1`): a write there raises BrokenPipeError once (the core's LogReporter and
    event stream drop that reader) and the stream is /dev/null from then on."""
    stderr.outlive_reader = stdout.outlive_reader = True


# No markup: what ckpt prints carries commands, paths and arguments of other programs, and a
# "[/]" in one of them must print as it is, not be read as markup (or fail). Styles are set
# explicitly with styled().
stderr = _Console(stderr=True, highlight=False, markup=False, soft_wrap=not sys.stderr.isatty(),
                  color_system=_COLOR_SYSTEM)
# Piped output is not cut at 80 columns: scripts and pagers get whole lines.
stdout = _Console(highlight=False, markup=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200,
                  color_system=_COLOR_SYSTEM)


def styled(label: str, style: str, rest: str = "") -> Text:
    """label in style, then rest as it is."""
    return Text.assemble((label, style), rest)


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def said_all(rows: list, json_out: bool, when_empty: str) -> bool:
    """Prints the rows as JSON (--json), or when_empty on stderr when there are none. True when
    that was all there is to print; False when the rows are still to be shown as a table."""
    if json_out:
        emit_json(rows)
        return True
    if not rows:
        stderr.print(when_empty)
        return True
    return False


def plain_table(*columns: str, overflow: OverflowMethod = "ellipsis") -> Table:
    """A table with these columns, without borders or padding at its edges (`ckpt ... list`);
    overflow="fold" breaks a long value over lines instead of cutting it."""
    table = Table(box=None, pad_edge=False)
    for column in columns:
        table.add_column(column, overflow=overflow)
    return table


def emit_json_line(data) -> None:
    """One object on one line (JSON Lines), flushed at once: for a stream of events that a
    program reads while the command still runs."""
    try:
        sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        if stdout.outlive_reader:
            _to_devnull(sys.stdout)
        raise


def progress_columns() -> tuple:
    """The progress bar: what, bar, done/total in binary units (as human_bytes), time left."""
    return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TimeRemainingColumn())


class CliReporter:
    """The core's Reporter, drawn on stderr: a status line per step, a bar for long steps."""

    def __init__(self, quiet: bool = False, verbose: bool = False):
        if quiet and verbose:
            raise UsageError("--quiet and --verbose contradict each other", hint="give one of them")
        self.quiet, self.verbose = quiet, verbose
        self._started = time.monotonic()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._what: str | None = None
        # Asked once: each ask is an ioctl that lets go of the interpreter's lock, and a
        # restore's threads report progress hundreds of times (0.06 s of a 100-process restore).
        self._bars = not quiet and stderr.is_terminal

    def _close_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _say(self, message: str) -> None:
        # --verbose: each line with the seconds since the command began (where the time goes).
        when = f" [{time.monotonic() - self._started:.2f}s]" if self.verbose else ""
        stderr.print(styled(f"ckpt:{when}", "dim", f" {message}"))

    def step(self, message: str) -> None:
        self._close_bar()
        if not self.quiet:
            self._say(message)

    def detail(self, message: str) -> None:
        """What only --verbose shows (the store used, a checkpoint's full ID...)."""
        self._close_bar()
        if self.verbose:
            self._say(message)

    def progress(self, done: int, total: int, what: str) -> None:
        if total < (64 << 20) or not self._bars:
            return
        if self._progress is None or self._what != what:
            self._close_bar()
            self._progress = Progress(*progress_columns(), console=stderr, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(what, total=total)
            self._what = what
        if self._task is not None:
            self._progress.update(self._task, completed=done)

    def info(self, message: str) -> None:
        self.step(message)  # told as a step is: -q hides it

    def warn(self, message: str) -> None:
        self._close_bar()
        stderr.print(styled("Warning:", "yellow", f" {message}"))

    def close(self) -> None:
        self._close_bar()
        self.detail("done")


def shorten(text: str, limit: int) -> str:
    """text's first line, cut to limit characters with an ellipsis: for a table cell."""
    line = printable(text.strip().splitlines()[0]) if text.strip() else ""
    return line if len(line) <= limit and "\n" not in text.strip() else line[:limit - 1] + "…"


def terminal_width() -> int | None:
    """The width of the terminal stdout is, None when it is a pipe or a file."""
    return stdout.size.width if stdout.is_terminal else None


def print_table(headers: list[str], rows: list[list[str]], widest: dict[int, int] | None = None,
                shrink: int | None = None, optional: tuple[int, ...] = ()) -> list[str]:
    """A plain aligned table on stdout. Rich's tables take seconds for a thousand rows; this is
    data for people and for `grep`/`awk`, so plain text serves both.

    On a terminal each line fits its width: column `shrink` is shortened (with an ellipsis) down
    to SHRUNK_MIN characters, and when that is not enough the `optional` columns are left out, in
    that order. Piped, lines are whole. Returns the headers of the columns left out."""
    widest = dict(widest or {})
    rows = [[printable(c) for c in row] for row in rows]  # one line per row, whatever a command holds
    shown = list(range(len(headers)))
    width = terminal_width()
    if shrink is not None and width is not None:
        natural = {i: max([len(headers[i])] + [len(r[i]) for r in rows]) for i in shown}
        for column in (None, *optional):
            if column is not None:
                shown.remove(column)
            others = sum(natural[i] + 2 for i in shown if i != shrink)
            if others + min(natural[shrink], SHRUNK_MIN) <= width:
                break
        widest[shrink] = max(width - others, min(natural[shrink], SHRUNK_MIN), len(headers[shrink]))
    cells = [[row[i] if len(row[i]) <= widest.get(i, 10**6) else row[i][:widest[i] - 1] + "…" for i in shown]
             for row in rows]
    titles = [headers[i] for i in shown]
    widths = [max([len(h)] + [len(r[n]) for r in cells]) for n, h in enumerate(titles)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(titles, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    sys.stdout.write("\n".join(lines) + "\n")
    return [h for i, h in enumerate(headers) if i not in shown]


SHRUNK_MIN = 20  # the least of a shortened column that still tells one command from another
