"""The watcher of a lazy restore: the tree never runs on memory its page server did not fill in.

A lazily restored process's memory is registered with userfaultfd, and only the lazy-pages
daemon holds the userfaultfds (CRIU's restorer closes the process's own): ckpt's own, which is
the page server's process itself (ckpt/restore/uffdlazy.py), or CRIU's (CKPT_LAZY_FILL=0). When the daemon
ends early (killed, or failing because the page server was killed), the kernel releases them:
the memory is no longer watched and every page not filled in yet reads as zeros. Measured
here: daemon and page server killed 0.05 s after a lazy restore of a 1 GiB Python process,
which then segfaulted at address 0 (its heap read as zeros); killed later, its data reads as
zeros. UFFD_FEATURE_SIGBUS cannot help: it acts only while a userfaultfd is open, and CRIU
chooses the features.

So a third process, this watcher, holds its own copy of each userfaultfd (pidfd_getfd from the
daemon), taken before the tree runs (CRIU's post-restore notification: every process has
registered its memory, none runs). While a copy is open, a fault the daemon can no longer
answer waits in the kernel (killable) instead of reading zeros; measured: the process sleeps
in handle_userfault until killed. The page server tells the watcher when the daemon is done;
if the server or the daemon ends before that, the watcher kills the tree (SIGKILL) and writes
lazy-failure.json into the restore's log directory, which `ckpt list`, `show` and `run` report.

A copy is dropped once the daemon has closed its own (it does when a process has all its pages
or has exited): held longer, that process's unmaps and forks, which the kernel reports to the
userfaultfd and waits to be read, would wait for nobody. The watcher looks every 50 ms, also
for the userfaultfds the daemon receives for processes the tree forks after the restore: such
a process forked less than 50 ms before the daemon dies may read zeros before it is killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

from ckpt.system.files import atomic_write_bytes
from ckpt.system.procfs import stat_fields

FAILURE_FILE = "lazy-failure.json"
SCAN_INTERVAL_S = 0.05
HANDOVER_TIMEOUT_S = 10.0
_SYS_PIDFD_GETFD = 438
_SYS_KCMP = 312
_KCMP_FILE = 0
_PF_EXITING = 0x4
_UFFD_LINK = "anon_inode:[userfaultfd]"

_libc = ctypes.CDLL(None, use_errno=True)


def protect_from_oom() -> str | None:
    """Asks the OOM killer to spare this process (and what it execs or forks later); returns
    why it could not (lowering oom_score_adj needs CAP_SYS_RESOURCE, which some containers drop)."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"-1000")
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror
    return None


