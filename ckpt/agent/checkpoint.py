"""ckpt.checkpoint(): a program checkpoints itself (its threads and children included) while it
keeps running, and learns on which side of the checkpoint it is.

How (docs/design.md, "Checkpoints a program asks for"): the caller chooses the new checkpoint's
ID, notes its own start time and the boot id, and asks for a dump of its tree: from the `ckpt
run` supervisor when CKPT_SOCKET is set, otherwise from a `ckpt dump` it starts detached (not
its child: CRIU must not find its own dumper in the tree it dumps). Then it waits without
holding any new descriptor: a copy restored by CRIU is a new process with another start time
("I am the restored copy"); the original finds the dump's result file. Nothing links the two
sides at the freeze, so nothing outside the tree is in the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ckpt import settings as settings_module
from ckpt.agent import arguments, identity, results
from ckpt.errors import CheckpointCancelled, CheckpointFailed, CkptError, ExitCode
from ckpt.store import ids
from ckpt.system import procfs

Callback = TypeVar("Callback", bound=Callable[[], object])

POLL_SECONDS = 0.01
# Without a dumper to watch (under `ckpt run`), how long the supervisor may take to say.
SUPERVISOR_TIMEOUT = 600.0


@dataclass(frozen=True)
class CheckpointResult:
    """What ckpt.checkpoint() returns: the checkpoint's ID on both sides; restored is False in
    the process that asked and True in a copy restored from that checkpoint; copy is the
    number (1..N) of a copy `ckpt clone` restored, None in the original and plain restores."""

    id: str
    restored: bool
    name: str | None = None
    copy: int | None = None


_settings: settings_module.Settings | None = None

Take = Callable[[str | None, str | None], CheckpointResult]


class Checkpointer:
    """A program's callbacks and the checkpoints it takes with them: the program's own one is
    behind before_checkpoint(), after_restore() and checkpoint() below. take(name, store) takes
    one checkpoint (default: asks `ckpt run` or starts `ckpt dump`, see _take)."""

    def __init__(self, take: Take | None = None):
        self.take: Take = take if take is not None else _take
        # Registration order of both kinds together: ("before" | "after", fn). An after_restore
        # callback belongs to the layer of the before_checkpoint callback registered last before
        # it (what a cancelled checkpoint undoes; see _run_before).
        self._callbacks: list[tuple[str, Callable[[], object]]] = []
        self._callbacks_lock = threading.Lock()
        # One checkpoint at a time per process: a second caller (another thread) waits for the first.
        self._checkpoint_lock = threading.Lock()

    def before_checkpoint(self, fn: Callback) -> Callback:
        """See the module's before_checkpoint()."""
        return self._register("before", fn)

    def after_restore(self, fn: Callback) -> Callback:
        """See the module's after_restore()."""
        return self._register("after", fn)

    def _register(self, kind: str, fn: Callback) -> Callback:
        if not callable(fn):
            raise TypeError(f"ckpt callbacks must be callable, not {type(fn).__name__}")
        with self._callbacks_lock:
            self._callbacks.append((kind, fn))
        return fn

    def checkpoint(self, name: str | None = None, store: str | Path | None = None) -> CheckpointResult:
        """See the module's checkpoint()."""
        name = arguments.optional_str(name, "ckpt.checkpoint(): name")
        store = arguments.optional_store(store, "ckpt.checkpoint(): store")
        if name is not None:
            ids.check_name(name)
        location = str(settings_module.store_from_flag(store)) if store is not None else None
        with self._checkpoint_lock:
            with self._callbacks_lock:
                registered = list(self._callbacks)
            _run_before(registered)
            try:
                result = self.take(name, location)
            except BaseException as exc:
                _run_after(registered, len(registered), exc)
                raise
            _run_after(registered, len(registered))
            return result


def before_checkpoint(fn: Callback) -> Callback:
    """Registers fn to run before every checkpoint this process asks for, in reverse
    registration order (the last registered runs first). If it raises, the checkpoint is
    cancelled: see checkpoint(). Usable as a decorator; returns fn."""
    return _program.before_checkpoint(fn)


def after_restore(fn: Callback) -> Callback:
    """Registers fn to run after every checkpoint this process asks for, in registration order,
    on both sides: in the original once the checkpoint is committed (or failed), and in a copy
    restored from it. Usable as a decorator; returns fn."""
    return _program.after_restore(fn)


