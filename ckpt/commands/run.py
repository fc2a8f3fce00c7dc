"""Use case `ckpt run`: start a command, checkpoint it periodically, restore it when it dies.

What happens is told twice: as messages to the reporter, and as events (plain dicts, one per
thing that happened: started, checkpoint, died, restored, exit...) to `on_event`, which
`ckpt run --json` prints as JSON Lines (docs/json.md).

The command finds CKPT_SOCKET in its environment: the socket of this supervisor's line protocol
(ckpt/agent/protocol.py), through which it asks for checkpoints (dumped by the supervisor's
main loop, between its other work), learns their outcome, and holds critical sections.

The first checkpoint is taken --first-after the start (a few seconds: a crash in the first
minutes must be recoverable too), then every --every. A tree that dies soon after each restore
is restored after growing pauses (RestoreBackoff), up to --max-restores.

ckpt outlives its own stdout and stderr: every message also goes to its log, next to the
command's output, and a reporter or event stream that fails (the reader of a pipe gone) is
dropped, said in that log, while supervision goes on. A hang-up (SIGHUP: the terminal closed)
is ignored for the same reason: the command runs in a session of its own and would go on
unsupervised.

ckpt makes itself a child subreaper (PR_SET_CHILD_SUBREAPER) so that a restored tree, orphaned
when CRIU exits, is re-parented to ckpt: ckpt can then wait for it like for the command it
started, and reaps the PIDs of a dead tree at once so the next restore finds them free.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import queue
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from ckpt.settings import Settings, StoreLocation
from ckpt.store.password import PasswordSource
from ckpt.agent import protocol
from ckpt.errors import CkptError, SectionTimeout, UsageError
from ckpt.reporting import LogReporter, NullReporter, Reporter
from ckpt.system import procs
from ckpt.system.textutil import human_bytes

if TYPE_CHECKING:
    from ckpt.store import Origin, Store

PR_SET_CHILD_SUBREAPER = 36


@dataclass
class RunRequest:
    command: list[str]
    every: timedelta
    name: str
    keep_last: int = 3
    max_restores: int = 3
    output: Path | None = None
    pre_dump_hook: str | None = None
    post_restore_hook: str | None = None
    copy_to: str | None = None  # a store each checkpoint is copied to right after its dump
    first_after: timedelta = timedelta(seconds=3)  # the first checkpoint, this long after the start
    # A group run's other commands (`:::`): every command its own tree, checkpointed and restored
    # together as one group (ckpt/commands/run_group.py); empty: one command, as ever.
    also: list[list[str]] = field(default_factory=list)

    @property
    def commands(self) -> list[list[str]]:
        return [self.command, *self.also]


COMMAND_SEPARATOR = ":::"


def split_commands(argv: list[str]) -> list[list[str]]:
    """The commands of `ckpt run -- CMD ARGS ::: CMD ARGS ...`, each its argv word for word."""
    commands: list[list[str]] = [[]]
    for word in argv:
        if word == COMMAND_SEPARATOR:
            commands.append([])
        else:
            commands[-1].append(word)
    if len(commands) > 1 and not all(commands):
        raise UsageError(f"an empty command between '{COMMAND_SEPARATOR}'s",
                         hint=f"ckpt run [OPTIONS] -- COMMAND [ARGS...] {COMMAND_SEPARATOR} COMMAND [ARGS...]")
    return commands


def check_request(request: RunRequest) -> None:
    """Refuses a run that cannot go, before anything starts."""
    if not request.command or not all(request.also):
        raise UsageError("no command to run", hint="ckpt run [OPTIONS] -- COMMAND [ARGS...] [::: COMMAND [ARGS...]]")
    for flag, duration in (("--every", request.every), ("--first-after", request.first_after)):
        if duration.total_seconds() < 1:
            raise UsageError(f"{flag} must be at least 1s")
    for flag, count in (("--keep-last", request.keep_last), ("--max-restores", request.max_restores)):
        if count < 0:
            raise UsageError(f"{flag} {count} is negative", hint="give 0 or more")


@dataclass
class RestoreBackoff:
    """The pause before a restore: none after a tree that ran for a while (or the command as
    started), then `first`, doubled for each restored tree in a row that died within
    `stable_after` of its restore, up to `cap`. A program that dies right after each restore is
    not restored in a tight loop (three times in 1.5 s, and given up on)."""
    first: float = 1.0
    cap: float = 60.0
    stable_after: float = 60.0
    quick_deaths: int = 0  # restored trees in a row that died within stable_after

    def pause(self, ran_after_restore: float | None) -> float:
        """Seconds to wait before the next restore of a tree that died `ran_after_restore`
        seconds after its restore (None: it was the command as started, never restored)."""
        if ran_after_restore is None or ran_after_restore >= self.stable_after:
            self.quick_deaths = 0
            return 0.0
        self.quick_deaths += 1
        return min(self.cap, self.first * 2 ** (self.quick_deaths - 1))


def default_name(command: list[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "-", Path(command[0]).name) or "cmd"
    if not base[0].isalpha():
        base = "run-" + base
    return base[:64]


def describe_status(status: int) -> tuple[str, int, bool]:
    """(text, exit code to hand on, whether it was a clean exit)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal.Signals(sig).name})", 128 + sig, False
    code = os.WEXITSTATUS(status)
    return f"exited with status {code}", code, code == 0


