"""Use case `ckpt run` of several commands as one group (issue 26): each command its own tree
(a session of its own), every periodic checkpoint one group checkpoint of all of them
(ckpt/commands/group.py: one consistent cut, connections between members included), and when
any member dies, every member still running is ended and the whole group is restored from the
newest group checkpoint; supervision goes on with the restored trees.

Why the whole group: the members talk to each other (a server and its client, a pipeline over
TCP); a member restored alone would come back to peers that went on without it, its
connections to them in another state. Restored together, from one cut, they agree.

What a single command's run does is in ckpt/commands/run.py; what is the same here (the
checks, the name's lock, the run's files, the backoff between restores, the events) comes from
there. Not here: CKPT_SOCKET (a program asking for its own checkpoints: a group checkpoint is
taken for all members at once, by the supervisor), hooks and --copy-to, which a group
checkpoint does not take (refused before anything starts).

A member's clean exit (status 0) ends the group's supervision: the others are asked to end
(SIGTERM, then SIGKILL after GRACE_S) and `ckpt run` exits 0. The group can no longer be
checkpointed whole, and restoring it would run the finished member again.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

from ckpt.commands.run import (RestoreBackoff, RunFiles, RunRequest, become_subreaper, check_request, take_signals,
                               command_environment, describe_status, hold_the_name, start_command)
from ckpt.errors import CkptError, UsageError
from ckpt.reporting import LogReporter, NullReporter, Reporter
from ckpt.settings import Settings, StoreLocation
from ckpt.store.password import PasswordSource
from ckpt.system import procs
from ckpt.system.textutil import human_bytes

if TYPE_CHECKING:
    from ckpt.store import Origin

GRACE_S = 10.0  # after a clean exit or a forwarded signal: how long the other members have to end
REAP_LIMIT_S = 5.0  # for killed trees to be gone (their PIDs free for the restore)
POLL_S = 0.05


def check_group_request(request: RunRequest) -> None:
    """A group run's request: what any run needs, and none of what a group checkpoint does not take."""
    check_request(request)
    for flag, given in (("--pre-dump", request.pre_dump_hook), ("--post-restore", request.post_restore_hook),
                        ("--copy-to", request.copy_to)):
        if given:
            raise UsageError(f"{flag} is not taken by a run of several commands (a group checkpoint has no "
                             "hooks and copies nothing)", hint=f"leave {flag} out, or run one command")


