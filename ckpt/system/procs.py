"""Facts about target processes (psutil and /proc) and the pre-flight checks of a dump."""

from __future__ import annotations

import os
import signal
import stat
import time
from dataclasses import dataclass, field

import psutil

from ckpt.errors import PermissionProblem, PidInUse, ProcessNotFound, StoreBusy, TargetRefused, UsageError
from ckpt.system.procfs import stat_fields
from ckpt.system.textutil import printable

PF_KTHREAD = 0x00200000
PF_EXITING = 0x00000004
SIGKILL_BIT = 1 << (9 - 1)  # of the pending-signal masks in /proc/PID/status


@dataclass
class TargetFacts:
    pid: int
    command: str
    pids: list[int]  # the whole tree, root first
    needs_shell_job: bool
    has_tcp_established: bool
    has_file_locks: bool
    memory_bytes: int = 0  # resident memory of the tree: roughly what CRIU will write
    has_tty: bool = False  # a controlling terminal: a restore must give it one
    # Pipe ends whose other end is outside the tree (`agent | tee log`): see external_pipes.
    external_pipes: list[dict] = field(default_factory=list)
    # UNIX stream sockets connected to a process outside the tree (a systemd service's stdout
    # to journald, a child's stdio under Node.js): see external_stream_sockets.
    external_sockets: list[dict] = field(default_factory=list)
    # UNIX datagram sockets connected to a socket outside the tree (syslog): see
    # external_datagram_sockets.
    external_datagram_sockets: list[dict] = field(default_factory=list)
    # Regular files the tree holds open or mapped that were deleted: see deleted_files.
    deleted_files: list[dict] = field(default_factory=list)
    # Logs the tree also reads, which a restore refuses once they grow: see logs_read_back.
    logs_read_back: list[dict] = field(default_factory=list)


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionProblem("ckpt must run as root to dump or restore processes (CRIU needs it)",
                                hint="run it with sudo")


def command_line(proc: psutil.Process) -> str:
    try:
        cmd = proc.cmdline()
        return " ".join(printable(a) for a in cmd) if cmd else f"[{printable(proc.name())}]"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def is_kernel_thread(pid: int) -> bool:
    try:
        flags = int(stat_fields(pid)[6])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & PF_KTHREAD)


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc/PID/stat, or None when there is no such process."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


# The kernel's hard limit of /proc/sys/kernel/pid_max (PID_MAX_LIMIT on 64-bit): no PID reaches it.
PID_MAX_LIMIT = 4 * 1024 * 1024


def check_pid(pid: int) -> None:
    """A PID is a number from 1 to the kernel's limit: anything else is a usage error (0 and -1
    mean a process group or every process to kill(2), never one process)."""
    if not 0 < pid < PID_MAX_LIMIT:
        raise UsageError(f"invalid PID {pid}", hint="give the PID of a running process (a number above 0)")


def preflight(pid: int) -> TargetFacts:
    """Refuses targets ckpt must not dump and detects the CRIU options the tree needs."""
    check_pid(pid)
    if pid == 1:
        raise TargetRefused("PID 1 (init) cannot be checkpointed: it would take the whole system with it",
                            hint="give the PID of the process tree you want to save")
    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:
            raise ProcessNotFound(f"process {pid} has exited (it is a zombie)")
    except psutil.NoSuchProcess:
        raise ProcessNotFound(f"no process with PID {pid}", hint="check the PID with 'ps'") from None
    if is_kernel_thread(pid):
        raise TargetRefused(f"PID {pid} is a kernel thread; only user processes can be checkpointed")
    _refuse_thread(pid)
    me = os.getpid()
    ancestors = {p.pid for p in psutil.Process(me).parents()}
    if pid == me:
        raise TargetRefused(f"PID {pid} is ckpt itself", hint="give the PID of another process")
    if pid in ancestors:
        relation = "parent" if pid == os.getppid() else "ancestor"
        raise TargetRefused(f"PID {pid} is ckpt's own {relation} ({command_line(root)}): "
                            "ckpt would be inside the tree it dumps",
                            hint="run ckpt from another shell, or dump the child process instead")
    try:
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        raise ProcessNotFound(f"process {pid} exited during the pre-flight checks") from None
    tree_pids = [p.pid for p in tree]
    _refuse_traced(tree_pids)
    _refuse_session_led_from_another_pid_namespace(root.pid, command_line(root))
    needs_shell_job = _needs_shell_job(root)
    has_tcp = _has_tcp_connections(tree)
    memory = _resident_bytes(tree)
    return TargetFacts(pid=pid, command=command_line(root), pids=tree_pids, needs_shell_job=needs_shell_job,
                       has_tcp_established=has_tcp, has_file_locks=_holds_file_locks(set(tree_pids)),
                       memory_bytes=memory, has_tty=_has_tty(root.pid),
                       external_pipes=external_pipes(tree_pids),
                       external_sockets=external_stream_sockets(tree_pids),
                       external_datagram_sockets=external_datagram_sockets(tree_pids),
                       deleted_files=deleted_files(tree_pids), logs_read_back=logs_read_back(tree_pids))


