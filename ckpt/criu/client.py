"""Runs CRIU over its RPC protocol (`criu swrk`), using pycriu's protobuf messages.

pycriu's own `criu` class cannot answer CRIU's notifications (it expects exactly one response
per request), and ckpt needs the post-dump notification: with `--stop`, the checkpoint is
committed while the target is still frozen, so CRIU kills the target only once the checkpoint
exists. The transport below is a small loop over the same socketpair protocol.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ckpt.criu.binary import CriuBinary
from ckpt.errors import DISK_FULL_HINT, CriuFailed, DiskFull, PidInUse
from ckpt.system import procfs
from ckpt.system.files import atomic_write_bytes

# Logged by every CRIU run on these machines, which then succeeds: never shown as a failure.
BENIGN_ERRORS = (re.compile(r"rlimit: Can't setup RLIMIT_NOFILE"),)

NotifyHandler = Callable[[str, int], None]

PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when the thread that forked it ends. Set in the
    child between fork and exec (kept across exec), then the parent is checked: had it died
    before, the signal would never come. Only a libc call and getppid run in the child, which
    is safe beside ckpt's other threads (no lock of theirs is taken)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@dataclass(frozen=True)
class CriuFlags:
    """What CRIU is told about the tree's state: declared here once, held by CriuOptions and
    extended by the dump's DumpOptions (ckpt/dump/dump_options.py), which records them in the
    manifest. Names follow CRIU's command line; the defaults are CRIU's."""

    # A job of a terminal session it does not lead (--shell-job).
    shell_job: bool = False
    # Established TCP connections are saved and restored (--tcp-established).
    tcp_established: bool = False
    # UNIX datagram sockets sending outside the tree are saved and connected again (--ext-unix-sk).
    ext_unix_sk: bool = False
    # File locks are saved and restored (--file-locks).
    file_locks: bool = False
    # The tree keeps running after the dump (False: CRIU ends it, `ckpt dump --stop`).
    leave_running: bool = True
    # How CRIU keeps TCP connections quiet: "nftables", "iptables", or "skip" when there are none.
    network_lock: str = "nftables"
    # The size up to which deleted files the tree holds are saved (None: CRIU's 1 MiB).
    ghost_limit: int | None = None
    # The kernel's dirty-page tracking (--track-mem).
    track_mem: bool = False


@dataclass
class CriuOptions:
    """The options ckpt uses; names follow CRIU's command line."""

    images_dir: Path
    log_dir: Path
    log_name: str
    pid: int | None = None
    flags: CriuFlags = field(default_factory=CriuFlags)
    parent_img: str | None = None
    rst_sibling: bool = False
    # 3 (errors, warnings, info) by default: debug (4) writes a few lines per MiB of memory
    # while the tree is frozen, about 5% of a large dump's freeze. CKPT_CRIU_LOG_LEVEL=4 for
    # a full trace when investigating a failure. None: the binary's (CKPT_CRIU_LOG_LEVEL).
    log_level: int | None = None
    # Give CRIU ckpt's own stdin/stdout/stderr: a --shell-job restore takes its terminal from them.
    inherit_stdio: bool = False
    # (key, descriptor of ours): CRIU restores the file CRIU calls `key` (e.g. "pipe:[123]") as
    # that descriptor instead (--inherit-fd).
    inherit_fds: list = field(default_factory=list)
    # Resources CRIU is to treat as external (--external), e.g. "unix[123]".
    external: list = field(default_factory=list)
    # (namespace, file): the restored tree joins these namespaces instead of the ones CRIU would
    # give it (--join-ns), e.g. ("mnt", "/proc/1/ns/mnt") for a copy's tree (restore/copies.py).
    join_ns: list = field(default_factory=list)
    # A dump's pages go to this connected socket (CRIU's page-server protocol, ckpt/dump/
    # pagestream.py) instead of a pages image in images_dir; CRIU inherits it.
    page_stream_fd: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.log_dir / self.log_name


def _rpc():
    import pycriu.rpc_pb2 as rpc  # deferred: importing pycriu costs ~0.1 s

    return rpc


def bindings_version() -> str:
    """The protobuf version pycriu's generated RPC module loads with; raises whatever importing
    it raises (ImportError, or protobuf's own errors for a version it does not support)."""
    _rpc()
    from google.protobuf import __version__

    return __version__