def failures(logs_dir: Path) -> list[dict]:
    """The lazy restores of one checkpoint whose page server ended before the memory was back
    (the records the watcher left in logs/<id>/lazy-*/), oldest first."""
    found = []
    for path in sorted(logs_dir.glob(f"lazy-*/{FAILURE_FILE}")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            found.append({"message": f"unreadable record {path}"})
    return found


def describe(record: dict) -> str:
    """One line for a failure record."""
    return record.get("message") or "a lazy restore's page server ended before the memory was back"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return stat_fields(pid)
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields and fields[0] not in ("Z", "X") else None


def _alive_not_exiting(pid: int) -> bool:
    # PF_EXITING is set before an exiting process's descriptors are closed, and its pidfd
    # becomes readable only after: without it a descriptor table emptied by the exit would
    # read as the daemon having closed them.
    fields = _stat_fields(pid)
    return bool(fields and fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING)


def _uffds_of(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == _UFFD_LINK:
                found.add(int(name))
        except OSError:
            pass
    return found


def _same_file(ours: int, pid: int, theirs: int) -> bool | None:
    result = _libc.syscall(_SYS_KCMP, os.getpid(), pid, _KCMP_FILE, ours, theirs)
    return None if result < 0 else result == 0


def _descendants(roots: list[int]) -> list[int]:
    result, todo, seen = [], list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        result.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
            except OSError:
                pass
    return result


class Watcher:
    """Runs in its own process; see the module's docstring."""

    def __init__(self, status_fd: int, control_fd: int, checkpoint_id: str, tree_pids: list[int], server_pid: int,
                 work_dir: Path):
        self.status_fd = status_fd
        self.control_fd: int | None = control_fd
        self.checkpoint_id = checkpoint_id
        self.tree_pids = tree_pids
        self.server_pid = server_pid
        self.work_dir = work_dir
        self.daemon: int | None = None
        self.held: dict[int, int] = {}  # our descriptor -> the daemon's descriptor number
        self.starts: dict[int, str] = {}  # the tree's PIDs once handed over -> their start times
        self.handed_over = False
        self.abandoned = False  # `ckpt restore` ended before handing the tree over

    def run(self) -> int:
        status = b""
        control = b""
        while True:
            fds = [self.status_fd] + ([self.control_fd] if self.control_fd is not None else [])
            timeout = SCAN_INTERVAL_S if self.handed_over else None
            ready = select.select(fds, [], [], timeout)[0]
            if self.control_fd in ready:
                data = os.read(self.control_fd, 256)
                control += data
                if not data:
                    os.close(self.control_fd)
                    self.control_fd = None
                    self.abandoned = not self.handed_over
                while b"\n" in control:
                    line, control = control.split(b"\n", 1)
                    self._command(line)
            if self.status_fd in ready:
                data = os.read(self.status_fd, 4096)
                status += data
                while b"\n" in status:
                    line, status = status.split(b"\n", 1)
                    if line.startswith(b"P"):
                        self.daemon = int(line[1:])
                    elif line == b"D":
                        return self._done()
                    elif line.startswith(b"F"):
                        return self._failed(f"the page server failed: {line[1:].decode(errors='replace')}")
                if not data:
                    return self._failed(f"the page server (PID {self.server_pid}) ended")
            if self.abandoned and self.daemon is not None:
                self._abandon(self.daemon)
            if self.handed_over:
                self._rescan()

    def _command(self, line: bytes) -> None:
        if line.startswith(b"G") and self.control_fd is not None:
            try:
                self._take_over(int(line[1:]))
                answer = b"K\n"
            except OSError as exc:
                answer = b"E" + str(exc).encode()[:400] + b"\n"
            except TimeoutError as exc:
                answer = b"E" + str(exc).encode()[:400] + b"\n"
            os.write(self.control_fd, answer)

    def _take_over(self, expected: int) -> None:
        """Holds a copy of the daemon's userfaultfds, once it has received the expected number."""
        if self.daemon is None:
            raise OSError("the lazy-pages daemon is not running")
        deadline = time.monotonic() + HANDOVER_TIMEOUT_S
        while len(theirs := _uffds_of(self.daemon)) < expected:
            if time.monotonic() > deadline or not _alive_not_exiting(self.daemon):
                raise TimeoutError(f"the lazy-pages daemon holds {len(theirs)} of the {expected} userfaultfds "
                                   "of the restored tree")
            time.sleep(0.01)
        pidfd = os.pidfd_open(self.daemon)
        try:
            for fd in sorted(theirs):
                self._grab(pidfd, fd)
        finally:
            os.close(pidfd)
        if len(self.held) < expected:
            raise OSError(f"could take only {len(self.held)} of the {expected} userfaultfds of the restored tree")
        self.starts = {pid: start for pid in self.tree_pids if (start := _start_time(pid)) is not None}
        self.handed_over = True

    def _grab(self, pidfd: int, theirs: int) -> None:
        ours = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, theirs, 0)
        if ours >= 0:
            self.held[ours] = theirs

    def _rescan(self) -> None:
        """Drops the copies the daemon no longer holds, takes those of userfaultfds it received."""
        if self.daemon is None:
            return
        theirs = _uffds_of(self.daemon)
        kept = {ours: fd for ours, fd in self.held.items() if fd in theirs and _same_file(ours, self.daemon, fd)}
        if not _alive_not_exiting(self.daemon):
            return  # what it holds now is its exit's doing: the failure is reported on the status pipe
        for ours in set(self.held) - set(kept):
            os.close(ours)
            del self.held[ours]
        new = theirs - set(kept.values())
        if new:
            try:
                pidfd = os.pidfd_open(self.daemon)
            except OSError:
                return
            try:
                for fd in new:
                    self._grab(pidfd, fd)
            finally:
                os.close(pidfd)

    def _abandon(self, daemon: int) -> None:
        """`ckpt restore` ended (killed, or failed) before CRIU's post-restore notification:
        no tree depends on this server, whose daemon would otherwise wait for a restoring CRIU
        forever, holding the store's shared lock (every prune and rm then waited) and a record
        that made every later dump of those PIDs wait. A CRIU that got as far as restoring
        without ckpt's answer fails the restore and kills what it made. The daemon is ended;
        the server sees its connection close and cleans up as after any failure."""
        self.abandoned = False
        try:
            os.kill(daemon, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _release(self) -> None:
        for ours in self.held:
            os.close(ours)
        self.held.clear()

    def _done(self) -> int:
        self._release()
        return 0

    def _failed(self, cause: str) -> int:
        if not self.handed_over:
            self._release()
            return 0  # the tree never ran: the restore fails, and `ckpt restore` says why
        roots = [pid for pid, start in self.starts.items() if _start_time(pid) == start]
        killed: list[int] = []
        for _ in range(3):  # a process forking as it is killed: its child is killed next round
            tree = [pid for pid in _descendants(roots) if pid not in killed and _start_time(pid) is not None]
            if not tree:
                break
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        self._release()  # only now: until the tree is dead its faults must keep waiting
        message = (f"the lazy restore of {self.checkpoint_id} lost its page server before the memory was back "
                   f"({cause}); " + (f"the restored tree (PIDs {', '.join(map(str, sorted(killed)))}) was killed "
                                      "so that it never ran on missing memory" if killed
                                      else "the restored tree had already ended"))
        record = {"checkpoint": self.checkpoint_id, "time": datetime.now(timezone.utc).isoformat(),
                  "cause": cause, "server_pid": self.server_pid, "daemon_pid": self.daemon,
                  "restored_pids": sorted(self.starts), "killed": sorted(killed), "message": message}
        try:
            atomic_write_bytes(self.work_dir / FAILURE_FILE, json.dumps(record, indent=1).encode() + b"\n")
        except OSError:
            pass  # nowhere else to say it; the tree is dead either way
        # The dead server's spool of fetched segments (lazy.SPOOL_DIR): nobody else removes it.
        shutil.rmtree(self.work_dir / "spool", ignore_errors=True)
        return 1
