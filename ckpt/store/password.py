"""The password of an encrypted store: CKPT_PASSWORD, else the first line of CKPT_PASSWORD_FILE
(or --password-file), else a prompt on the terminal when there is one.

A PasswordSource holds the three and is passed to what opens a store (ckpt/store/opening.py).
The prompt is the CLI's (passed in as `ask`); the core never talks to the terminal itself. A
password is bytes from here on and is never logged or put in an error message.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ckpt.settings import Settings
from ckpt.errors import PasswordNeeded, UsageError
from ckpt.store.fsutil import owner_name

@dataclass(frozen=True)
class PasswordSource:
    """Where the passwords of encrypted stores come from, in this order: the password itself
    (CKPT_PASSWORD), the first line of a file (CKPT_PASSWORD_FILE or --password-file), a prompt
    on the terminal. Passed to what opens a store, so the core has no hidden input."""

    password: str | None = field(default=None, repr=False)
    password_file: Path | None = None
    ask: Callable[[str, bool], str] | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, current: Settings, ask: Callable[[str, bool], str] | None = None) -> PasswordSource:
        return cls(current.password, current.password_file, ask)

    @classmethod
    def passed_or_settings(cls, passed: PasswordSource | None, current: Settings) -> PasswordSource:
        """The source a caller passed, else the settings' own (CKPT_PASSWORD, CKPT_PASSWORD_FILE;
        no prompt: only the CLI has a terminal to ask on)."""
        return passed if passed is not None else cls.from_settings(current)

    def password_for(self, location: str, confirm: bool = False) -> bytes:
        """The password of the store at location; PasswordNeeded when none is given anywhere."""
        if self.password:
            return self.password.encode()
        if self.password_file is not None:
            return read_password_file(self.password_file)
        if self.ask is not None:
            text = self.ask(f"password of the store at {location}", confirm)
            if not text:
                raise UsageError("an empty password", hint="type the store's password")
            return text.encode()
        raise PasswordNeeded(f"the store at {location} is encrypted and no password was given",
                             hint="set CKPT_PASSWORD or CKPT_PASSWORD_FILE (or pass --password-file)")


def read_password_file(path: str | os.PathLike) -> bytes:
    """The first line of the file, without its line break. A file others may read, or that
    belongs to another user, is refused: whoever reads it can read every checkpoint, and the
    file's owner can read it or change the password to one they know."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            data = f.read(64 << 10)
    except OSError as exc:
        raise UsageError(f"cannot read the password file {path}: {exc.strerror}",
                         hint="give a readable file with --password-file or CKPT_PASSWORD_FILE") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"the password file {path} is not a regular file", hint="give a file holding the password")
    me = os.geteuid()
    if info.st_uid != me:
        raise UsageError(f"the password file {path} belongs to {owner_name(info.st_uid)}, not to {owner_name(me)} "
                         "who runs ckpt: its owner can read the password",
                         hint=f"chown {owner_name(me)} {path}, or give a file of yours")
    if info.st_mode & 0o077:
        raise UsageError(f"the password file {path} can be read by others (mode {stat.S_IMODE(info.st_mode):o})",
                         hint=f"chmod 600 {path}")
    line = data.split(b"\n", 1)[0].rstrip(b"\r")
    if not line:
        raise UsageError(f"the password file {path} starts with an empty line",
                         hint="put the password on its first line")
    return line