def _fill_opts(rpc, opts_msg, options: CriuOptions, images_fd: int, work_fd: int, log_level: int) -> None:
    opts_msg.images_dir_fd = images_fd
    opts_msg.work_dir_fd = work_fd
    opts_msg.log_file = options.log_name
    opts_msg.log_level = log_level if options.log_level is None else options.log_level
    if options.pid is not None:
        opts_msg.pid = options.pid
    flags = options.flags
    opts_msg.leave_running = flags.leave_running
    opts_msg.shell_job = flags.shell_job
    opts_msg.tcp_established = flags.tcp_established
    opts_msg.ext_unix_sk = flags.ext_unix_sk
    opts_msg.file_locks = flags.file_locks
    if flags.track_mem:
        opts_msg.track_mem = True
    if options.parent_img:
        opts_msg.parent_img = options.parent_img
    if options.rst_sibling:
        opts_msg.rst_sibling = True
    if flags.ghost_limit:
        opts_msg.ghost_limit = flags.ghost_limit
    lock = {"nftables": rpc.NFTABLES, "iptables": rpc.IPTABLES, "skip": rpc.SKIP}[flags.network_lock]
    opts_msg.network_lock = lock
    opts_msg.notify_scripts = True
    _fill_lists(opts_msg, options)
    for key, value in options.extra.items():
        setattr(opts_msg, key, value)


def _fill_lists(opts_msg, options: CriuOptions) -> None:
    for key in options.external:
        opts_msg.external.append(key)
    for key, fd in options.inherit_fds:
        inherited = opts_msg.inherit_fd.add()
        inherited.key = key
        inherited.fd = fd
    for ns, ns_file in options.join_ns:
        joined = opts_msg.join_ns.add()
        joined.ns = ns
        joined.ns_file = ns_file
    if options.page_stream_fd is not None:
        opts_msg.ps.fd = options.page_stream_fd


