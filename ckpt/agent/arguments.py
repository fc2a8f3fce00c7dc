"""The type checks of what a program passes to the public API (ckpt.checkpoint(), ckpt.journal).

A value of the wrong type is the calling program's bug: TypeError, naming the argument, before
anything is done. Without it a number given as a store became a directory of that name in the
current directory (`checkpoint(store=12345)` wrote `./12345`), and a number as a name failed
deep inside with a regular expression's message.
"""

from __future__ import annotations

import os
from pathlib import Path


def optional_str(value: object, argument: str) -> str | None:
    """value when it is a str or None; otherwise TypeError."""
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{argument} must be a str or None, not {type(value).__name__}")


def optional_store(value: object, argument: str) -> str | Path | None:
    """value when it is a store location (a str: a directory or an s3:// URL; a path object) or
    None; otherwise TypeError. Bytes are refused too: a store's path is text."""
    if value is None or isinstance(value, (str, Path)):
        return value
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        if isinstance(path, str):
            return path
    raise TypeError(f"{argument} must be a directory or s3:// URL (str or path), or None, "
                    f"not {type(value).__name__}")
