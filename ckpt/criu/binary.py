"""Finding the CRIU binary and its version (no pycriu needed: keeps `ckpt list` fast)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ckpt.settings import Settings
from ckpt.errors import CriuUnavailable

MIN_VERSION = (4, 0)
# /usr/local/sbin first: `make setup` installs a source-built CRIU there on Debian 12, whose own
# /usr/sbin/criu (3.17) may also be present and fails on recent kernels. Cron's bare PATH lacks
# /usr/local/sbin, so the list does not rely on PATH alone.
CANDIDATES = ("/usr/local/sbin/criu", "/usr/local/bin/criu", "/usr/sbin/criu", "/usr/bin/criu")


@dataclass(frozen=True)
class CriuBinary:
    path: str
    version: tuple[int, ...]
    version_text: str
    # The settings that go with the binary wherever it is used (ckpt.settings: CKPT_CRIU_LOG_LEVEL,
    # CKPT_FEATURE_CACHE); None: no cache of the kernel's features (each check runs CRIU).
    log_level: int = 3
    feature_cache: Path | None = None


def read_version(path: str) -> tuple[tuple[int, ...], str] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^Version:\s*(\S+)", out, re.M)
    if not match:
        return None
    text = match.group(1)
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3]), text


def find_criu(settings: Settings) -> CriuBinary:
    """The first CRIU >= 4.0 found: $CKPT_CRIU, then the usual places, then PATH."""
    override = settings.criu
    if override:
        candidates = [override]
    else:
        candidates = [c for c in CANDIDATES if os.path.exists(c)]
        on_path = shutil.which("criu")
        if on_path and os.path.realpath(on_path) not in map(os.path.realpath, candidates):
            candidates.append(on_path)
    too_old = []
    for path in candidates:
        found = read_version(path)
        if found is None:
            continue
        version, text = found
        if version >= MIN_VERSION:
            return CriuBinary(os.path.abspath(path), version, text, settings.criu_log_level,
                              settings.feature_cache)
        too_old.append(f"{path} is {text}")
    if too_old:
        raise CriuUnavailable(f"CRIU is too old ({'; '.join(too_old)}); ckpt needs 4.0 or newer",
                              hint="run 'make setup' to build a current CRIU into /usr/local/sbin")
    if override:
        raise CriuUnavailable(f"CKPT_CRIU={override} is not a working CRIU binary",
                              hint="point CKPT_CRIU at a CRIU >= 4.0 or unset it")
    raise CriuUnavailable("CRIU is not installed", hint="run 'make setup' (it installs CRIU >= 4.0)")