class GroupSupervisor:
    """Supervises request.commands as one group until a clean exit, a forwarded signal, or the
    restore limit; run() returns the exit code. The members' root PIDs are self.pids, in the
    order of the commands (a restore gives them back, CRIU restores PIDs)."""

    def __init__(self, store_root: StoreLocation, request: RunRequest, settings: Settings,  # noqa: PLR0913
                 reporter: Reporter = NullReporter(), on_event: Callable[[dict], None] | None = None,
                 passwords: PasswordSource | None = None):
        check_group_request(request)
        self.store_root, self.request, self.settings = store_root, request, settings
        self.passwords = PasswordSource.passed_or_settings(passwords, settings)
        self.reporter = reporter
        self.on_event = on_event or (lambda _event: None)
        self.pids: list[int] = []
        self.reaped: dict[int, int] = {}  # a member root that ended: its status (its PID may be anyone's now)
        self.stopping_signal: int | None = None
        self.checkpoints: list[str] = []  # the group checkpoints taken, oldest first
        self.restores = 0
        self.backoff = RestoreBackoff()
        self.restored_at: float | None = None
        self.log: Any = None
        self._name_lock: int | None = None

    # ---- start and end ----

    def run(self) -> int:
        take_signals(self._forward)
        try:
            self.start()
            return self._supervise()
        finally:
            if self.log is not None:
                self.log.close()

    def start(self) -> list[int]:
        """Every command started, each in a session of its own, their output to one file."""
        procs.require_root()
        become_subreaper()
        files = RunFiles.of(self.store_root, self.settings, self.request)
        self._name_lock = hold_the_name(files.run_dir, self.request.name)
        self.log = files.open_log()
        self.reporter = LogReporter(self.reporter, self.log)
        env = command_environment(self.request.name, self.store_root)
        with open(os.open(files.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
            for command in self.request.commands:
                try:
                    self.pids.append(start_command(command, out, env))
                except UsageError:
                    self._end_members(signal.SIGKILL, 0.0)  # a group starts whole or not at all
                    raise
                self.reporter.info(f"started PID {self.pids[-1]}: {' '.join(command)} (output: {files.output}; "
                                   f"ckpt's log: {files.log})")
                self._event("started", pid=self.pids[-1], command=list(command), output=str(files.output),
                            log=str(files.log))
        return self.pids

    def _forward(self, signum, _frame) -> None:
        self.stopping_signal = signum
        for pid in self._running():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _running(self) -> list[int]:
        return [pid for pid in self.pids if pid not in self.reaped]

    def _event(self, kind: str, **fields) -> None:
        try:
            self.on_event({"event": kind, "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                           **fields})
        except OSError as exc:  # the reader of --json's stdout went away: supervision goes on
            self.on_event = lambda _event: None
            self.reporter.warn(f"events can no longer be printed ({exc.strerror or exc}); supervision goes on")

    def _exit(self, reason: str, pid: int, status: str, code: int) -> int:
        self._event("exit", pid=pid, reason=reason, status=status, exit_code=code,
                    checkpoints=len(self.checkpoints), restores=self.restores)
        return code

    # ---- the loop ----

    def _supervise(self) -> int:
        next_dump = time.monotonic() + min(self.request.first_after, self.request.every).total_seconds()
        while True:
            self._reap()
            dead = next((pid for pid in self.pids if pid in self.reaped), None)
            if dead is not None:
                code = self._after_death(dead)
                if code is not None:
                    return code
                next_dump = time.monotonic() + self.request.every.total_seconds()
                continue
            if time.monotonic() >= next_dump:
                if self.checkpoint_group():
                    self._forget()
                next_dump = time.monotonic() + self.request.every.total_seconds()
            time.sleep(POLL_S)

    def _after_death(self, pid: int) -> int | None:
        """A member's root ended: supervision ends (its exit code returned), or the group is
        restored (None)."""
        text, code, clean = describe_status(self.reaped[pid])
        if clean or self.stopping_signal is not None:
            self.reporter.info(f"PID {pid} {text}; supervision ends (the other members are ended)")
            self._end_members(signal.SIGTERM, GRACE_S)
            return self._exit("exited" if self.stopping_signal is None else "stopped", pid, text, code)
        self.reporter.warn(f"PID {pid} {text}")
        self._event("died", pid=pid, status=text, exit_code=code, lazy_restore_failure=None)
        if not self.checkpoints:
            self.reporter.warn("no group checkpoint was taken yet: nothing to restore; ending the other members")
            return self._end_and_exit("no_checkpoint", pid, text, code)
        if self.restores >= self.request.max_restores:
            self.reporter.warn(f"restore limit ({self.request.max_restores}) reached; giving up")
            return self._end_and_exit("restore_limit", pid, text, code)
        if not self._pause_before_restore(pid):
            return self._end_and_exit("stopped", pid, text, code)
        if not self._restore():
            return self._exit("restore_failed", pid, text, code)
        return None

    def _end_and_exit(self, reason: str, pid: int, status: str, code: int) -> int:
        self._end_members(signal.SIGKILL, 0.0)
        return self._exit(reason, pid, status, code)

    def _pause_before_restore(self, pid: int) -> bool:
        """Waits as RestoreBackoff says; False when a SIGINT or SIGTERM came meanwhile."""
        ran = None if self.restored_at is None else time.monotonic() - self.restored_at
        pause = self.backoff.pause(ran)
        if pause:
            self.reporter.warn(f"PID {pid} died {ran:.1f} s after restore {self.restores}: waiting {pause:g} s "
                               f"before restore {self.restores + 1} of {self.request.max_restores}")
            self._event("restore_delayed", pid=pid, ran_s=round(ran or 0.0, 3), delay_s=pause,
                        restores=self.restores, max_restores=self.request.max_restores)
        deadline = time.monotonic() + pause
        while self.stopping_signal is None and time.monotonic() < deadline:
            self._reap()
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if self.stopping_signal is not None:
            self.reporter.info(f"stopped by signal {self.stopping_signal} before restoring; supervision ends")
            return False
        return True

    # ---- processes ----

    def _reap(self) -> None:
        """Reaps every dead child (we are a subreaper); a member root's status is kept."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.pids and pid not in self.reaped:
                self.reaped[pid] = status

    def _end_members(self, first: int, grace: float) -> None:
        """Ends every member still running and every descendant of ours (a member's children,
        re-parented to us when their parent died, keep PIDs a restore needs): `first` to each
        member root, up to `grace` seconds for them to end, then SIGKILL to everything left;
        reaped, at most REAP_LIMIT_S more."""
        for pid in self._running():
            _signal(pid, first)
        deadline = time.monotonic() + grace
        while self._running() and time.monotonic() < deadline:
            self._reap()
            time.sleep(POLL_S)
        left = [*self._running(), *_descendants()]
        for pid in left:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_LIMIT_S
        while time.monotonic() < deadline and any(procs.process_state(p) is not None for p in left):
            self._reap()
            time.sleep(POLL_S / 2)

    # ---- checkpoints, retention, restores ----

    @property
    def _origin(self) -> Origin:
        from ckpt.store import Origin

        return Origin("run", self.request.name)

    def checkpoint_group(self) -> bool:
        """One group checkpoint of every member; False when it failed (said; supervision goes on)."""
        from ckpt.commands.group import GroupDumpRequest, group_dump

        request = GroupDumpRequest(members=[str(pid) for pid in self.pids], name=self.request.name,
                                   origin=self._origin)
        try:
            result = group_dump(self.store_root, request, self.reporter, settings=self.settings,
                                passwords=self.passwords)
        except CkptError as exc:
            self._reap()
            if any(pid in self.reaped for pid in self.pids):
                return False  # a member died meanwhile: the loop restores the group
            self.reporter.warn(f"group checkpoint failed: {exc}")
            self._event("group_checkpoint_failed", pids=list(self.pids), error=str(exc))
            return False
        group = result.group
        self.checkpoints.append(group.id)
        stored = sum(int(r.get("bytes_stored") or 0) for r in result.members)
        self.reporter.info(f"group checkpoint {group.id} of PIDs {', '.join(map(str, self.pids))}: "
                           f"freeze skew {group.stats.get('freeze_skew_ms')} ms, {human_bytes(stored)} new")
        self._event("group_checkpoint", id=group.id, pids=list(self.pids),
                    members=[{"pid": m.pid, "checkpoint": m.checkpoint} for m in group.members],
                    bytes_stored=stored, freeze_skew_ms=group.stats.get("freeze_skew_ms"))
        return True

    def _forget(self) -> None:
        """--keep-last: the same retention as a single command's run, of this run's origin."""
        from ckpt.commands.forget import forget
        from ckpt.schedule.retention import Policy
        from ckpt.store import Store

        if not self.request.keep_last:
            return
        try:
            store = Store.open(self.store_root, False, settings=self.settings, passwords=self.passwords)
            forgotten = forget(store, Policy(keep_last=self.request.keep_last), name=self.request.name, prune=True,
                               origin=self._origin, reporter=self.reporter)
        except CkptError as exc:
            self.reporter.warn(f"retention failed: {exc}")
            self._event("retention_failed", error=str(exc))
            return
        if forgotten.removed:
            self._event("forgot", ids=[d.id for d in forgotten.removed], keep_last=self.request.keep_last)

    def _restore(self) -> bool:
        """Every member still running ended, then the newest group checkpoint restored whole."""
        from ckpt.commands.group import GroupRestoreRequest, group_restore

        group_id = self.checkpoints[-1]
        self._end_members(signal.SIGKILL, 0.0)
        started = time.monotonic()
        try:
            result = group_restore(self.store_root, GroupRestoreRequest(ref=group_id), self.reporter,
                                   settings=self.settings, passwords=self.passwords)
        except CkptError as exc:
            self.reporter.warn(f"restore failed: {exc}")
            self._event("restore_failed", id=group_id, error=str(exc))
            return False
        self.restores += 1
        self.pids, self.reaped = [int(m["pid"]) for m in result.members], {}
        self.restored_at = time.monotonic()
        self.reporter.info(f"restored group {group_id} as PIDs {', '.join(map(str, self.pids))} "
                           f"(restore {self.restores} of {self.request.max_restores})")
        self._event("group_restored", id=group_id, pids=list(self.pids), restores=self.restores,
                    max_restores=self.request.max_restores,
                    duration_ms=round((time.monotonic() - started) * 1000, 1))
        if self.stopping_signal is not None:
            # A SIGINT or SIGTERM came while the group was being restored: the restored members
            # get it now, and supervision ends with them.
            self._forward(self.stopping_signal, None)
        return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _descendants() -> list[int]:
    """Every living descendant of this process (as the subreaper, the members' orphans too)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process().children(recursive=True)]
    except psutil.Error:
        return []
