"""Use case: restore a checkpoint. Verify and materialise its images, wait for its PIDs, run CRIU."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ckpt import procs
from ckpt.criu.binary import find_criu
from ckpt.criu.client import CriuClient, CriuOptions
from ckpt.errors import HookFailed, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Manifest, Store
from ckpt.store.repository import discard


@dataclass
class RestoreRequest:
    ref: str
    pid_wait_s: float = 5.0
    new_pidns: bool = False
    post_restore_hook: str | None = None


@dataclass
class RestoreResult:
    manifest: Manifest
    pid: int
    duration_ms: float
    log_path: Path
    pid_in_namespace: int | None = None
    hook_error: str | None = None

    def to_json(self) -> dict:
        return {"id": self.manifest.id, "name": self.manifest.name, "pid": self.pid,
                "pid_in_namespace": self.pid_in_namespace, "hook_error": self.hook_error,
                "processes": len(self.manifest.processes), "duration_ms": self.duration_ms,
                "log": str(self.log_path)}


def restore(store_root: Path, request: RestoreRequest, reporter: Reporter = NullReporter()) -> RestoreResult:
    """Restores the checkpoint request.ref names from the store at store_root."""
    started = time.monotonic()
    procs.require_root()
    binary = find_criu()
    store = Store.open(store_root, create=False)
    with store.lock(exclusive=False, on_wait=lambda h: reporter.info("waiting for the store lock")):
        checkpoint_id = store.resolve(request.ref)
        manifest = store.load(checkpoint_id)
        reporter.step(f"verifying checkpoint {checkpoint_id}")
        images_dir = store.materialize(manifest, reporter)
        try:
            if not request.new_pidns:
                reporter.step("waiting for the tree's PIDs to be free")
                procs.wait_for_pids_free(manifest.all_pids, timeout=request.pid_wait_s)
            opts = manifest.criu.get("options", {})
            has_tty = bool(manifest.criu.get("tty"))
            if has_tty and not os.isatty(0):
                raise UsageError(f"checkpoint {manifest.id} was taken of processes attached to a terminal",
                                 hint="run 'ckpt restore' from a terminal: the restored processes take it over")
            stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
            log_dir = store.logs_dir(checkpoint_id)
            criu_options = CriuOptions(
                images_dir=images_dir, log_dir=log_dir, log_name=f"restore-{stamp}-{os.getpid()}.log",
                shell_job=bool(opts.get("shell_job")), tcp_established=bool(opts.get("tcp_established")),
                ext_unix_sk=bool(opts.get("ext_unix_sk")), file_locks=bool(opts.get("file_locks")),
                network_lock=opts.get("network_lock", "nftables"), inherit_stdio=has_tty)
            reporter.step(f"restoring {len(manifest.processes)} process(es) with CRIU {binary.version_text}")
            inner = None
            if request.new_pidns:
                from ckpt.pidns import run_in_new_pidns

                reporter.step("restoring into a new PID namespace")
                pid, inner = run_in_new_pidns(lambda: CriuClient(binary).restore(criu_options))
            else:
                pid = CriuClient(binary).restore(criu_options)
        finally:
            discard(images_dir)
    hook_error = None
    if request.post_restore_hook:
        from ckpt.hooks import run_hook

        reporter.step("running the post-restore hook")
        try:
            run_hook(request.post_restore_hook, "post-restore", pid, manifest.id, manifest.name)
        except HookFailed as exc:
            # The tree is restored and running: the failure is reported, the tree is left alone.
            hook_error = str(exc)
            reporter.warn(f"{hook_error}; the restored tree keeps running")
    return RestoreResult(manifest, pid, round((time.monotonic() - started) * 1000, 1), criu_options.log_path,
                         inner, hook_error)