def _has_tcp_connections(tree: list[psutil.Process]) -> bool:
    """Whether a process of the tree has a TCP connection other than listening or closed ones
    (CRIU then needs --tcp-established)."""
    has_tcp = False
    for proc in tree:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_ESTABLISHED or conn.status not in (psutil.CONN_LISTEN,
                                                                                 psutil.CONN_CLOSE):
                    has_tcp = True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return has_tcp


def _resident_bytes(tree: list[psutil.Process]) -> int:
    memory = 0
    for proc in tree:
        try:
            memory += proc.memory_info().rss
        except psutil.Error:
            pass
    return memory


def tracer_of(pid: int) -> int:
    """The PID tracing pid (ptrace: a debugger, strace, or a CRIU dumping it), 0 if none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _refuse_traced(pids: list[int]) -> None:
    """CRIU seizes every task with ptrace, which fails on a task someone else traces; it then
    said only "Unable to detach from PID: No such process"."""
    for pid in pids:
        tracer = tracer_of(pid)
        if tracer:
            try:
                name = psutil.Process(tracer).name()
            except psutil.Error:
                name = "?"
            raise StoreBusy(f"PID {pid} is being traced by PID {tracer} ({name}): a debugger, strace, or another "
                            "checkpoint of it holds it", hint="wait for it to finish or detach it, then dump again")


O_ACCMODE = 0o3


def _fd_links(pid: int) -> list[tuple[int, str]]:
    """(fd, what /proc/PID/fd/FD links to) of every descriptor of the process still open."""
    result: list[tuple[int, str]] = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return result
    for fd in fds:
        try:
            result.append((int(fd), os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            continue  # closed meanwhile
    return result


def _fd_inodes(pid: int, kind: str) -> list[tuple[int, int]]:
    """(fd, inode) of every descriptor of the process that is a `kind` ("pipe", "socket")."""
    prefix = f"{kind}:["
    return [(fd, int(link[len(prefix):-1])) for fd, link in _fd_links(pid) if link.startswith(prefix)]


def _pipe_fds(pid: int) -> list[tuple[int, int, bool]]:
    """(fd, pipe inode, is the write end) of every pipe the process holds."""
    result = []
    for fd, inode in _fd_inodes(pid, "pipe"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        result.append((fd, inode, flags & O_ACCMODE == os.O_WRONLY))
    return result


def external_pipes(tree_pids: list[int]) -> list[dict]:
    """Pipe ends of the tree whose other end no process of the tree holds.

    CRIU dumps them without complaint, but restores them as new pipes with nobody at the other
    end: a restored `agent` of `agent | tee log` dies of SIGPIPE at its next write. ckpt
    records them so that a restore can give the write ends somewhere to write (see restore).
    Each: {"pid", "fd", "inode", "end": "write"|"read", "peer": "command (PID n)" or None}."""
    ends: dict[int, set[bool]] = {}
    held = []
    for pid in tree_pids:
        for fd, inode, write in _pipe_fds(pid):
            ends.setdefault(inode, set()).add(write)
            held.append((pid, fd, inode, write))
    outside = {inode for inode, kinds in ends.items() if len(kinds) < 2}
    if not outside:
        return []
    peers = _holders(outside, set(tree_pids), lambda pid: [inode for _, inode in _fd_inodes(pid, "pipe")])
    return [{"pid": pid, "fd": fd, "inode": inode, "end": "write" if write else "read", "peer": peers.get(inode)}
            for pid, fd, inode, write in sorted(held) if inode in outside]


def logs_read_back(tree_pids: list[int]) -> list[dict]:
    """Logs the tree also reads: regular files it writes as a log (with O_APPEND, or as its
    stdout or stderr) that it also holds open for reading (O_RDWR, or another descriptor) or
    maps. A restore lets a file the tree only writes to have grown since the dump (the restored
    process writes on at its offset), not one it reads (ckpt/restore/hostcheck.py): once such a
    log grows, a restore of the checkpoint is refused. Each file once: {"pid", "fd", "path",
    "how" (how the tree reads it)}."""
    logs: dict[tuple[int, int], dict] = {}
    readers: dict[tuple[int, int], str] = {}
    mapped: dict[str, int] = {}
    for pid in tree_pids:
        for fd, path, key, flags in _regular_fds(pid):
            access = flags & O_ACCMODE
            if access != os.O_RDONLY and (flags & os.O_APPEND or fd in (1, 2)):
                logs.setdefault(key, {"pid": pid, "fd": fd, "path": path})
            if access == os.O_RDWR:
                readers.setdefault(key, f"PID {pid} opened it for reading and writing, fd {fd}")
            elif access == os.O_RDONLY:
                readers.setdefault(key, f"PID {pid} holds it open read-only, fd {fd}")
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        mapped.setdefault(fields[5].rstrip("\n"), pid)
        except OSError:
            continue
    found = []
    for key, log in logs.items():
        how = readers.get(key) or (f"PID {mapped[log['path']]} maps it" if log["path"] in mapped else None)
        if how:
            found.append({**log, "how": how})
    return sorted(found, key=lambda f: (f["pid"], f["fd"]))


def _regular_fds(pid: int) -> list[tuple[int, str, tuple[int, int], int]]:
    """(fd, path, (device, inode), open flags) of every regular file the process holds open by
    a path that exists (deleted files: see deleted_files)."""
    result: list[tuple[int, str, tuple[int, int], int]] = []
    for fd, link in _fd_links(pid):
        if not link.startswith("/") or link.endswith(" (deleted)"):
            continue
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        result.append((int(fd), link, (st.st_dev, st.st_ino), flags))
    return result


# Deleted "files" that are not files CRIU saves as such: shared anonymous memory, System V
# shared memory, memfd (each dumped its own way).
_NOT_GHOSTS = ("/dev/zero", "/SYSV", "/memfd:", "/[aio]", "/anon_hugepage")


def deleted_files(tree_pids: list[int]) -> list[dict]:
    """Regular files the tree holds open or mapped that were deleted since (a Python
    tempfile.TemporaryFile, a log logrotate removed). CRIU saves their content in the
    checkpoint ("ghost files"), and fails the dump for one larger than its limit (1 MiB unless
    told). Each file once: {"pid", "fd" (None for a mapping), "path", "size"}."""
    found: dict[tuple[int, int], dict] = {}

    def note(pid: int, fd: int | None, link: str, proc_path: str) -> None:
        path = link[:-len(" (deleted)")]
        if path.startswith(_NOT_GHOSTS):
            return
        try:
            st = os.stat(proc_path)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in found:
            found[(st.st_dev, st.st_ino)] = {"pid": pid, "fd": fd, "path": path, "size": st.st_size}

    for pid in tree_pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.endswith(" (deleted)"):
                note(pid, int(fd), link, f"/proc/{pid}/fd/{fd}")
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if line.endswith(" (deleted)\n"):
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6:
                            note(pid, None, fields[5].rstrip("\n"), f"/proc/{pid}/map_files/{fields[0]}")
        except OSError:
            continue
    return sorted(found.values(), key=lambda f: (f["pid"], f["fd"] is None, f["fd"] or 0, f["path"]))


def _holders(inodes: set[int], exclude: set[int], inodes_of) -> dict[int, str]:
    """For each inode, one process outside `exclude` whose descriptors (inodes_of) hold it."""
    found: dict[int, str] = {}
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        for inode in inodes_of(proc.pid):
            if inode in inodes and inode not in found:
                found[inode] = f"{command_line(proc).split(' ')[0].rsplit('/', 1)[-1]} (PID {proc.pid})"
        if len(found) == len(inodes):
            break
    return found


def external_stream_sockets(tree_pids: list[int]) -> list[dict]:
    """UNIX stream sockets of the tree connected to a socket no process of the tree holds.

    CRIU refuses to dump them ("Can't dump half of stream unix connection", even with
    --ext-unix-sk). ckpt names them to CRIU as external (`unix[<inode>]`) and a restore relays
    what the tree writes there to its output, as for pipes to the outside. Each: {"pid", "fd",
    "inode", "peer_inode", "peer": "journald (PID n)" or None}."""
    from ckpt.system.unixdiag import stream_peers  # netlink, only when the tree holds sockets

    return _external_unix_sockets(tree_pids, stream_peers)


def external_datagram_sockets(tree_pids: list[int]) -> list[dict]:
    """UNIX datagram sockets of the tree connected to a socket outside it (syslog's /dev/log,
    a collector's socket), as external_stream_sockets gives them.

    CRIU dumps them only with --ext-unix-sk, and a restore connects them again to the same
    path (the peer must be bound to one, and be there then). Each also has "peer_path"."""
    from ckpt.system.unixdiag import datagram_peers  # netlink, only when the tree holds sockets

    names: dict[int, str] = {}

    def peers() -> dict[int, int]:
        found, bound = datagram_peers()
        names.update(bound)
        return found

    sockets = _external_unix_sockets(tree_pids, peers)
    for sock in sockets:
        sock["peer_path"] = names.get(sock["peer_inode"])
    return sockets


def _external_unix_sockets(tree_pids: list[int], connected_peers) -> list[dict]:
    held = [(pid, fd, inode) for pid in tree_pids for fd, inode in _fd_inodes(pid, "socket")]
    if not held:
        return []
    try:
        peers = connected_peers()
    except OSError:
        return []  # no sock_diag here (a restricted container): CRIU's own error then names the socket
    inside = {inode for _, _, inode in held}
    outside = {(pid, fd, inode): peers[inode] for pid, fd, inode in held
               if peers.get(inode) and peers[inode] not in inside}
    if not outside:
        return []
    names = _holders(set(outside.values()), set(tree_pids),
                     lambda pid: [inode for _, inode in _fd_inodes(pid, "socket")])
    return [{"pid": pid, "fd": fd, "inode": inode, "peer_inode": peer, "peer": names.get(peer)}
            for (pid, fd, inode), peer in sorted(outside.items())]


def _refuse_session_led_from_another_pid_namespace(pid: int, command: str) -> None:
    """/proc reads the session id as 0 when the session leader lives in an ancestor PID namespace
    (a process started inside a container by something outside it, such as a CI runner).
    CRIU refuses such a tree after freezing it, with a message that names neither cause nor fix."""
    try:
        sid = int(stat_fields(pid)[3])
    except (OSError, ValueError, IndexError):
        return
    if sid == 0:
        raise TargetRefused(f"PID {pid} ({command}) belongs to a session led from outside this PID namespace, "
                            "which CRIU cannot checkpoint",
                            hint="start the program in a session of its own ('setsid PROGRAM') "
                                 "or under 'ckpt run'")


def _needs_shell_job(root: psutil.Process) -> bool:
    """CRIU needs --shell-job when the tree's session or process group is led from outside it,
    or when it has a controlling terminal."""
    try:
        fields = stat_fields(root.pid)
        pgid, sid, tty_nr = int(fields[2]), int(fields[3]), int(fields[4])
    except (OSError, ValueError, IndexError):
        return False
    return sid != root.pid or pgid != root.pid or tty_nr != 0


def _has_tty(pid: int) -> bool:
    try:
        return int(stat_fields(pid)[4]) != 0
    except (OSError, ValueError, IndexError):
        return False


def _holds_file_locks(pids: set[int]) -> bool:
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: POSIX  ADVISORY  WRITE 1234 00:1f:123 0 EOF"; "->" marks blocked waiters.
                if len(parts) > 4 and parts[1] != "->" and parts[4].isdigit() and int(parts[4]) in pids:
                    return True
    except OSError:
        pass
    return False


def thread_group(pid: int) -> int | None:
    """The process (thread group) that thread ID pid belongs to: pid itself for a process, None
    when it is gone. /proc/TID exists for every thread, though /proc lists only processes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _refuse_thread(pid: int) -> None:
    """CRIU takes a thread's ID for a process and fails deep inside ('BUG at criu/pstree.c')."""
    tgid = thread_group(pid)
    if tgid is not None and tgid != pid:
        try:
            what = f" ({command_line(psutil.Process(tgid))})"
        except psutil.Error:
            what = ""
        raise TargetRefused(f"PID {pid} is a thread of process {tgid}{what}, not a process",
                            hint=f"checkpoint its process: ckpt dump {tgid}")


def pid_holder(pid: int) -> str | None:
    """Describes the process holding a PID (or thread ID), None when the PID is free."""
    state = process_state(pid)
    if state is None:
        return None
    if state in ("Z", "X"):
        try:
            parent = int(stat_fields(pid)[1])
            return (f"an exited process that its parent has not reaped "
                    f"({pid_holder(parent) or f'PID {parent}'} must wait() for it)")
        except (OSError, ValueError, IndexError):
            return "an exited process that its parent has not reaped"
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        tgid = int(status["Tgid"].strip())
        proc = psutil.Process(tgid)
        what = command_line(proc)
    except (OSError, KeyError, ValueError, psutil.Error):
        what = "?"
        tgid = pid
    return f"'{what}' (PID {tgid}{'' if tgid == pid else f', thread {pid}'})"


def is_exiting(pid: int) -> bool:
    """Whether a process (or thread) that still shows as running is on its way out: it has
    begun to exit (PF_EXITING), or a SIGKILL is pending for it. A process killed with kill -9
    keeps its PID for as long as it takes to tear down (a large address space, a CRIU dump
    letting go of it, a loaded machine): a second or more."""
    try:
        if int(stat_fields(pid)[6]) & PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return True  # gone meanwhile
    return any(mask & SIGKILL_BIT for mask in pending)


def wait_for_pids_free(pids: list[int], timeout: float = 10.0, live_grace: float = 1.0) -> None:
    """Waits while PIDs are held by zombies or exiting processes (parents here reap late; a
    process killed with kill -9 takes a while to go); raises PidInUse naming the holder if one
    is still taken by a live process after live_grace seconds, or by anything after timeout
    seconds."""
    started = time.monotonic()
    while True:
        taken = [p for p in pids if process_state(p) is not None]
        if not taken:
            return
        live = [p for p in taken if process_state(p) not in (None, "Z", "X") and not is_exiting(p)]
        waited = time.monotonic() - started
        if waited >= timeout or (live and waited >= live_grace):
            pid = (live or taken)[0]
            holder = pid_holder(pid) or "a process that is exiting"
            raise PidInUse(f"PID {pid} needed by the checkpoint is in use by {holder}",
                           hint="end that process, or restore with --new-pidns to give the tree "
                                "its own PID namespace")
        time.sleep(0.05)


def kill_tree(pid: int, settle: float = 10.0) -> None:
    """Ends a process and every descendant of it at once (SIGKILL; the descendants are listed
    and stopped first, so none is missed as its parent dies), then waits up to settle seconds until none
    of them runs any more (each gone or a zombie): a SIGKILL is only pending when kill()
    returns, and a caller that restores the same PIDs next, or checks that nothing runs,
    must not see the tree still there. A process already gone is no error."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    # Stopped first, and listed again until no new process shows up: one that forked after the
    # listing would otherwise leave a child that a SIGKILL of its parent orphans, out of reach.
    stopped: set[int] = set()
    for _ in range(10):
        for victim in victims:
            if victim.pid not in stopped:
                stopped.add(victim.pid)
                _signal(victim.pid, signal.SIGSTOP)
        more = [child for victim in victims for child in _children(victim) if child.pid not in stopped]
        if not more:
            break
        victims += more
    for victim in victims:
        _signal(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + settle
    running = victims
    while running and time.monotonic() < deadline:
        running = [victim for victim in running if _still_runs(victim)]
        if running:
            time.sleep(0.01)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def _still_runs(process: psutil.Process) -> bool:
    """Whether the process (the same one: is_running compares its start time, so a PID
    taken again by another process does not count) has not yet died."""
    try:
        return process.is_running() and process.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False
