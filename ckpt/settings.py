"""ckpt's settings: one frozen object, built from flag > CKPT_* environment variable > default.

Built once at the edge, where ckpt meets its environment: by the CLI for each command
(ckpt/cli/options.py, Invocation), or by the agent API in the program's own process; and passed
down as an argument from there to whatever needs a value: the core never reads the environment
(tests/unit/test_architecture.py keeps it so). Every value is checked when the object is built,
so a bad one stops ckpt with a one-line usage error (exit 2) before anything is frozen or
written, instead of a traceback or a silent fallback to the default.

Each field names its environment variable in its metadata; docs/commands.md has a table of them
(tests/unit/test_settings.py checks that the two agree). This is the only module that reads
the environment for ckpt's own settings (hooks.py passes an environment *to* hooks).
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ckpt.errors import UsageError

STAGING_CHOICES = ("auto", "disk", "ram")
SCHEDULER_CHOICES = ("auto", "systemd", "cron")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def default_store_path(environ: Mapping[str, str] | None = None) -> Path:
    """`/var/lib/ckpt` for root, `$XDG_DATA_HOME/ckpt` (or ~/.local/share/ckpt) otherwise."""
    if os.geteuid() == 0:
        return Path("/var/lib/ckpt")
    xdg = (os.environ if environ is None else environ).get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "ckpt"


def default_cache_path(environ: Mapping[str, str] | None = None) -> Path:
    """`/var/cache/ckpt` for root, `$XDG_CACHE_HOME/ckpt` (or ~/.cache/ckpt) otherwise."""
    if os.geteuid() == 0:
        return Path("/var/cache/ckpt")
    xdg = (os.environ if environ is None else environ).get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "ckpt"


# A store is a local directory or an s3:// URL (kept as text: Path would fold "s3://" to "s3:/").
StoreLocation = Path | str


def is_remote(location: StoreLocation) -> bool:
    return isinstance(location, str) and location.startswith("s3://")


# ---- parsers: (variable, raw text) -> value, or a UsageError naming both ----------------------

def _bad(variable: str, raw: str, what: str, example: str) -> UsageError:
    return UsageError(f"{variable}={raw!r} is not {what}", hint=f"unset it or set e.g. {example}")


def _path(variable: str, raw: str) -> Path:
    # Absolute now: cron runs ckpt from $HOME, a page server from /, and a relative path
    # would name another place there.
    return Path(raw).expanduser().absolute()


def _store_location(variable: str, raw: str) -> StoreLocation:
    if "://" in raw:
        if not raw.startswith("s3://"):
            raise _bad(variable, raw, "a directory or an s3://BUCKET/PREFIX URL", "s3://backups/ckpt")
        # The bucket and prefix are checked when the store is opened (backends/s3.py parse_url).
        bucket, _, prefix = raw[len("s3://"):].partition("/")
        if not bucket:
            raise _bad(variable, raw, "an s3://BUCKET/PREFIX URL with a bucket", "s3://backups/ckpt")
        prefix = prefix.strip("/")
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return _path(variable, raw)


def _cache_size(variable: str, raw: str) -> str:
    # The cap's syntax; its bytes are worked out when a store is opened (a share of the cache's
    # filesystem): backends/cache.py cache_bytes.
    text = raw.strip().upper().removesuffix("B").removesuffix("I")
    number = text[:-1] if text[-1:] in ("%", "K", "M", "G", "T") else text
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (text.endswith("%") and value > 100):
        raise _bad(variable, raw, "a size (512M, 20G) or a share of the cache's filesystem (10%)", "20G")
    return raw.strip()


def _seconds(above_zero: bool, example: str) -> Callable[[str, str], float]:
    def parse(variable: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise _bad(variable, raw, "a number of seconds", example)
        if value < 0 or (above_zero and value == 0):
            raise _bad(variable, raw, "a number of seconds above 0" if above_zero else "0 or more seconds", example)
        return value
    return parse


def _whole(low: int, high: int | None, what: str, example: str) -> Callable[[str, str], int]:
    def parse(variable: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise _bad(variable, raw, what, example) from None
        if value < low or (high is not None and value > high):
            raise _bad(variable, raw, what, example)
        return value
    return parse


def _choice(choices: tuple[str, ...], example: str) -> Callable[[str, str], str]:
    def parse(variable: str, raw: str) -> str:
        if raw not in choices:
            raise _bad(variable, raw, f"one of {', '.join(choices)}", example)
        return raw
    return parse


def _text(variable: str, raw: str) -> str:
    return raw


def _command(example: str) -> Callable[[str, str], str]:
    # Kept as the text the user wrote; split as a shell would (shlex) where it is run.
    def parse(variable: str, raw: str) -> str:
        try:
            words = shlex.split(raw)
        except ValueError:
            words = []
        if not words:
            raise _bad(variable, raw, "a command (words split as a shell would)", example)
        return raw
    return parse


def _switch(variable: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise _bad(variable, raw, "1 or 0", "1")


def _env(variable: str, parse: Callable[[str, str], object]) -> dict:
    return {"env": variable, "parse": parse}


@dataclass(frozen=True)
class Settings:
    """Every setting of ckpt, with its documented default (docs/commands.md, 'Settings'). Build it
    with from_environment()."""

    # The store; --store wins (store_from_flag).
    store: StoreLocation = field(default_factory=default_store_path, metadata=_env("CKPT_STORE", _store_location))
    # The local side of remote stores (staging, logs, schedules) and their cache of blobs.
    cache: Path = field(default_factory=default_cache_path, metadata=_env("CKPT_CACHE", _path))
    # The cap of that cache (all remote stores together): bytes (20G) or a share of its filesystem.
    cache_size: str = field(default="10%", metadata=_env("CKPT_CACHE_SIZE", _cache_size))
    # The password of encrypted stores, or a file holding it (its first line). Never printed.
    password: str | None = field(default=None, repr=False, metadata=_env("CKPT_PASSWORD", _text))
    password_file: Path | None = field(default=None, metadata=_env("CKPT_PASSWORD_FILE", _path))
    # A CRIU binary to use instead of the first CRIU >= 4.0 found (criu/binary.py).
    criu: str | None = field(default=None, metadata=_env("CKPT_CRIU", _text))
    # 3: errors, warnings, info; 4: CRIU's debug trace, which costs a large dump ~5% of its freeze.
    criu_log_level: int = field(default=3, metadata=_env(
        "CKPT_CRIU_LOG_LEVEL", _whole(0, 4, "a log level from 0 to 4", "4")))
    # Seconds to wait for a store another ckpt holds.
    lock_timeout: float = field(default=60.0, metadata=_env("CKPT_LOCK_TIMEOUT", _seconds(False, "60")))
    # Seconds a lock object of a store in S3 stays live without being refreshed (its holder
    # refreshes it every fifth of that); prune keeps unreferenced blobs younger than twice it.
    lock_ttl: float = field(default=300.0, metadata=_env("CKPT_LOCK_TTL", _seconds(True, "300")))
    # Seconds an S3 store's server may take to answer one request, its retries included (more
    # for a large body: backends/s3.py MIN_BODY_RATE); past it the command ends with exit 9.
    s3_timeout: float = field(default=60.0, metadata=_env("CKPT_S3_TIMEOUT", _seconds(True, "60")))
    # Where images are staged: auto = disk (the store's tmp/), or ram (/dev/shm); see
    # Store.staging_base for why disk is the default.
    staging: str = field(default="auto", metadata=_env("CKPT_STAGING", _choice(STAGING_CHOICES, "ram")))
    # Seconds a --pre-dump or --post-restore hook may take.
    hook_timeout: float = field(default=60.0, metadata=_env("CKPT_HOOK_TIMEOUT", _seconds(True, "60")))
    # Dirty-tracking records; tmpfs: forgotten at reboot, as the processes are.
    tracking_dir: Path = field(default=Path("/run/ckpt/tracking"), metadata=_env("CKPT_TRACKING_DIR", _path))
    # Below this much lazily restorable memory a full restore is as quick: a restore restores
    # fully unless told --lazy (0: lazily whenever possible).
    lazy_min_mib: int = field(default=64, metadata=_env(
        "CKPT_LAZY_MIN_MIB", _whole(0, None, "a whole number of MiB", "64")))
    # Records of running page servers; tmpfs: forgotten at reboot, as the servers are.
    lazy_dir: Path = field(default=Path("/run/ckpt/lazy"), metadata=_env("CKPT_LAZY_DIR", _path))
    # The running copies of clones (docs/design.md, "Clones"): each copy's identity file
    # (pidns-<inode>.json), the records of their network namespaces; tmpfs, as the copies are.
    copies_dir: Path = field(default=Path("/run/ckpt/copies"), metadata=_env("CKPT_COPIES_DIR", _path))
    # The kernel features CRIU found, until the next boot (tmpfs, as the kernel is).
    feature_cache: Path = field(default=Path("/run/ckpt/criu-features.json"),
                                metadata=_env("CKPT_FEATURE_CACHE", _path))
    # ckpt.checkpoint(): where the dump's result (and, on failure, the dumper's output) is left
    # for the process that asked; tmpfs, as the processes are (docs/design.md, "Checkpoints a
    # program asks for").
    agent_dir: Path = field(default=Path("/run/ckpt/agent"), metadata=_env("CKPT_AGENT_DIR", _path))
    # Set by `ckpt run` for the command it supervises: ckpt.checkpoint() asks the supervisor
    # over this UNIX socket instead of starting a dump of its own.
    socket: Path | None = field(default=None, metadata=_env("CKPT_SOCKET", _path))
    # Seconds a scheduled run waits for the previous run of its schedule, then skips.
    schedule_wait: float = field(default=60.0, metadata=_env("CKPT_SCHEDULE_WAIT", _seconds(False, "60")))
    # Seconds a dump waits for the tree's no_checkpoint() sections to end before it gives up
    # (ckpt dump --section-timeout wins).
    section_timeout: float = field(default=60.0, metadata=_env("CKPT_SECTION_TIMEOUT", _seconds(False, "60")))
    # Where root's schedules go, as files ckpt-NAME.
    cron_dir: Path = field(default=Path("/etc/cron.d"), metadata=_env("CKPT_CRON_DIR", _path))
    # What runs schedules: systemd timers or cron; auto = systemd's timers where systemd is PID 1
    # and answers (and ckpt runs as root), cron elsewhere (ckpt/schedule/schedulers.py).
    scheduler: str = field(default="auto", metadata=_env("CKPT_SCHEDULER", _choice(SCHEDULER_CHOICES, "cron")))
    # Where root's systemd schedules go, as units ckpt-NAME.service and ckpt-NAME.timer.
    systemd_dir: Path = field(default=Path("/etc/systemd/system"), metadata=_env("CKPT_SYSTEMD_DIR", _path))
    # The agent's name, for ckpt.journal (ckpt/agent/journal.py): the name of its checkpoints,
    # which its journal is kept and pruned by. Checked when the journal is used, not here: hooks
    # get CKPT_NAME too, and a ckpt they run must not fail on it.
    name: str | None = field(default=None, metadata=_env("CKPT_NAME", _text))
    # Dumps stream their pages out of CRIU into ckpt (ckpt/dump/pagestream.py) rather than
    # have CRIU write a pages image first; off: the pages image (the path of dirty tracking).
    page_stream: bool = field(default=True, metadata=_env("CKPT_PAGE_STREAM", _switch))
    # A full restore copies the tree's memory in through userfaultfd, from the packs straight
    # into the tree (ckpt/restore/uffdfill.py); off: a pages image is written first for CRIU to read.
    uffd_fill: bool = field(default=True, metadata=_env("CKPT_UFFD_FILL", _switch))
    # A lazy restore's memory is copied in by ckpt's own lazy-pages daemon, in the page server
    # (ckpt/restore/uffdlazy.py); off: by CRIU's, asking ckpt's page server for pages.
    lazy_fill: bool = field(default=True, metadata=_env("CKPT_LAZY_FILL", _switch))
    # The ssh client, with any options of its own, that a group checkpoint reaches its members on
    # other hosts (HOST:PID) with; the user's ~/.ssh/config, keys and known_hosts apply.
    ssh: str = field(default="ssh", metadata=_env("CKPT_SSH", _command("'ssh -F /root/.ssh/ckpt_config'")))
    # ckpt on those hosts, as their shell runs it (`ckpt _member` there: the member agent).
    remote_ckpt: str = field(default="ckpt", metadata=_env("CKPT_REMOTE_CKPT", _command("/opt/ckpt/bin/ckpt")))
    # Tracebacks of internal errors, as --debug.
    debug: bool = field(default=False, metadata=_env("CKPT_DEBUG", _switch))

    @property
    def lazy_min_bytes(self) -> int:
        return self.lazy_min_mib << 20

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Each field from its CKPT_* variable, or its default when unset or empty (as for
        any shell variable). A bad value raises UsageError naming the variable."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"], "")
            if raw != "":
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        if "store" not in values:
            values["store"] = default_store_path(environ)
        if "cache" not in values:
            values["cache"] = default_cache_path(environ)
        return cls(**values)


# Where botocore finds the S3 server and the credential files (not the credentials themselves):
# what a schedule's cron line passes on, since cron's environment is bare.
S3_LOCATION_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION",
                         "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def s3_location_environment() -> dict[str, str]:
    """The S3_LOCATION_VARIABLES that are set (botocore reads them itself; not ckpt settings)."""
    return {name: os.environ[name] for name in S3_LOCATION_VARIABLES if os.environ.get(name)}


def variables() -> dict[str, str]:
    """{CKPT_* variable: field name} of every setting."""
    return {f.metadata["env"]: f.name for f in fields(Settings)}


def store_from_flag(flag: str | Path) -> StoreLocation:
    """--store's value (which wins over CKPT_STORE): an absolute path or an s3:// URL."""
    if str(flag).strip() == "":
        raise UsageError("--store '' names no directory", hint="give the store's directory, or leave --store out")
    return _store_location("--store", str(flag))
