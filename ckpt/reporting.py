"""The interface through which the core reports progress. The core never prints."""

from datetime import datetime, timezone
from typing import Callable, Protocol, TextIO


class Reporter(Protocol):
    def step(self, message: str) -> None:
        """A stage of a long operation begins (shown as a status line)."""

    def progress(self, done: int, total: int, what: str) -> None:
        """Bytes or items done out of total for the current stage."""

    def info(self, message: str) -> None:
        """A fact worth telling the user (not data: data is returned)."""

    def warn(self, message: str) -> None:
        """Something went wrong but the operation goes on."""


class NullReporter:
    def step(self, message: str) -> None:
        pass

    def progress(self, done: int, total: int, what: str) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass


class PrefixedReporter:
    """Tells `reporter` every message after a prefix: the members of a group, the copies of a
    clone, report at once, from threads ("[host-b:4242] ...", "[copy 2/4] ...")."""

    def __init__(self, reporter: Reporter, prefix: str):
        self.reporter, self.prefix = reporter, prefix

    def step(self, message: str) -> None:
        self.reporter.step(self.prefix + message)

    def progress(self, done: int, total: int, what: str) -> None:
        self.reporter.progress(done, total, self.prefix + what)

    def info(self, message: str) -> None:
        self.reporter.info(self.prefix + message)

    def warn(self, message: str) -> None:
        self.reporter.warn(self.prefix + message)


class LogReporter:
    """Tells `reporter` and appends every message, with its time, to `log` (a text file the
    caller opened and closes).

    A reporter that fails with OSError is dropped, and the log says so: its stream went away
    (the reader of a pipe exited: EPIPE; a closed terminal: EIO), and the work it reports on
    must not end with it. `ckpt run` supervises on; its messages go on in the log only."""

    def __init__(self, reporter: Reporter, log: TextIO):
        self.reporter: Reporter | None = reporter
        self.log: TextIO | None = log

    def _write(self, kind: str, message: str) -> None:
        if self.log is None:
            return
        stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        try:
            self.log.write(f"{stamp} {kind}: {message}\n")
            self.log.flush()
        except OSError as exc:  # a full disk: the reporter, if it lives, still shows the messages
            self.log = None
            said = f"cannot write the log any more: {exc}"
            self._call(lambda r: r.warn(said))

    def _call(self, tell: Callable[[Reporter], None]) -> None:
        if self.reporter is None:
            return
        try:
            tell(self.reporter)
        except OSError as exc:
            self.reporter = None
            self._write("warn", f"messages can no longer be shown ({exc.strerror or exc}); they go on in this "
                                "log only")

    def step(self, message: str) -> None:
        self._write("step", message)
        self._call(lambda r: r.step(message))

    def progress(self, done: int, total: int, what: str) -> None:
        self._call(lambda r: r.progress(done, total, what))

    def info(self, message: str) -> None:
        self._write("info", message)
        self._call(lambda r: r.info(message))

    def warn(self, message: str) -> None:
        self._write("warn", message)
        self._call(lambda r: r.warn(message))
