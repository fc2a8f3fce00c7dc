"""Use case: restore a checkpoint. Verify and materialise its images, wait for its PIDs, run CRIU."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ckpt.settings import StoreLocation
from ckpt import settings
from ckpt.criu.binary import find_criu
from ckpt.criu.client import CriuClient
from ckpt.dump.dump_options import DumpOptions
from ckpt.errors import HookFailed, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazy import LazyPlan, lazy_processes, start_page_server
from ckpt.restore.lazy import supported as lazy_supported
from ckpt.store import Manifest, Store
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.staging import discard
from ckpt.system import procs
from ckpt.system.files import make_private_dir


@dataclass
class RestoreRequest:
    ref: str
    pid_wait_s: float = 5.0
    new_pidns: bool = False
    post_restore_hook: str | None = None
    # Where the tree's pipes and sockets to programs outside it now write: a file, "-" for ckpt's own
    # stdout/stderr, None for a file in the checkpoint's log directory.
    output: str | None = None
    # Restore established TCP connections closed: the program sees them fail and reconnects.
    # For a restore on another machine (the connection's address is not there) or long after
    # the peers gave up.
    tcp_close: bool = False
    # Lazy restore (ckpt/restore/lazy.py): True, False, or None to decide (lazy when the tree has at
    # least settings.lazy_min_bytes of memory (CKPT_LAZY_MIN_MIB) CRIU can restore lazily and the kernel can).
    lazy: bool | None = None


@dataclass
class RestoreResult:
    manifest: Manifest
    pid: int
    duration_ms: float
    log_path: Path
    pid_in_namespace: int | None = None
    hook_error: str | None = None
    output: str | None = None  # where output to pipes and sockets outside the tree now goes
    lazy: dict | None = None  # a lazy restore: pages, bytes, page server PID, its log

    def to_json(self) -> dict:
        return {"id": self.manifest.id, "name": self.manifest.name, "pid": self.pid,
                "pid_in_namespace": self.pid_in_namespace, "hook_error": self.hook_error, "output": self.output,
                "processes": len(self.manifest.processes), "duration_ms": self.duration_ms,
                "log": str(self.log_path), "lazy": self.lazy}


def restore(store_root: StoreLocation, request: RestoreRequest, reporter: Reporter = NullReporter()) -> RestoreResult:  # noqa: PLR0915
    """Restores the checkpoint request.ref names from the store at store_root."""
    started = time.monotonic()
    procs.require_root()
    binary = find_criu()
    store = Store.open(store_root, create=False)
    lazy_info = None
    with store.lock(exclusive=False, on_wait=lambda h: reporter.info("waiting for the store lock")):
        checkpoint_id = store.resolve(request.ref)
        manifest = store.load(checkpoint_id)
        _require_datagram_peers(manifest)
        if any(entry.kind == "pages" for entry in manifest.files):
            store.blocks.preload_index()  # meanwhile, the other images are written and checked
        images_dir: Path | None
        images_dir, lazy, plan = _lay_out_images(store, manifest, request, binary, reporter)
        phase("restore.materialized")
        inherit: list[tuple[str, int]] = []
        server = None
        try:
            if not request.new_pidns:
                reporter.step("waiting for the tree's PIDs to be free")
                procs.wait_for_pids_free(manifest.all_pids, timeout=request.pid_wait_s)
            options = DumpOptions.from_manifest(manifest.criu.get("options", {}))
            has_tty = bool(manifest.criu.get("tty"))
            if has_tty and not os.isatty(0):
                raise UsageError(f"checkpoint {manifest.id} was taken of processes attached to a terminal",
                                 hint="run 'ckpt restore' from a terminal: the restored processes take it over")
            stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
            log_dir = store.logs_dir(checkpoint_id)
            output, inherit = _relays_to_output(manifest, request.output, log_dir / f"output-{stamp}.log")
            extra = {"tcp_close": True} if request.tcp_close else {}
            work_dir = log_dir
            if lazy:
                # CRIU finds the daemon at <work dir>/lazy-pages.socket: one directory per restore.
                work_dir = log_dir / f"lazy-{stamp}-{os.getpid()}"
                make_private_dir(work_dir)
                extra["lazy_pages"] = True
            criu_options = options.to_criu_restore(images_dir, work_dir, f"restore-{stamp}-{os.getpid()}.log",
                                                   inherit_stdio=has_tty, inherit_fds=inherit, extra=extra)
            if output:
                reporter.info(f"what the tree wrote into pipes or sockets to programs outside it now goes to {output}")
            if lazy:
                reporter.step(f"starting a page server: {plan.pages * PAGE / (1 << 20):.0f} MiB of memory "
                              "will come back while the tree runs")
                server = start_page_server(store, checkpoint_id, binary, images_dir, work_dir, plan,
                                           manifest.all_pids, criu_options.log_level)
            reporter.step(f"restoring {len(manifest.processes)} process(es) with CRIU {binary.version_text}")
            phase("restore.before-criu")
            inner = None

            def on_notify(script: str, _pid: int) -> None:
                if script == "post-restore":
                    phase("restore.post-restore")
                    if server is not None:
                        # Every process has registered its lazy memory and none runs yet: the
                        # watcher takes hold of it now, or CRIU aborts the restore.
                        server.hand_over(lazy_processes(plan))

            if request.new_pidns:
                from ckpt.restore.pidns import run_in_new_pidns

                reporter.step("restoring into a new PID namespace")
                pid, inner = run_in_new_pidns(lambda: CriuClient(binary).restore(criu_options, on_notify))
            else:
                pid = CriuClient(binary).restore(criu_options, on_notify)
            phase("restore.restored")
            if server is not None:
                lazy_info = {"pages": plan.pages, "bytes": plan.pages * PAGE, "server_pid": server.pid,
                             "watcher_pid": server.watcher_pid, "log": str(server.log_path)}
                server.release()
                server = None  # it now owns the images and removes them when the daemon is done
                images_dir = None
        finally:
            if server is not None:
                server.stop()
            if images_dir is not None:
                discard(images_dir)
            for _, fd in inherit:
                os.close(fd)
    hook_error = _run_post_restore_hook(request, pid, manifest, reporter)
    return RestoreResult(manifest, pid, round((time.monotonic() - started) * 1000, 1), criu_options.log_path,
                         inner, hook_error, output, lazy_info)


def _lay_out_images(store: Store, manifest: Manifest, request: RestoreRequest, binary, reporter: Reporter
                    ) -> tuple[Path, bool, LazyPlan]:
    """Writes the checkpoint's images into a fresh staging directory for CRIU, verifying each.
    For a lazy restore the pages a page server will serve are checked but left out (plan says
    which and where). Returns the directory, whether the restore is lazy after all, and the plan."""
    lazy = _wants_lazy(request, manifest, binary)
    reporter.step(f"verifying checkpoint {manifest.id}")
    plan = LazyPlan()
    if not lazy:
        return store.materialize(manifest, reporter), False, plan

    def holes_for(directory: Path) -> dict[str, list[tuple[int, int]]]:
        minimum = settings.current().lazy_min_bytes if request.lazy is None else 1
        holes = plan.prepare(directory, manifest, minimum)
        if holes is None:
            reporter.info("restoring all memory first: a mapping that may use huge pages holds pages "
                          "that cannot come back lazily")
        return holes or {}

    images_dir, plan.locations = store.materialize_lazily(manifest, holes_for, reporter)
    return images_dir, bool(plan.locations), plan  # none left out: nothing to serve


def _run_post_restore_hook(request: RestoreRequest, pid: int, manifest: Manifest, reporter: Reporter) -> str | None:
    """Runs --post-restore once the tree runs; returns its failure, which leaves the tree alone."""
    if not request.post_restore_hook:
        return None
    from ckpt.schedule.hooks import run_hook

    reporter.step("running the post-restore hook")
    try:
        run_hook(request.post_restore_hook, "post-restore", pid, manifest.id, manifest.name)
    except HookFailed as exc:
        reporter.warn(f"{exc}; the restored tree keeps running")
        return str(exc)
    return None


def _require_datagram_peers(manifest: Manifest) -> None:
    """CRIU connects the tree's datagram sockets to the paths they sent to; without the socket
    there, it fails midway ("Can't connect ... socket"): said first, and how to fix it."""
    for sock in manifest.criu.get("external_datagram_sockets", []):
        path = sock.get("peer_path")
        if path and not path.startswith("@") and not os.path.exists(path):
            raise UsageError(f"PID {sock['pid']} of checkpoint {manifest.id} sent datagrams to {path}, which does "
                             "not exist here",
                             hint="start the program that receives there (for /dev/log: a syslog daemon or "
                                  "journald), then restore again")


def _wants_lazy(request: RestoreRequest, manifest: Manifest, binary) -> bool:
    """Whether to try a lazy restore (LazyPlan.prepare then decides from the images)."""
    if request.lazy is False:
        return False
    if request.new_pidns:
        if request.lazy:
            raise UsageError("--lazy and --new-pidns cannot be combined",
                             hint="drop one of them (a restore into a new PID namespace is a full one)")
        return False
    if request.lazy is None and manifest.bytes_total < settings.current().lazy_min_bytes:
        return False  # too small whatever its pages: spares the kernel check
    if not lazy_supported(binary):
        if request.lazy:
            raise UsageError("this kernel cannot restore lazily (CRIU's uffd-noncoop check fails)",
                             hint="restore with --eager")
        return False
    return True


def _relays_to_output(manifest: Manifest, output: str | None, default_path: Path
                       ) -> tuple[str | None, list[tuple[str, int]]]:
    """The descriptors CRIU puts in place of the tree's pipes and sockets to programs outside it.

    CRIU would restore such a pipe with nobody at its other end: the first write kills the
    writer (SIGPIPE); a socket dumped as external needs a descriptor. Each write end and each
    socket instead gets a new pipe (or socketpair, so the program finds the same kind of file)
    read by a detached `cat` that appends to the output. A file cannot be handed to CRIU
    directly: CRIU reopens an inherited pipe with the pipe's own flags, so the file would lose
    O_APPEND and overwrite what it held. The relays end by themselves when the last writer
    closes its end. Pipe read ends are left to CRIU (they read end of file). Returns a
    description of the output and the (CRIU key, descriptor) pairs, which the caller closes."""
    write_ends: dict[str, int] = {}  # CRIU's key -> the fd number it had (the lowest)
    for pipe in manifest.criu.get("external_pipes", []):
        if pipe.get("end") == "write":
            key = f"pipe:[{int(pipe['inode'])}]"
            write_ends[key] = min(write_ends.get(key, 1 << 30), int(pipe["fd"]))
    for sock in manifest.criu.get("external_sockets", []):  # dumped as external: CRIU needs a file for each
        key = f"socket:[{int(sock['inode'])}]"
        write_ends[key] = min(write_ends.get(key, 1 << 30), int(sock["fd"]))
    if not write_ends:
        return None, []
    if output == "-":
        targets = {"out": os.dup(1), "err": os.dup(2)}
        described = "ckpt's own stdout and stderr"
    else:
        path = Path(output) if output else default_path
        try:
            targets = {"out": os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)}
        except OSError as exc:
            raise UsageError(f"cannot open {path} for the restored tree's output: {exc.strerror}",
                             hint="give another file with --output, or '-' for ckpt's own stdout") from None
        targets["err"] = targets["out"]
        described = str(path)
    relays: dict[tuple[str, str], int] = {}  # (pipe or socket, out or err) -> the relay's write end
    inherit: list[tuple[str, int]] = []
    try:
        for key, fd in sorted(write_ends.items()):
            channel = (key.split(":")[0], "err" if fd == 2 else "out")
            if channel not in relays:
                relays[channel] = _start_relay(channel[0], targets[channel[1]])
            inherit.append((key, os.dup(relays[channel])))
    except BaseException:
        for _, fd in inherit:
            os.close(fd)
        raise
    finally:
        for fd in set(relays.values()) | set(targets.values()):
            os.close(fd)
    return described, inherit


def _start_relay(kind: str, target: int) -> int:
    """A detached `cat` copying a new pipe (or socketpair) into target; returns the write end."""
    if kind == "pipe":
        read_end, write_end = os.pipe()
    else:
        ours, theirs = socket.socketpair()
        read_end, write_end = ours.detach(), theirs.detach()
    try:
        subprocess.Popen(["cat"], stdin=read_end, stdout=target, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return write_end
