"""Resolves settings: command-line flag > CKPT_* environment variable > default."""

import os
from pathlib import Path

ENV_STORE = "CKPT_STORE"
ENV_CRIU = "CKPT_CRIU"


def default_store_path() -> Path:
    """`/var/lib/ckpt` for root, `$XDG_DATA_HOME/ckpt` (or ~/.local/share/ckpt) otherwise."""
    if os.geteuid() == 0:
        return Path("/var/lib/ckpt")
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "ckpt"


def resolve_store_path(flag: str | Path | None) -> Path:
    if flag:
        return Path(flag).expanduser().absolute()
    env = os.environ.get(ENV_STORE)
    if env:
        return Path(env).expanduser().absolute()
    return default_store_path()


def criu_binary_override() -> str | None:
    return os.environ.get(ENV_CRIU) or None