def checkpoint(name: str | None = None, store: str | Path | None = None) -> CheckpointResult:
    """Checkpoints the calling process's tree (every thread, every child) into the store, and
    returns once the checkpoint is committed: CheckpointResult(id, restored=False). A copy
    restored from that checkpoint returns from this same call with restored=True and the same
    id.

    Before the freeze, the before_checkpoint callbacks run (last registered first); after it,
    on both sides, the after_restore callbacks (in registration order). A before-callback that
    raises cancels the checkpoint: nothing is frozen or written, the after-callbacks of the
    layers whose before-callback had run are called, and CheckpointCancelled is raised (its
    __cause__ is the callback's exception). A dump that fails raises CheckpointFailed (after
    the after-callbacks ran: what the before-callbacks closed is open again).

    name labels the checkpoint ('ckpt restore NAME' takes the newest); store is a directory or
    s3:// URL (default: CKPT_STORE, as for `ckpt dump`; under `ckpt run` the supervisor's store).
    Without `ckpt run` the caller must be root, as `ckpt dump` must.

    Any thread may call it; the others keep running until the freeze. It blocks for the
    start-up of `ckpt dump` (~0.3 s) and the dump: from asyncio, call it in a thread
    (`await asyncio.to_thread(ckpt.checkpoint)`), not on the event loop.

    Raises TypeError when name is not a str (or None), or store not a str or path (or None)."""
    return _program.checkpoint(name, store)


def _run_before(registered: list[tuple[str, Callable[[], object]]]) -> None:
    for index in range(len(registered) - 1, -1, -1):
        kind, fn = registered[index]
        if kind != "before":
            continue
        try:
            fn()
        except Exception as exc:
            cancelled = CheckpointCancelled(
                f"checkpoint cancelled: the before_checkpoint callback {_label(fn)} raised "
                f"{type(exc).__name__}: {exc}", hint="nothing was frozen or written")
            # Undo the layers registered after this one (their before-callbacks ran): their
            # after-callbacks, in registration order. This layer's own after-callbacks (those
            # registered between it and the next before-callback) do not run: a callback that
            # raises undoes its own work, as a constructor that raises does.
            above = next((i for i in range(index + 1, len(registered)) if registered[i][0] == "before"),
                         len(registered))
            _run_after(registered[above:], len(registered) - above, cancelled)
            raise cancelled from exc


def _run_after(registered: list[tuple[str, Callable[[], object]]], count: int,
               pending: BaseException | None = None) -> None:
    """Runs every after-callback of registered[:count], all of them even if some raise; then
    raises the first exception (the others as notes), unless one (pending) is on its way."""
    errors: list[BaseException] = []
    for kind, fn in registered[:count]:
        if kind == "after":
            try:
                fn()
            except Exception as exc:  # the others must still reopen what they closed
                errors.append(exc)
    if not errors:
        return
    notes = [f"the after_restore callback raised {type(e).__name__}: {e}" for e in errors]
    if pending is not None:
        for note in notes:
            pending.add_note(note)
        return
    for note in notes[1:]:
        errors[0].add_note(note)
    raise errors[0]