def error_lines(log_path: Path, limit: int = 6) -> list[str]:
    """The lines of a CRIU log that explain a failure, benign noise removed."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        if "Error" not in line and "error" not in line:
            continue
        if any(p.search(line) for p in BENIGN_ERRORS):
            continue
        lines.append(re.sub(r"^\(\s*[\d.]+\)\s*", "", line).strip())
    return lines[-limit:]


def _filesystem_full(paths: tuple[Path, ...]) -> bool:
    for path in paths:
        try:
            if os.statvfs(path).f_bavail == 0:
                return True
        except OSError:
            pass
    return False


def explain_failure(action: str, log_path: Path, images_dir: Path | None = None) -> CriuFailed | PidInUse | DiskFull:
    """Turns a failed CRIU run into the typed error that tells the user what to do."""
    lines = error_lines(log_path)
    text = "\n".join(lines)
    where = f"full log: {log_path}"
    if m := re.search(r"Can't fork for (\d+): File exists", text):
        return PidInUse(f"PID {m.group(1)} needed by the checkpoint is in use", hint=where)
    # On a full disk CRIU's log itself may be empty: the filesystems it wrote to tell.
    if re.search(r"No space left on device", text) or (
            action == "dump" and _filesystem_full((log_path.parent, *((images_dir,) if images_dir else ())))):
        return DiskFull(f"no space left on the disk while CRIU wrote the {action}",
                        hint=f"{DISK_FULL_HINT}; {where}")
    if action == "restore" and (m := re.search(r"Can't open file (\S+) on restore: No such file or directory", text)):
        path = m.group(1) if m.group(1).startswith("/") else "/" + m.group(1)  # CRIU logs it without its "/"
        return CriuFailed(f"a file the checkpointed tree had open is gone: {path}", log_path=str(log_path),
                          log_lines=lines, hint="recreate it (for a log file an empty one will do) and restore again; "
                                                + where)
    summary = lines[-1] if lines else "no error lines in its log"
    return CriuFailed(f"CRIU {action} failed: {summary}", log_path=str(log_path), log_lines=lines,
                      hint=_hint(action, text) or where)


# What CRIU's error lines say, and what the user can do about it: (the action it applies to,
# None for both; the pattern; re flags; the hint). The first that matches gives the hint.
_HINTS: list[tuple[str | None, str, int, str]] = [
    ("restore", r"Can't bind inet socket|Cannot assign requested address|Can't restore TCP|repair", 0,
     "the tree's TCP connections cannot be re-established here (another machine, or its address "
     "is gone): restore with --tcp-close, and the program sees them fail"),
    # A tree restored with --new-pidns: CRIU dumps a PID namespace only from its init, and
    # that init's tree then has the time namespace CRIU's restore made, which it cannot dump.
    ("dump", r"Can't dump a pid namespace without the process init|Can't dump nested time namespace", 0,
     "the tree runs in a PID namespace of its own (as a tree restored with --new-pidns does), "
     "which CRIU cannot dump: restore it without --new-pidns (end what holds its PIDs first) to "
     "checkpoint it again"),
    (None, r"Can't dump ghost file", 0,
     "a deleted file the tree holds grew past the size ckpt allowed for while CRIU worked: dump again"),
    ("restore", r"Can't connect \d+ socket", 0,
     "a UNIX socket the tree sent datagrams to is not there (see the dump's notes): start the program "
     "that receives there, then restore again"),
    (None, r"Can't dump half of stream unix", 0,
     "a UNIX stream socket of the tree is connected to a process outside it that ckpt did not "
     "see when it looked (it connected meanwhile?): retry the dump"),
    (None, r"External socket|unix: .*external", re.I,
     "the tree uses a UNIX socket whose peer is outside it: retry with --ext-unix-sk"),
    (None, r"Connected TCP socket|TCP connection", 0,
     "the tree has established TCP connections: retry with --tcp-established"),
    ("restore", r"tty", 0,
     "the checkpointed processes had a terminal: run 'ckpt restore' from a terminal, which they take over"),
    (None, r"shell job|session leader|Can't dump.*tty|tty:", re.I,
     "the tree belongs to a terminal session it does not lead: retry with --shell-job"),
    (None, r"file lock", re.I, "the tree holds file locks: retry with --file-locks"),
]


def _hint(action: str, text: str) -> str | None:
    for applies_to, pattern, flags, hint in _HINTS:
        if applies_to in (None, action) and re.search(pattern, text, flags):
            return hint
    return None


def _answer_notifications(ours: socket.socket, rpc: Any,
                          on_notify: NotifyHandler | None) -> tuple[Any, BaseException | None]:
    """Answers CRIU's notifications (running on_notify for each) until its final response, which
    is returned (None when CRIU ended without one) with the error on_notify raised, if any: that
    one is re-raised by the caller, after CRIU has cleaned up (the notification was refused)."""
    handler_error: BaseException | None = None
    while True:
        size = len(ours.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))
        buf = ours.recv(size) if size else b""
        if not buf:
            return None, handler_error
        resp = rpc.criu_resp()
        resp.ParseFromString(buf)
        if resp.type != rpc.NOTIFY:
            return resp, handler_error
        ok = True
        if on_notify is not None and handler_error is None:
            try:
                on_notify(resp.notify.script, resp.notify.pid)
            except BaseException as exc:  # re-raised by the caller, after CRIU has cleaned up
                handler_error = exc
                ok = False
        ack = rpc.criu_req()
        ack.type = rpc.NOTIFY
        ack.notify_success = ok
        ours.send(ack.SerializeToString())


class CriuClient:
    def __init__(self, binary: CriuBinary):
        self.binary = binary

    def _call(self, req_type: str, options: CriuOptions, on_notify: NotifyHandler | None,
              on_started: Callable[[], None] | None = None, die_with_us: bool = False):
        options.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        images_fd = os.open(options.images_dir, os.O_RDONLY | os.O_DIRECTORY)
        work_fd = os.open(options.log_dir, os.O_RDONLY | os.O_DIRECTORY)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stderr_path = options.log_dir / (options.log_name + ".stderr")
        try:
            proc = self._start(options, stderr_path, theirs, die_with_us)
            theirs.close()
            # Imported once CRIU is starting (it waits for the request): the import overlaps
            # CRIU's own start-up instead of delaying it.
            rpc = _rpc()
            req = rpc.criu_req()
            req.type = getattr(rpc, req_type)
            _fill_opts(rpc, req.opts, options, images_fd, work_fd, self.binary.log_level)
            ours.send(req.SerializeToString())
            if on_started is not None:
                on_started()
            resp, handler_error = _answer_notifications(ours, rpc, on_notify)
            if resp is None:
                proc.wait()
                raise explain_failure(req_type.lower().replace("_", "-"), options.log_path, options.images_dir)
            ours.close()
            proc.wait()
            if handler_error is not None:
                raise handler_error
            if not resp.success:
                raise explain_failure(req_type.lower().replace("_", "-"), options.log_path, options.images_dir)
            return resp
        finally:
            ours.close()
            theirs.close()
            os.close(images_fd)
            os.close(work_fd)
            if stderr_path.exists() and stderr_path.stat().st_size == 0:
                stderr_path.unlink()

    def _start(self, options: CriuOptions, stderr_path: Path, theirs: socket.socket,
               die_with_us: bool) -> subprocess.Popen:
        """CRIU in swrk mode, talking over `theirs`; its own stdout and stderr into stderr_path."""
        with open(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as stderr:
            # CRIU opens images_dir_fd/work_dir_fd through /proc/<our pid>/fd, so we keep them open.
            stdio: dict[str, Any] = {} if options.inherit_stdio else {"stdin": subprocess.DEVNULL,
                                                                      "stdout": stderr, "stderr": stderr}
            # umask 077: CRIU's logs and stats files hold facts about the tree (0644 before);
            # the restored tasks get their own umask back from the images.
            return subprocess.Popen([self.binary.path, "swrk", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(), *(fd for _, fd in options.inherit_fds),
                                              *([options.page_stream_fd] if options.page_stream_fd else [])),
                                    close_fds=True, umask=0o077,
                                    preexec_fn=_die_with(os.getpid()) if die_with_us else None, **stdio)  # noqa: PLW1509 (see _die_with)

    def dump(self, options: CriuOptions, on_notify: NotifyHandler | None = None,
             on_started: Callable[[], None] | None = None) -> None:
        """Dumps the tree. on_started is called once CRIU has its request: work begun there
        runs while CRIU dumps (and must not touch the tree).

        CRIU dies with the calling thread (call it from the thread that lives for the whole
        command): a dump nobody will commit is no use, and a CRIU killed midway leaves the
        target running (its tracer gone, the kernel detaches it and the parasite, finding its
        socket closed, returns the process to its own code; see docs/design.md). Not with a
        network lock or TCP connections in repair mode: only CRIU's own clean-up undoes them. A restore's
        CRIU is not: killed midway it would leave half-restored processes waiting for it; left
        alone it aborts when it cannot notify ckpt and kills what it restored."""
        self._call("DUMP", options, on_notify, on_started,
                   die_with_us=options.flags.network_lock == "skip" and not options.flags.tcp_established)

    def restore(self, options: CriuOptions, on_notify: NotifyHandler | None = None) -> int:
        """Restores the tree; returns the PID of its root."""
        if options.log_level is None:
            options = replace(options, log_level=restore_log_level(self.binary.log_level))
        resp = self._call("RESTORE", options, on_notify)
        return resp.restore.pid


INFO_LOG_LEVEL = 3
WARNINGS_LOG_LEVEL = 2


def restore_log_level(level: int) -> int:
    """The level of a restore's log for CKPT_CRIU_LOG_LEVEL=level: the same, but info (the
    default) is taken down to warnings. At info CRIU writes a line for every run of pages it
    reads into the tree, one write(2) each: 152,000 lines for a 100-process pool, which took
    a raw `criu restore` from 0.64 s to 2.29 s (a 100-process pool, 2 MiB each). A failed
    restore's errors and warnings are in the log either way, and 4 is CRIU's whole trace."""
    return WARNINGS_LOG_LEVEL if level == INFO_LOG_LEVEL else level


def has_feature(binary: CriuBinary, feature: str) -> bool:
    """Whether `criu check --feature FEATURE` passes, remembered until the next boot: what a
    running kernel supports does not change, and the check cost every dump and every restore
    40-60 ms. Keyed by boot id and by the binary (path, version, modification time); `ckpt
    check` always runs the checks afresh."""
    path = binary.feature_cache  # tmpfs by default: forgotten at reboot, as the kernel is
    if path is None:
        return run_check(binary, feature)[0]
    try:
        boot_id = procfs.boot_id()
        key = f"{binary.path}|{binary.version_text}|{os.stat(binary.path).st_mtime_ns}|{feature}"
    except OSError:
        return run_check(binary, feature)[0]
    try:
        cache = json.loads(path.read_text())
        features = cache["features"] if cache.get("boot_id") == boot_id else {}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        features = {}
    if not isinstance(features, dict):
        features = {}
    if isinstance(features.get(key), bool):
        return features[key]
    passed = run_check(binary, feature)[0]
    features = {**features, key: passed}
    try:  # best effort: a cache that cannot be written only costs the check next time
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"boot_id": boot_id, "features": features}).encode(), durable=False)
    except OSError:
        pass
    return passed


def check_verdict(passed: bool, output: str) -> tuple[str, str]:
    """What `criu check` said, for people: ("ok" | "warn" | "fail", the line to show). CRIU
    exits 0 with warnings too ("Looks good but some kernel features are missing...", or a
    warning or error line beside "Looks good."): that is a warning, not an ok."""
    lines = [re.sub(r"^\(\s*[\d.]+\)\s*", "", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    if not passed:
        return "fail", lines[-1] if lines else "failed"
    remarks = [re.sub(r"^(Warn|Error)\s*\([^)]*\):\s*", "", line) for line in lines if line != "Looks good."]
    if not remarks:
        return "ok", "Looks good."
    if any(line.startswith("Looks good but") for line in remarks):
        remarks = [line for line in remarks if not line.startswith("Looks good but")
                   and line not in ("which, depending on your process tree, may cause", "dump or restore failure.")]
        remarks.insert(0, "some kernel features are missing, which may make dumps or restores fail")
    return "warn", "passed with warnings: " + "; ".join(remarks)


def run_check(binary: CriuBinary, feature: str | None = None) -> tuple[bool, str]:
    """Runs `criu check` (optionally `--feature NAME`); returns (passed, its output)."""
    args = [binary.path, "check"] + (["--feature", feature] if feature else [])
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    output = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                       if not any(p.search(line) for p in BENIGN_ERRORS))
    return proc.returncode == 0, output.strip()