def take_signals(forward: Callable[[int, Any], None]) -> None:
    """A supervisor's signals: SIGINT and SIGTERM forwarded to what it supervises, SIGHUP
    (its terminal gone) ignored, but by a handler: not SIG_IGN, which stays ignored across exec,
    in the commands and their hooks."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: None)


def become_subreaper() -> None:
    """A restored tree, orphaned when CRIU exits, is re-parented to us: we can wait for it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise CkptError("cannot become a child subreaper (prctl failed)")


@dataclass(frozen=True)
class RunFiles:
    """One output file and one log per run: a later run of the name starts its own."""

    run_dir: Path
    output: Path
    log: Path

    @classmethod
    def of(cls, store_root: StoreLocation, settings: Settings, request: RunRequest) -> RunFiles:
        from ckpt.store import opening

        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")[:-3]
        run_dir = opening.local_dir(store_root, settings.cache) / "logs" / f"run-{request.name}"
        output = request.output or run_dir / f"output-{stamp}.log"
        output.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls(run_dir, output, run_dir / f"ckpt-{stamp}.log")

    def open_log(self) -> TextIO:
        return open(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a", encoding="utf-8")


def hold_the_name(run_dir: Path, name: str) -> int:
    """One live supervisor per name and store: a run's retention forgets the checkpoints of
    its name (its origin), so a second run of the name would forget the first's newest, and
    the first could then restore nothing. The flock dies with its holder (a kill -9 too).
    Returns the descriptor that holds it."""
    fd = os.open(run_dir / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UsageError(f"another 'ckpt run' (PID {holder}) supervises the name {name!r} in "
                         "this store: its retention and this one's would forget each other's checkpoints",
                         hint="give this run another --name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def command_environment(name: str, store_root: StoreLocation) -> dict[str, str]:
    """What a supervised command finds in its environment: ckpt's own, and CKPT_NAME and
    CKPT_STORE (a Python agent's ckpt.journal and checkpoint() find its name and store)."""
    return {**os.environ, "CKPT_NAME": name, "CKPT_STORE": str(store_root)}


def start_command(command: list[str], out, env: dict[str, str]) -> int:
    """Starts the command in a session of its own (a tree of its own to checkpoint, out of
    reach of ckpt's terminal), its output to out; returns its PID. We reap it ourselves."""
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                 env=env)
    except OSError as exc:
        raise UsageError(f"cannot start {command[0]}: {exc.strerror}") from None
    child.returncode = 0  # keep Popen from reaping it later
    return child.pid


class Supervisor:
    def __init__(self, store_root: StoreLocation, request: RunRequest, settings: Settings,
                 reporter: Reporter = NullReporter(), on_event: Callable[[dict], None] | None = None,
                 passwords: PasswordSource | None = None):
        check_request(request)
        self.store_root = store_root
        self.request = request
        self.settings = settings
        self.passwords = PasswordSource.passed_or_settings(passwords, settings)
        self.reporter = reporter
        self.on_event = on_event or (lambda _event: None)
        self.pid: int | None = None
        self.stopping_signal: int | None = None
        self.restores = 0
        self.checkpoints: list[str] = []
        self.lazy_log_dir: Path | None = None  # the last restore's, while it was lazy
        # CKPT_SOCKET: requests come from the server's thread through this queue.
        self.server: protocol.Server | None = None
        self.requests: queue.Queue[tuple[str, str | None, protocol.Client, str | None, bool]] = queue.Queue()
        self.results: dict[str, str] = {}  # RESULT's replies, by checkpoint id
        self.restored_from: str | None = None  # the checkpoint the running tree was restored from
        self._journal_store: Any = None  # the Store, opened at the first journal request
        self.backoff = RestoreBackoff()
        self.restored_at: float | None = None  # monotonic time of the last restore (None: none yet)
        self.root_reaped = False  # self.pid died and was reaped: its number may be anyone's now
        self.log: Any = None  # ckpt's own log file, open from start() to the end of run()

    def _open_store(self, create: bool = False) -> Store:
        from ckpt.store import Store

        return Store.open(self.store_root, create, settings=self.settings, passwords=self.passwords)

    # ---- protocol.Supervision (called from the server's thread) ----

    def checkpoint_requested(self, checkpoint_id: str, name: str | None, client: protocol.Client,
                             error: str | None, result_file: bool) -> None:
        self.results[checkpoint_id] = "PENDING" if error is None else f"FAILED {error}"
        self.requests.put((checkpoint_id, name, client, error, result_file))

    def result(self, checkpoint_id: str) -> str:
        # The supervisor restored the running tree from that checkpoint: whoever asks is the copy.
        if checkpoint_id == self.restored_from:
            return f"RESTORED {checkpoint_id}"
        return self.results.get(checkpoint_id, f"ERROR unknown checkpoint {checkpoint_id}")

    def journal_store(self):

        if self._journal_store is None:
            self._journal_store = self._open_store(create=True)
        return self._journal_store

    def agent_name(self) -> str | None:
        return self.request.name

    def supervised_pid(self) -> int | None:
        return self.pid

    def _event(self, kind: str, **fields) -> None:
        try:
            self.on_event({"event": kind, "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                           **fields})
        except OSError as exc:  # the reader of --json's stdout went away: supervision goes on
            self.on_event = lambda _event: None
            self.reporter.warn(f"events can no longer be printed ({exc.strerror or exc}); supervision goes on")

    def _forward(self, signum, _frame) -> None:
        self.stopping_signal = signum
        if self.pid and not self.root_reaped:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def start(self) -> int:
        procs.require_root()
        become_subreaper()
        files = RunFiles.of(self.store_root, self.settings, self.request)
        self._name_lock = hold_the_name(files.run_dir, self.request.name)  # held until this process ends
        output, log_path = files.output, files.log
        self.log = files.open_log()
        self.reporter = LogReporter(self.reporter, self.log)
        self.server = protocol.Server(protocol.SOCKET_DIR / f"{os.getpid()}.sock", self)
        self.server.start()
        env = {**command_environment(self.request.name, self.store_root), protocol.ENV: str(self.server.path)}
        # The command's output goes to a file: a pipe or terminal shared with ckpt would not
        # survive a restore (its other end is outside the checkpointed tree).
        with open(os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
            earlier = os.fstat(out.fileno()).st_size  # --output FILE is appended to, as it is
            try:
                self.pid = start_command(self.request.command, out, env)
            except UsageError:
                self.server.close()
                raise
        appended = f", after the {human_bytes(earlier)} it held" if earlier else ""
        self.reporter.info(f"started PID {self.pid}: {' '.join(self.request.command)} (output: {output}{appended}; "
                           f"ckpt's log: {log_path})")
        self._event("started", pid=self.pid, command=list(self.request.command), output=str(output),
                    log=str(log_path))
        return self.pid

    def run(self) -> int:
        """Supervises until a clean exit, a forwarded signal, or the restore limit; returns the exit code."""
        take_signals(self._forward)
        try:
            self.start()
            return self._supervise()
        finally:
            if self.server is not None:
                self.server.close()
            if self.log is not None:
                self.log.close()

    def _supervise(self) -> int:
        next_dump = time.monotonic() + min(self.request.first_after, self.request.every).total_seconds()
        while True:
            status = self._reap_root()
            if status is not None:
                self.root_reaped = True
                text, code, clean = describe_status(status)
                if clean or self.stopping_signal is not None:
                    self.reporter.info(f"PID {self.pid} {text}; supervision ends")
                    return self._exit("exited" if self.stopping_signal is None else "stopped", text, code)
                self.reporter.warn(f"PID {self.pid} {text}")
                self._event("died", pid=self.pid, status=text, exit_code=code,
                            lazy_restore_failure=self._explain_lazy_failure())
                if not self.checkpoints:
                    self.reporter.warn("no checkpoint was taken yet: nothing to restore")
                    return self._exit("no_checkpoint", text, code)
                if self.restores >= self.request.max_restores:
                    self.reporter.warn(f"restore limit ({self.request.max_restores}) reached; giving up")
                    return self._exit("restore_limit", text, code)
                if not self._pause_before_restore():
                    return self._exit("stopped", text, code)
                if not self._restore():
                    return self._exit("restore_failed", text, code)
                next_dump = time.monotonic() + self.request.every.total_seconds()
                continue
            if time.monotonic() >= next_dump:
                if self._checkpoint() is None:
                    self._after_checkpoint()
                next_dump = time.monotonic() + self.request.every.total_seconds()
            try:
                asked = self.requests.get(timeout=0.05)
            except queue.Empty:
                continue
            self._requested_checkpoint(*asked)
            next_dump = time.monotonic() + self.request.every.total_seconds()

    def _pause_before_restore(self) -> bool:
        """Waits as RestoreBackoff says, reaping what is left of the dead tree; False when a
        SIGINT or SIGTERM came meanwhile (there is no tree to forward it to: supervision ends)."""
        ran = None if self.restored_at is None else time.monotonic() - self.restored_at
        pause = self.backoff.pause(ran)
        if pause:
            self.reporter.warn(f"PID {self.pid} died {ran:.1f} s after restore {self.restores}: waiting {pause:g} s "
                               f"before restore {self.restores + 1} of {self.request.max_restores}")
            self._event("restore_delayed", pid=self.pid, ran_s=round(ran or 0.0, 3), delay_s=pause,
                        restores=self.restores, max_restores=self.request.max_restores)
        deadline = time.monotonic() + pause
        while self.stopping_signal is None and time.monotonic() < deadline:
            self._reap_root()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.stopping_signal is not None:
            self.reporter.info(f"stopped by signal {self.stopping_signal} before restoring; supervision ends")
            return False
        return True

    def _exit(self, reason: str, status: str, code: int) -> int:
        self._event("exit", pid=self.pid, reason=reason, status=status, exit_code=code,
                    checkpoints=len(self.checkpoints), restores=self.restores)
        return code

    def _reap_root(self) -> int | None:
        """Reaps every dead child (we are a subreaper); returns the root's status if it died."""
        root_status = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return root_status
            if pid == 0:
                return root_status
            if pid == self.pid:
                root_status = status

    def _requested_checkpoint(self, checkpoint_id: str, name: str | None, client: protocol.Client,
                              error: str | None, result_file: bool) -> None:
        """A CHECKPOINT request over CKPT_SOCKET: the dump with the client's id, its outcome for
        RESULT and in the result file the Python API waits for."""
        if error is None:
            self.reporter.info(f"PID {client.pid} asks for checkpoint {checkpoint_id}")
            error = self._checkpoint(checkpoint_id, name, requested_by=client.pid)
        self.results[checkpoint_id] = f"CHECKPOINTED {checkpoint_id}" if error is None else \
            f"FAILED {' '.join(error.split())}"
        if result_file:
            self._write_result(client, checkpoint_id, error)
        if error is None:
            self._after_checkpoint()

    def _write_result(self, client: protocol.Client, checkpoint_id: str, error: str | None) -> None:
        from ckpt.agent import results

        record = {"id": checkpoint_id, "ok": True} if error is None else {"id": checkpoint_id, "ok": False,
                                                                           "error": error}
        agent_dir = self.settings.agent_dir
        try:
            results.ensure_dir(agent_dir)
            # Owner-only and the client's: it removes the file once read.
            results.write(results.result_path(agent_dir, client.pid, checkpoint_id), record, uid=client.uid)
        except (OSError, CkptError):
            pass  # RESULT still tells

    def _checkpoint(self, checkpoint_id: str | None = None, name: str | None = None,
                    requested_by: int | None = None) -> str | None:
        """One dump of the tree (periodic, or asked for); returns why it failed (None: taken)."""
        from ckpt.commands.dump import DumpRequest, dump

        if self.pid is None:
            return "nothing was started yet"
        try:
            result = dump(self.store_root, DumpRequest(pid=self.pid, name=name or self.request.name,
                                                       pre_dump_hook=self.request.pre_dump_hook,
                                                       copy_to=self.request.copy_to,
                                                       copy_origin=self._copy_origin,
                                                       checkpoint_id=checkpoint_id, origin=self._origin),
                          self.reporter, around_freeze=self.server.paused if self.server else None,
                          settings=self.settings, passwords=self.passwords)
        except SectionTimeout as exc:
            # The program asked not to be frozen now: this checkpoint is skipped, not failed.
            self.reporter.warn(f"checkpoint skipped: {exc.message}")
            self._event("checkpoint_skipped", pid=self.pid, error=exc.message, requested_by=requested_by)
            return exc.message
        except CkptError as exc:
            if procs.process_state(self.pid) in (None, "Z"):
                return f"PID {self.pid} died during the dump"  # the loop handles that
            self.reporter.warn(f"checkpoint failed: {exc}")
            self._event("checkpoint_failed", pid=self.pid, error=str(exc))
            return str(exc)
        m = result.manifest
        self.checkpoints.append(m.id)
        self.reporter.info(f"checkpoint {m.id}: frozen {m.stats.get('freeze_ms')} ms, "
                           f"{human_bytes(m.bytes_stored)} new")
        self._event("checkpoint", id=m.id, pid=self.pid, freeze_ms=m.stats.get("freeze_ms"),
                    bytes_stored=m.bytes_stored, requested_by=requested_by)
        return None

    def _after_checkpoint(self) -> None:
        """--copy-to and --keep-last, after a checkpoint (and after its requester was told)."""
        from ckpt.commands.forget import forget
        from ckpt.schedule.retention import Policy

        if self.request.copy_to:
            self._copy()  # before retention, which could forget a checkpoint still to copy
        if self.request.keep_last:
            try:
                # Only the checkpoints runs of this name made (those the program asked for over
                # CKPT_SOCKET included): not one dumped by hand or by a schedule of the same name.
                forgotten = forget(self._open_store(), Policy(keep_last=self.request.keep_last),
                                   name=self.request.name, prune=True, origin=self._origin, reporter=self.reporter)
            except CkptError as exc:
                self.reporter.warn(f"retention failed: {exc}")
                self._event("retention_failed", error=str(exc))
                return
            if forgotten.removed:
                self._event("forgot", ids=[d.id for d in forgotten.removed], keep_last=self.request.keep_last)

    @property
    def _copy_origin(self) -> str:
        return f"run {self.request.name}"

    @property
    def _origin(self) -> Origin:
        from ckpt.store import Origin

        # The run's name, not this supervisor: a later `ckpt run` of that name carries the
        # series on (its journal, its pending copies, its output file are the name's too).
        return Origin("run", self.request.name)

    def _copy(self) -> None:
        """Copies this checkpoint, and those earlier copies failed to, to --copy-to. A failed
        copy leaves its record (ckpt/store/pending.py) for the next checkpoint's turn."""
        from ckpt.commands.copy import finish_pending

        try:
            outcomes = finish_pending(self._open_store(), self._copy_origin, self.reporter, self.passwords)
        except CkptError as exc:
            outcomes = [{"id": self.checkpoints[-1], "to": self.request.copy_to, "status": "failed",
                         "bytes_sent": 0, "error": str(exc)}]
        for o in outcomes:
            if o["status"] == "failed":
                self.reporter.warn(f"copy of {o['id']} to {o['to']} failed (tried again after the next "
                                   f"checkpoint): {o['error']}")
                self._event("copy_failed", id=o["id"], to=o["to"], error=o["error"])
            elif o["status"] in ("copied", "present"):
                self.reporter.info(f"copied {o['id']} to {o['to']}: {human_bytes(o['bytes_sent'])} sent")
                self._event("copied", id=o["id"], to=o["to"], bytes_sent=o["bytes_sent"])

    def _explain_lazy_failure(self) -> str | None:
        """A lazily restored tree is killed when its page server ends before the memory is back
        (ckpt/restore/lazywatch.py): said (and returned), and restored again like any other death."""
        if self.lazy_log_dir is None:
            return None
        from ckpt.restore.lazywatch import FAILURE_FILE, describe

        try:
            record = json.loads((self.lazy_log_dir / FAILURE_FILE).read_text())
        except (OSError, ValueError):
            return None
        explained = describe(record)
        self.reporter.warn(explained)
        return explained

    def _end_old_tree(self, pids: list[int]) -> None:
        """Kills what is left of the dead tree (children survive their parent) and reaps it.

        Not only the checkpoint's PIDs: a shell script forks all the time, and a child started
        since the dump (a `sleep`, a `$(...)`), reparented to us, keeps the dead root's PID in use
        as its session and group id: CRIU then cannot give that PID back ("Can't fork: File
        exists"). As the subreaper, every such orphan is a descendant of ours."""
        import psutil

        try:
            orphans = [p.pid for p in psutil.Process().children(recursive=True)]
        except psutil.Error:
            orphans = []
        pids = list(dict.fromkeys([*pids, *orphans]))
        for pid in pids:
            if pid != self.pid and procs.process_state(pid) not in (None, "Z"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(procs.process_state(p) is not None for p in pids):
            self._reap_root()
            time.sleep(0.02)

    def _restore(self) -> bool:
        from ckpt.commands.restore import RestoreRequest, restore

        try:
            manifest = self._open_store().load(self.checkpoints[-1])
            self._end_old_tree(manifest.all_pids)
            # Set before CRIU runs: the restored tree may ask RESULT as soon as it runs, before
            # restore() returns; the old tree is dead by now, so whoever asks is the copy.
            self.restored_from = manifest.id
            result = restore(self.store_root, RestoreRequest(ref=manifest.id,
                                                             post_restore_hook=self.request.post_restore_hook),
                             self.reporter, settings=self.settings, passwords=self.passwords)
        except CkptError as exc:
            self.reporter.warn(f"restore failed: {exc}")
            self._event("restore_failed", id=self.checkpoints[-1], error=str(exc))
            return False
        self.restores += 1
        self.pid = result.pid
        self.root_reaped = False
        self.restored_at = time.monotonic()
        self.restored_from = result.manifest.id
        self.lazy_log_dir = Path(result.lazy["log"]).parent if result.lazy else None
        self.reporter.info(f"restored {result.manifest.id} as PID {self.pid} "
                           f"(restore {self.restores} of {self.request.max_restores})")
        self._event("restored", id=result.manifest.id, pid=self.pid, restores=self.restores,
                    max_restores=self.request.max_restores, lazy=result.lazy is not None,
                    duration_ms=result.duration_ms)
        if self.stopping_signal is not None:
            # A SIGINT or SIGTERM came while the tree was being restored (there was no tree to
            # forward it to): the restored one gets it now, and supervision ends with it.
            self._forward(self.stopping_signal, None)
        return True