def _label(fn: Callable[[], object]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _agent_settings() -> settings_module.Settings:
    """The settings, read from the environment once: the library runs inside the user's
    program, whose environment ckpt does not own (a bad CKPT_* value: UsageError)."""
    global _settings  # noqa: PLW0603 (built once, lazily)
    if _settings is None:
        _settings = settings_module.Settings.from_environment()
    return _settings


def _incarnation() -> tuple[str, int]:
    """(boot id, start time of this process): a restored copy is a new process, so the start
    time differs (and on another boot, the boot id)."""
    return procfs.boot_id(), procfs.start_ticks("self")


def copy_info() -> dict | None:
    """Which copy of a clone (`ckpt clone REF --copies N`) this process is: {"format": 1,
    "clone": ID, "copy": k, "copies": N, "checkpoint": ID, "name": NAME or None, "created":
    TIME} (docs/api.md), or None when it is not in a copy (the original, a plain restore)."""
    return identity.read_identity(identity.copies_dir(_agent_settings()))


def _take(name: str | None, store: str | None) -> CheckpointResult:
    config = _agent_settings()
    # Noted in this process's memory before the dump: a copy's checkpoint, restored later
    # without an identity file of its own, is still that copy to its journal.
    identity.remembered.current(identity.copies_dir(config))
    pid = os.getpid()
    checkpoint_id = ids.new_id()
    before = _incarnation()
    results.ensure_dir(config.agent_dir)
    result_file = results.result_path(config.agent_dir, pid, checkpoint_id)
    log_file: Path | None = None
    dumper: int | None = None
    if config.socket is not None:
        from ckpt.agent.protocol import ProtocolError, request_checkpoint

        # Returns once the supervisor has the request and the connection is closed: it dumps
        # only then, so no socket to the outside is in the checkpoint.
        try:
            request_checkpoint(checkpoint_id, name, path=str(config.socket))
        except ProtocolError as exc:
            raise CheckpointFailed(f"checkpoint failed: {exc}", hint="ckpt run refused or did not answer") from exc
        timeout: float | None = SUPERVISOR_TIMEOUT
    else:
        log_file = results.log_path(config.agent_dir, pid, checkpoint_id)
        dumper = _start_dumper(pid, checkpoint_id, name, store, result_file, log_file)
        timeout = None  # as long as the dumper lives (its own waits are bounded)
    record = _wait(before, result_file, dumper, timeout, log_file)
    if record is None:  # the restored copy: what the original left is of no use
        results.remove(result_file, *([log_file] if log_file else []))
        found = identity.read_identity(identity.copies_dir(config))
        return CheckpointResult(checkpoint_id, True, name, found["copy"] if found else None)
    results.remove(result_file)
    if record.get("ok") is True and record.get("id") == checkpoint_id:
        if log_file is not None:
            results.remove(log_file)
        return CheckpointResult(checkpoint_id, False, name)
    raise _failure(record, log_file)


def _failure(record: dict, log_file: Path | None) -> CheckpointFailed:
    error = CheckpointFailed(f"checkpoint failed: {record.get('error') or 'the dump gave no reason'}",
                             hint=f"the dump's output is in {log_file}" if log_file else None,
                             log_path=str(log_file) if log_file else None)
    try:
        error.exit_code = ExitCode(int(record.get("exit_code", ExitCode.ERROR)))
    except (TypeError, ValueError):
        pass
    return error


# The detached dumper's launcher, run by a fresh interpreter (not forked from the caller, whose
# other threads may hold locks, and whose memory a fork would mark copy-on-write): it forks the
# dumper into a session of its own and prints its PID. Its own exit leaves the dumper an orphan,
# adopted by init (or a subreaper above the caller): out of the tree CRIU dumps.
_LAUNCHER = r"""
import os, sys
log, cwd, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(cwd)
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
os.write(1, b"%d\n" % pid)
"""


def _start_dumper(pid: int, checkpoint_id: str, name: str | None, store: str | None, result_file: Path,
                  log_file: Path) -> int:
    """Starts `python -m ckpt dump PID --id ID --result-file FILE` detached; returns its PID.
    It runs from the directory holding this ckpt package, so that `-m ckpt` is this ckpt."""
    if not sys.executable:
        raise CheckpointFailed("checkpoint failed: this Python does not know its interpreter (sys.executable)",
                               hint="run the program with a python executable")
    package_parent = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "ckpt", "--debug", "dump", str(pid), "--id", checkpoint_id,
            "--result-file", str(result_file)]
    if name is not None:
        argv += ["--name", name]
    if store is not None:
        argv += ["--store", store]
    try:
        launched = subprocess.run([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(log_file), str(package_parent),
                                   *argv], stdin=subprocess.DEVNULL, capture_output=True, cwd="/",
                                  timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckpointFailed(f"checkpoint failed: could not start ckpt dump ({exc})") from exc
    text = launched.stdout.decode(errors="replace").strip()
    if launched.returncode != 0 or not text.isdigit():
        detail = launched.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {launched.returncode}"]
        raise CheckpointFailed(f"checkpoint failed: could not start ckpt dump ({detail[0]})")
    return int(text)


def _wait(before: tuple[str, int], result_file: Path, dumper: int | None, timeout: float | None,
          log_file: Path | None, incarnation: Callable[[], tuple[str, int]] = _incarnation) -> dict | None:
    """Polls until this is a restored copy (None) or the result file exists (its record).

    No descriptor is held across the freeze: the result file is looked for with stat, and
    /proc/self/stat and the boot id are opened and closed at each turn. A freeze landing in such
    a read is harmless (CRIU restores an open /proc/PID file of the tree; the next turn reads
    afresh). Every conclusion is checked against the incarnation after it was drawn: a copy
    restored in the middle of a turn finds the result its original left behind (or none, and its
    dumper gone), and must not take either for its own. incarnation reads (boot id, start time) afresh."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if incarnation() != before:
            return None
        record = results.read(result_file)
        if record is not None:
            return None if incarnation() != before else record
        # A zombie dumper counts until init reaps it: its answer is only late.
        if dumper is not None and not procfs.pid_exists(dumper):
            record = results.read(result_file)  # written just before it ended
            if incarnation() != before:
                return None  # restored meanwhile: the dumper is long gone, its result taken
            if record is not None:
                return record
            raise CheckpointFailed(f"checkpoint failed: ckpt dump (PID {dumper}) ended without a result",
                                   hint=f"its output is in {log_file}" if log_file else None,
                                   log_path=str(log_file) if log_file else None)
        if deadline is not None and time.monotonic() > deadline and incarnation() == before:
            raise CheckpointFailed(f"checkpoint failed: no result from `ckpt run` after {timeout:.0f} s",
                                   hint="see the supervisor's output")
        time.sleep(POLL_SECONDS)


# The program's own callbacks and checkpoints (before_checkpoint, after_restore, checkpoint).
_program = Checkpointer()

__all__ = ["CheckpointResult", "after_restore", "before_checkpoint", "checkpoint", "CheckpointCancelled",
           "CheckpointFailed", "CkptError"]
