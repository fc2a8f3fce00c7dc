"""The interface through which the core reports progress. The core never prints."""

from typing import Protocol


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
