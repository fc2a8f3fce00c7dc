"""Use case: restore a checkpoint. Verify and materialise its images, wait for its PIDs, run CRIU."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from ckpt.system.arrays import distinct, np

from ckpt.commands.session import Criu, Session, host_criu
from ckpt.settings import Settings, StoreLocation
from ckpt.dump.dump_options import DumpOptions
from ckpt.errors import CkptError, CriuFailed, HookFailed, UsageError
from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore import copies, copynet, hostcheck, tcppeers, treeshare
from ckpt.restore.copies import CopyInfo, CopyPlacement
from ckpt.restore.lazyplan import LazyPlan, thp_always
from ckpt.restore.lazy import PageServer, lazy_processes, page_server_stats, start_page_server
from ckpt.restore.lazy import supported as lazy_supported
from ckpt.restore.uffdfill import FillStats, UffdFiller
from ckpt.store import Manifest, Store, ids
from ckpt.store.password import PasswordSource
from ckpt.store.manifest import FileEntry
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.blocks.segments import WITHIN_BITS
from ckpt.store.materialize import (LAY_OUT_WORKERS, PACKS_AHEAD_MIN_OBJECTS, LeftOut, PacksAhead, link_images,
                                    materialize, materialize_lazily)
from ckpt.store.staging import discard
from ckpt.system import procs
from ckpt.system.files import can_punch_holes, make_private_dir


@dataclass
class RestoreRequest:
    ref: str
    pid_wait_s: float = 10.0
    new_pidns: bool = False
    post_restore_hook: str | None = None
    # Where the tree's pipes and sockets to programs outside it now write: a file, "-" for ckpt's own
    # stdout/stderr, None for a file in the checkpoint's log directory.
    output: str | None = None
    # Restore established TCP connections closed (the program sees them fail and reconnects),
    # or established again (TCP repair). None: closed on another host (its peers have moved on,
    # its addresses are not there), established on the host that took the checkpoint.
    tcp_close: bool | None = None
    # Lazy restore (ckpt/restore/lazy.py): True, False, or None to decide (lazy when the tree has at
    # least settings.lazy_min_bytes of memory (CKPT_LAZY_MIN_MIB) CRIU can restore lazily and the kernel can).
    lazy: bool | None = None
    # A member of a group restore: the TCP connections, (local, remote) as ((address, port),
    # (address, port)), of the other members restored with it. A connection of this tree whose
    # peer is one of them comes back established (its peer comes back too, and no member runs
    # before every one is back), whatever this host's sockets say of the killed originals.
    group_peers: list = field(default_factory=list)
    # The destination of `ckpt migrate`: a connection comes back established where this host
    # holds its local address (it moved with the tree), closed otherwise (tcp_close None only).
    migrated: bool = False
    # A migration's rehearsal before the final freeze: prepare checks what it would (the images
    # but the pages, this host against them, the PIDs free) and nothing else; no restore follows.
    rehearsal: bool = False
    # Copy k of a clone (docs/design.md, "Clones"): restored into a PID namespace of its own
    # whose init is ckpt's reaper, in a network namespace of its own or the host's, its
    # established TCP connections closed; several such sessions may run at once (threads).
    copy: CopyPlacement | None = None
    # The checkpoint's images as another session of this process laid them out and checked them
    # (a clone's first copy): hard-linked into this session's own directory instead of written
    # again (store/materialize.py, link_images). Every session sharing them restores with CRIU's
    # auto_dedup off: it punches holes into the pages images it has read, which the others read too.
    images_from: Path | None = None


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
    # A full restore whose memory ckpt copied in through userfaultfd before the tree ran
    # (ckpt/restore/uffdfill.py): pages, bytes, seconds, threads.
    filled: dict | None = None
    another_host: bool = False  # the checkpoint was taken on another machine
    # How the tree's established TCP connections came back: "established", "closed", "mixed" (some
    # of each), or None (it had none); and each of them.
    tcp_connections: str | None = None
    connections: list[tcppeers.ConnectionPlan] = field(default_factory=list)
    host_warnings: list[str] = field(default_factory=list)  # differences with the dump's host, not refused
    # Where a copy runs (a copy, or the restore of a copy's checkpoint): its init, namespaces, address.
    copy: CopyInfo | None = None
    # A full restore of a tree: the pages of its processes equal to its root's at the same
    # address, laid out once and read from the root's pages image (ckpt/restore/treeshare.py).
    shared_pages: int | None = None

    def to_json(self) -> dict:
        return {"id": self.manifest.id, "name": self.manifest.name, "pid": self.pid,
                "pid_in_namespace": self.pid_in_namespace, "hook_error": self.hook_error, "output": self.output,
                "processes": len(self.manifest.processes), "duration_ms": self.duration_ms,
                "log": str(self.log_path), "lazy": self.lazy, "filled": self.filled,
                "another_host": self.another_host,
                "tcp_connections": self.tcp_connections, "connections": [c.to_json() for c in self.connections],
                "host_warnings": self.host_warnings, "copy": self.copy.to_json() if self.copy else None,
                "shared_pages": self.shared_pages}


def restore(store_root: StoreLocation, request: RestoreRequest, reporter: Reporter = NullReporter(), *,
            settings: Settings, passwords: PasswordSource | None = None, store: Store | None = None) -> RestoreResult:
    """Restores the checkpoint request.ref names from the store at store_root (store: that store
    already opened, or None): the phases of a RestoreSession in a row."""
    with RestoreSession(store_root, request, reporter, settings=settings, passwords=passwords,
                        store=store) as session:
        session.prepare()
        session.restore()
        return session.finish()


class RestoreSession(Session[RestoreRequest]):
    """One restore of one checkpoint, as the phases a coordinator drives (a group restore, the
    destination side of a migration): prepare (the images verified and laid out, this host
    checked, the tree's PIDs free, relays and a lazy restore's page server started: nothing
    runs yet), restore (CRIU: the tree runs), finish (clean up, the post-restore hook), and
    abort, safe from any phase and idempotent: before restore it leaves nothing behind (page
    server stopped, images and relays gone, lock released); after restore it also ends the
    restored tree (SIGKILL: a coordinator that aborts a move must never leave two copies
    running). Used as a context manager, an exception aborts."""

    def __init__(self, store_root: StoreLocation, request: RestoreRequest, reporter: Reporter = NullReporter(), *,
                 settings: Settings, passwords: PasswordSource | None = None, store: Store | None = None,
                 criu: Callable[[Settings], Criu] = host_criu, clock: Callable[[], float] = time.monotonic):
        """settings and passwords: the caller's (the CLI's), passed down; store: the store to
        restore from (default: opened at store_root by prepare); criu: makes the CRIU client
        (default: this host's, as root); clock: seconds, monotonic (the restore's duration)."""
        super().__init__(store_root, request, settings, reporter, passwords, store, criu, clock)
        self.images_dir: Path | None = None
        self.inherit: list[tuple[str, int]] = []
        self.server: PageServer | None = None
        self.lazy_info: dict | None = None
        self.filler: UffdFiller | None = None  # a full restore whose memory ckpt copies in
        self.shared_pages: int | None = None  # pages laid out once, read from the root's image (treeshare)
        self.segment_check: _SegmentCheck | None = None  # a lazy restore's segments, checked while CRIU runs
        self.fill_stats: FillStats | None = None
        self._told_copies = False  # the cache's copies read again (_tell_copies_read_again)
        self.pid: int | None = None
        self.inner: int | None = None
        self.network: copynet.CopyNetwork | None = None  # a copy's own network namespace
        self.copy_info: CopyInfo | None = None
        self.began_init: tuple[int, int] | None = None  # a copy's init (PID, start ticks), told from its start
        self.copy_init: tuple[int, int] = (0, 0)  # a copy's init (host PID, start ticks), known in its runner

    # ---- prepare: nothing runs yet ------------------------------------------------------

    def prepare(self) -> None:
        self.criu = self.new_criu(self.settings)  # as root (the default), or nothing is done
        self.binary = self.criu.binary
        store = self._open_store(create=False)
        self._hold_store_lock()
        checkpoint_id = store.resolve(self.request.ref)
        if store.remote and not self.request.rehearsal:
            store.read_index_ahead()  # while the manifest is read (once the checkpoint is known to exist)
        self.manifest = manifest = store.load(checkpoint_id)
        if any(entry.kind == "pages" for entry in manifest.files) and not self.request.rehearsal:
            store.blocks.preload_index()  # meanwhile, the other images are written and checked
        self._take_bundle(store, manifest)
        try:
            if self.request.rehearsal:
                self._rehearse()
                return
            layout = _ImageLayout(store, manifest, self.request, self.binary, self.reporter, self.settings)
            self.images_dir, self.memory, self.plan, self.host = layout.lay_out()
        finally:
            store.objects.forget_read_ahead()
        self.shared_pages = layout.shared_pages
        self.lazy = self.memory == "lazy"
        if self.memory == "fill" and not store.objects.remote:
            # Left out of the layout: checked from now on, beside what follows (see _SegmentCheck).
            # A lazy restore's, once its page server is forked (_prepare_to_run).
            self.segment_check = _SegmentCheck(store, self.plan)
        phase("restore.materialized")
        try:
            self._prepare_to_run(store, manifest)
        except (CkptError, OSError):
            if self.segment_check is not None:
                self.segment_check.result()  # a damaged checkpoint is the first thing to say
            raise

    def _take_bundle(self, store: Store, manifest: Manifest) -> None:
        """From a remote store, the checkpoint's small images read in one request (its bundle,
        ckpt/store/bundles.py); not by the copies of a clone, which share one layout."""
        if self.request.images_from is None and store.objects.take_bundle(manifest.bundle, manifest.files):
            self.reporter.info(f"read {len(store.objects.bundled)} of the checkpoint's small images in one "
                               "request (its bundle)")

    def _prepare_to_run(self, store: Store, manifest: Manifest) -> None:
        self._check_copy()
        if self._in_own_pidns():
            # A new copy's namespace may take the inode of one that ended and left its file.
            copies.remove_stale_identities(self.settings.copies_dir)
        if not self.request.new_pidns and not self._in_own_pidns():
            self.reporter.step("waiting for the tree's PIDs to be free")
            procs.wait_for_pids_free(manifest.all_pids, timeout=self.request.pid_wait_s)
        self._options()
        if self.lazy:
            self.reporter.step(f"starting a page server: {self.plan.pages * PAGE / (1 << 20):.0f} MiB of memory "
                               "will come back while the tree runs")
            self.server = start_page_server(store, manifest.id, self.binary, self._images(), self.work_dir,
                                            self.plan, manifest.all_pids, self.binary.log_level)
            # Only once the page server is forked: a fork while this thread reads through the
            # same store (holding a lock of its backend, or of a C library's) could leave the
            # server a lock no thread of it will ever release.
            if not store.objects.remote:
                self.segment_check = _SegmentCheck(store, self.plan)
        elif self.memory == "fill":
            checked = self.segment_check.checked if self.segment_check is not None else None
            self.filler = UffdFiller(store, self.plan, self.work_dir, checked)

    def _rehearse(self) -> None:
        """A migration's rehearsal: what prepare checks (every image but the pages, this host
        against them, the tree's PIDs free), nothing laid out for CRIU and nothing started."""
        directory = materialize(self._store().objects, self._store().staging_area(), self.manifest, self.reporter,
                                skip_pages=True)
        try:
            self.reporter.step("checking this host against the checkpoint")
            self.host = hostcheck.check(self.manifest, self.binary, directory)
            hostcheck.require_match(self.manifest, self.host)
        finally:
            discard(directory)
        procs.wait_for_pids_free(self.manifest.all_pids, timeout=self.request.pid_wait_s)

    def _options(self) -> None:
        """CRIU's options: the dump's, the relays to the output, each TCP connection's fate,
        a lazy restore's work directory, auto-dedup for an eager one."""
        manifest, request, images_dir = self.manifest, self.request, self._images()
        options = DumpOptions.from_manifest(manifest.criu.get("options", {}))
        has_tty = bool(manifest.criu.get("tty"))
        if has_tty and not os.isatty(0):
            raise UsageError(f"checkpoint {manifest.id} was taken of processes attached to a terminal",
                             hint="run 'ckpt restore' from a terminal: the restored processes take it over")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        log_dir = self._store().logs_dir(manifest.id)
        self.output, self.inherit = _relays_to_output(manifest, request.output, log_dir / f"output-{stamp}.log")
        if self._in_own_pidns():
            request = replace(request, tcp_close=True)  # its peers are the original's, or in another namespace
        self.connections = _tcp_connections(manifest, images_dir, options.tcp_established, request,
                                            self.host, self.reporter)
        self.tcp = tcppeers.summary(self.connections)
        extra = {"tcp_close": True} if self.tcp == "closed" else {}
        if self.tcp == "mixed":
            from ckpt.criu.images import close_connections  # deferred: imports pycriu

            close_connections(images_dir, {c.id for c in self.connections if c.restored == "closed"})
        self.work_dir = log_dir
        if self.memory in ("lazy", "fill"):
            # CRIU finds the daemon (or ckpt's filler) at <work dir>/lazy-pages.socket: one
            # directory per restore.
            self.work_dir = log_dir / f"{self.memory}-{stamp}-{os.getpid()}"
            make_private_dir(self.work_dir)
            extra["lazy_pages"] = True
        elif can_punch_holes(images_dir) and not self._images_shared() and not treeshare.linked(images_dir):
            # CRIU punches each 128 MiB of the staged pages image out once it has read it into
            # the tree: that page cache is free again, and the tree's next pages take it while
            # it is still backed, instead of memory the VM gave back to its host
            # (docs/performance.md, "Restore"). The staged image is ours, and deleted after anyway.
            extra["auto_dedup"] = True
        self._copy_network(extra)
        # Copies of one checkpoint are restored at once, by threads of one process.
        log_name = f"restore-{stamp}-{os.getpid()}" + (f"-copy{request.copy.index}" if request.copy else "")
        self.criu_options = options.to_criu_restore(images_dir, self.work_dir, f"{log_name}.log",
                                                    inherit_stdio=has_tty, inherit_fds=self.inherit, extra=extra)
        if request.copy is not None:
            from ckpt.criu.images import proc_of_new_pid_namespace  # deferred: imports pycriu

            proc_of_new_pid_namespace(images_dir)
            self.criu_options.join_ns = list(copies.JOIN_HOST_NAMESPACES)
        if self.output:
            self.reporter.info(f"what the tree wrote into pipes or sockets to programs outside it now goes to "
                               f"{self.output}")

    def _images_shared(self) -> bool:
        """Other sessions restore from these very image files (hard links): a clone of several copies."""
        return self.request.images_from is not None or (self.request.copy is not None and self.request.copy.count > 1)

    def prepared_images(self) -> Path | None:
        """After prepare: the laid out images, for another copy's RestoreRequest.images_from."""
        return self.images_dir

    def _check_copy(self) -> None:
        copy = self.request.copy
        if copy is None:
            return
        copy.check()
        if self.request.new_pidns or self.request.lazy:
            raise UsageError("a copy of a clone is restored into a PID namespace of its own, fully",
                             hint="leave out --new-pidns and --lazy")
        if self._copy_of() is not None:
            # Its copies' journals would need the copy's branch under their own, and the
            # agent's records under that, each to its own freeze: one level is kept today.
            raise UsageError(f"checkpoint {self.manifest.id} is of a copy of a clone: it cannot be cloned again yet "
                             "(its journal is a branch of the agent's, and a branch of a branch is not kept)",
                             hint=f"'ckpt restore {self.manifest.id}' runs it on (its journal with it), or clone the "
                                  "checkpoint the copy was cloned from")

    def _copy_of(self) -> dict | None:
        """The clone and copy a checkpoint of a copy was taken of (its PID namespace dumped
        from its init, which CRIU makes again on restore), or None."""
        copy_of = self.manifest.criu.get("copy")
        return copy_of if isinstance(copy_of, dict) else None

    def _in_own_pidns(self) -> bool:
        """The tree comes back in a PID namespace of its own: its PIDs clash with nothing."""
        return self.request.copy is not None or self._copy_of() is not None

    def _copy_network(self, extra: dict) -> None:
        """A network namespace for a copy with network "own", or for the restore of a copy's
        checkpoint whose copy had one (CRIU takes it as the external namespace's descriptor)."""
        copy, copy_of = self.request.copy, self._copy_of()
        if copy is not None and copy.network == "own":
            tag, index = copy.tag, copy.index
        elif copy_of is not None and copy_of.get("network") == "own":
            # Its own namespace's name: a new tag for each restore of the checkpoint.
            tag, index = ids.new_id()[-6:], int(copy_of.get("copy", 1))
        else:
            return
        self.reporter.step("making the copy's network namespace")
        self.network = copynet.set_up(self.settings.copies_dir, tag, index)
        self.reporter.info(f"the copy's network: namespace {self.network.name}, address {self.network.address} "
                           f"(the host is {self.network.host_address})")
        if copy_of is not None:
            self.inherit.append((copies.NET_KEY, os.open(self.network.path, os.O_RDONLY | os.O_CLOEXEC)))

    # ---- restore: the tree runs ---------------------------------------------------------

    def restore(self) -> int:
        """Runs CRIU; returns the restored root PID (in the host's PID namespace)."""
        self.reporter.step(f"restoring {len(self.manifest.processes)} process(es) with CRIU "
                           f"{self.binary.version_text}")
        phase("restore.before-criu")
        client = self.criu
        if self.request.copy is not None:
            self.pid = self._restore_copy(self.request.copy, self._restore_inside)
        elif self.request.new_pidns:
            from ckpt.restore.pidns import run_in_new_pidns

            self.reporter.step("restoring into a new PID namespace")
            self.pid, self.inner = run_in_new_pidns(lambda: client.restore(self.criu_options, self._notified))
        else:
            self.pid = client.restore(self.criu_options, self._notified)
            if self._copy_of() is not None:
                self.pid = self._found_copy(self.pid)
        phase("restore.restored")
        if self.filler is not None:
            filler, self.filler = self.filler, None
            filler.close()
        if self.server is not None:
            self.server.wait_locked()  # (said in the notification already, unless it ran in another process)
            server, self.server = self.server, None
            self.lazy_info = {"pages": self.plan.pages, "bytes": self.plan.pages * PAGE, "server_pid": server.pid,
                              "watcher_pid": server.watcher_pid, "log": str(server.log_path)}
            server.release()
            self.images_dir = None  # the page server owns the images now, and removes them when done
        return self.pid

    def _restore_copy(self, copy: CopyPlacement, restore_inside: copies.InsideRestore) -> int:
        self.reporter.step(f"restoring copy {copy.index} of {copy.count} into a PID namespace of its own")
        from ckpt.criu.client import bindings_version

        # Imported before the fork: copies restored by threads of one process fork while another
        # thread may be importing it, and a forked child must not find it half-imported.
        bindings_version()
        started = copies.run_copy(restore_inside, self.network.path if self.network else None,
                                  on_init=self._copy_begun)
        self.pid, self.inner = started.pid, started.pid_in_namespace
        self.copy_info = CopyInfo(copy.index, started.init_pid, started.pid, started.pid_in_namespace,
                                  started.pidns_inode, *self._network_facts())
        if self.network is not None:
            copynet.adopt(self.settings.copies_dir, self.network, started.init_pid)
        return started.pid

    def _restore_inside(self, init: tuple[int, int]) -> int:
        """In the copy's CRIU runner (a forked process: this object is its own copy there)."""
        self.copy_init = init  # for the identity file, written in the post-restore notification
        return self.criu.restore(self.criu_options, self._notified)

    def _copy_begun(self, init_pid: int, start: int) -> None:
        """The copy's init, known while CRIU still restores: what abort() ends from then on."""
        self.began_init = (init_pid, start)

    def _found_copy(self, init_pid: int) -> int:
        """After the restore of a copy's checkpoint: CRIU returned the init; the tree's root is
        the init's child."""
        copy_of = self._copy_of() or {}
        inode = copies.pidns_inode(init_pid)
        # The copy's root, by its PID inside (CRIU gives each process its PID back there).
        self.inner = int(copy_of.get("root_in_namespace") or 0)
        root = copies.host_pid(inode, self.inner) if self.inner else _only_child(init_pid)
        self.inner = self.inner or copies.pid_in_namespace(root)
        self.copy_info = CopyInfo(int(copy_of.get("copy", 1)), init_pid, root, self.inner, inode,
                                  *self._network_facts())
        if self.network is not None:
            copynet.adopt(self.settings.copies_dir, self.network, init_pid)
        return root

    def _network_facts(self) -> tuple[str | None, str | None]:
        return (self.network.name, self.network.address) if self.network else (None, None)

    def restore_held(self, hold_limit: float = 300.0) -> None:
        """restore() in two steps, for a coordinator that must have several trees back before
        any of them runs (a group restore) or act before the tree runs (a migration): CRIU
        runs in a thread, and this returns once every process is restored and none runs yet
        (CRIU's post-restore notification). release() lets the tree run (then self.pid is
        its root); abort() refuses the notification, and CRIU ends what it restored. After
        hold_limit seconds the hold ends as an abort would."""
        if self.request.new_pidns or self.request.copy is not None:
            # CRIU runs in a forked init there: its notifications are answered in that process.
            raise UsageError("a held restore cannot go into a new PID namespace yet",
                             hint="restore the group's members without --new-pidns")
        self._run_held(self.restore, "the restored tree was held before it ran", hold_limit)

    def _notified(self, script: str, _pid: int) -> None:
        if script == "post-restore":
            phase("restore.post-restore")
            copy = self.request.copy
            if copy is not None:
                # In the CRIU runner, inside the copy's PID namespace: the tree runs only once
                # this returns, so its first look at its identity finds it.
                copies.write_identity(self.settings.copies_dir, copy, self.manifest.id, self.manifest.name,
                                      self.copy_init, self.manifest.stats.get("frozen_at"))
            if self.segment_check is not None:
                # A damaged segment of the lazy memory: CRIU aborts the restore, nothing ran.
                self.segment_check.result()
            if self.server is not None:
                # Every process has registered its lazy memory and none runs yet: the watcher
                # takes hold of it now, or CRIU aborts the restore.
                self.server.hand_over(lazy_processes(self.plan))
                self.server.wait_locked()  # the server's own lock on the store, or CRIU aborts
            if self.filler is not None:
                # Likewise: every page goes in now, before any process runs (or CRIU aborts).
                self.reporter.step(f"copying {self.plan.pages * PAGE / (1 << 20):.0f} MiB of memory into the tree")
                self.fill_stats = self.filler.fill(
                    lambda done, total: self.reporter.progress(done, total, "copying memory into the tree"))
            self._held_here()

    # ---- finish, abort ------------------------------------------------------------------

    def finish(self) -> RestoreResult:
        """After the restore: cleans up, lets the store go, runs the post-restore hook."""
        if self.pid is None:
            raise RuntimeError("finish before restore")  # a coordinator's bug, not the user's
        self._finished = True  # from here on the tree is the user's: no failure ends it
        self._tell_copies_read_again()
        self._clean_up()
        hook_error = _run_post_restore_hook(self.request, self.pid, self.manifest, self.reporter,
                                            self.settings.hook_timeout)
        return RestoreResult(self.manifest, self.pid, round((self.clock() - self.started) * 1000, 1),
                             self.criu_options.log_path, self.inner, hook_error, self.output, self.lazy_info,
                             self.fill_stats.to_json() if self.fill_stats else None,
                             self.host.another_host, self.tcp, self.connections, self.host.warnings,
                             self.copy_info, self.shared_pages)

    def abort(self) -> None:
        """From any phase; after restore, the restored tree is ended (SIGKILL, every process
        of it: none of it may run on when a coordinator gives the restore up)."""
        finished, self._finished = self._finished, True
        self._drop_hold()  # CRIU ends what it restored, and restore() fails: no PID to end here
        try:
            self._tell_copies_read_again()
        except Exception:  # noqa: BLE001 - a note; the failure being handled is what matters
            pass
        try:
            if self.began_init is not None and not finished:
                copies.end_copy(*self.began_init)  # its whole PID namespace (CRIU too, if it still restores)
            elif self.copy_info is not None and not finished:
                copies.end_copy(self.copy_info.init_pid)
            elif self.pid is not None and not finished:
                procs.kill_tree(self.pid)
        finally:
            self._clean_up()
            if self.network is not None and not finished:
                network, self.network = self.network, None
                copynet.tear_down(self.settings.copies_dir, network)

    def _tell_copies_read_again(self) -> None:
        """Once, at the end, however the restore ended: copies in the local cache found damaged
        and read again from the store (a full restore's copy reads the packs after the layout)."""
        if self.store is not None and not self._told_copies:
            self._told_copies = True
            tell_copies_read_again(self.store, self.reporter)

    def _clean_up(self) -> None:
        try:
            if self.segment_check is not None:
                self.segment_check.stop()
            if self.filler is not None:
                self.filler.close()
            if self.server is not None:
                self.server.stop()
            if self.images_dir is not None:
                discard(self.images_dir)
        finally:
            self.server, self.filler, self.images_dir, self.segment_check = None, None, None, None
            for _, fd in self.inherit:
                os.close(fd)
            self.inherit = []
            self._held.close()

    def _images(self) -> Path:
        if self.images_dir is None:
            raise RuntimeError("the images are laid out by prepare")
        return self.images_dir


class _SegmentCheck:
    """The segments a page server will serve from a local store, checked against their
    checksums in a thread while CRIU restores the tree (they used to be checked before CRIU
    ran: 0.2 s of a 2 GiB restore); result() in the post-restore notification, before any
    process runs, raises DamagedCheckpoint if one is damaged (CRIU then ends the restore)."""

    def __init__(self, store: Store, plan: LazyPlan):
        keys = distinct(np.concatenate([np.asarray(locations, dtype=np.int64) >> WITHIN_BITS
                                         for locations in plan.locations.values()])).tolist()
        self.error: BaseException | None = None
        self.checked: set[int] = set()  # found intact: a full restore's copying threads skip them
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(store, keys), name="ckpt-segment-check", daemon=True)
        self.thread.start()

    def _run(self, store: Store, keys: list[int]) -> None:
        reader = store.blocks.page_reader(checked=self.checked)
        try:
            for key in keys:
                if self.stopping.is_set():
                    return
                reader.reader.check(key, 0, 1)
        except BaseException as exc:  # noqa: BLE001 - raised in result()
            self.error = exc
        finally:
            reader.close()

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class _ImageLayout:
    """Writes a checkpoint's images into a fresh staging directory for CRIU, verifying each.
    For a lazy restore the pages a page server will serve are checked but left out (plan says
    which and where). Before the pages images (the bulk), the host is checked against the
    other images: a mismatch (HostMismatch) ends the restore before anything else is done."""

    def __init__(self, store: Store, manifest: Manifest, request: RestoreRequest, binary, reporter: Reporter,
                 settings: Settings):
        self.store, self.manifest, self.request = store, manifest, request
        self.binary, self.reporter, self.lazy_min_bytes = binary, reporter, settings.lazy_min_bytes
        self.fill_enabled = settings.uffd_fill
        self.plan = LazyPlan()
        self.host: hostcheck.HostReport | None = None  # once checked
        self.memory = "image"
        self.left_to_root: dict[str, list[tuple[int, int]]] = {}  # by pages image: ranges read from the root's
        self._page_lists: dict[str, bytes] = {}  # by pages image, as the plans below read them
        self._page_lists_coming: dict[str, Future[bytes]] = {}  # read while the other images are laid out
        self._packs_ahead: PacksAhead | None = None  # and the packs read most, downloaded whole meanwhile

    def lay_out(self) -> tuple[Path, str, LazyPlan, hostcheck.HostReport]:
        """Returns the directory, how the tree's memory comes back ("lazy": a page server fills
        it in while the tree runs; "fill": ckpt copies it in before the tree runs; "image": CRIU
        reads it from the pages images), the plan and the host's report."""
        if self.request.images_from is not None:
            self.reporter.step(f"sharing the images of checkpoint {self.manifest.id} laid out for another copy")
            images_dir = link_images(self.store.staging_area(), self.request.images_from)
            return images_dir, "image", self.plan, self._checked(images_dir)
        if _wants_lazy(self.request, self.manifest, self.binary, self.lazy_min_bytes):
            self.memory = "lazy"
        elif self.fill_enabled and _wants_fill(self.request, self.manifest, self.binary):
            self.memory = "fill"
        self.reporter.step(f"verifying checkpoint {self.manifest.id}")
        self._start_reading_page_lists()
        try:
            if self.memory == "image":
                images_dir = materialize(self.store.objects, self.store.staging_area(), self.manifest,
                                         self.reporter, before_pages=self._check_host_and_share,
                                         whole_packs=self._whole_packs_first)
                return images_dir, "image", self.plan, self._linked(images_dir)
            # Not checked here: filled in, each segment is checked by the thread that copies it;
            # served lazily, by a thread while CRIU restores (_SegmentCheck).
            images_dir, self.plan.locations = materialize_lazily(self.store.objects, self.store.staging_area(),
                                                                 self.manifest, self._holes_for, self.reporter,
                                                                 check_holes=False, whole_packs=self._whole_packs_first)
        finally:
            self._stop_reading_page_lists()
        # none left out: nothing to serve
        return images_dir, self.memory if self.plan.locations else "image", self.plan, self._linked(images_dir)

    def _whole_packs_first(self, holes: dict[str, list[tuple[int, int]]]) -> bool:
        """Whether the lay-out is to download whole the packs it reads most of before writing
        the pages images (it asks once it knows the holes): when the restore reads every page
        from a remote store before the tree runs (a restore meant to be lazy may have no
        holes, all its memory then restored first), unless PacksAhead decided that already.
        A lazy restore's page server fetches the packs in the order the tree needs them."""
        ahead, self._packs_ahead = self._packs_ahead, None
        if ahead is not None and ahead.wait(self.reporter):
            return False  # decided already, with every page counted as read
        return self.store.objects.remote and (self.memory != "lazy" or not any(holes.values()))

    def _check_host(self, directory: Path) -> None:
        self._host_report(directory)

    def _check_host_and_share(self, directory: Path) -> LeftOut | None:
        self._check_host(directory)
        return self._shared_with_root(directory)

    def _shared_with_root(self, directory: Path) -> LeftOut | None:
        """A full restore of a tree: the pages its processes share with its root, laid out
        once (ckpt/restore/treeshare.py). Not for the copies of a clone (they share one
        layout, whose files must stay plain)."""
        if self.request.copy is not None or len(self.manifest.processes) < 2:
            return None
        self._load_page_lists()
        self.left_to_root = treeshare.plan(directory, self.manifest, self._page_list)
        return LeftOut(self.left_to_root) if self.left_to_root else None

    @property
    def shared_pages(self) -> int | None:
        """Pages read from the root's pages image (treeshare); None: none."""
        return sum(count for ranges in self.left_to_root.values() for _, count in ranges) or None

    def _start_reading_page_lists(self) -> None:
        """A tree's page lists (the plans below read them all) read by LAY_OUT_WORKERS threads
        while the other images are laid out: from S3 each is a request (a 101-process tree's
        took 0.5 s after its 600 other images, 20 ms away). From a remote store always: the
        layout reads every one of them (writing the pages images), and waits for these reads."""
        pages = [entry for entry in self.manifest.files if entry.kind == "pages"]
        forced_lazy = self.memory == "lazy" and self.request.lazy
        plans = not (len(pages) < 2 or len(self.manifest.processes) < 2 or forced_lazy)
        if self.request.copy is not None or not pages or not (plans or self.store.objects.remote):
            return  # (the plans that read them are not made, and the layout reads them in place)
        pool = ThreadPoolExecutor(max_workers=max(LAY_OUT_WORKERS, self.store.objects.backend.requests_in_flight()),
                                  thread_name_prefix="ckpt-page-lists")
        # (a worker pool's children have page lists alike: each content read once)
        alike: dict[str, Future[bytes]] = self.store.objects.read_page_lists_ahead(pages, pool)
        for entry in pages:
            self._page_lists_coming[entry.name] = alike[entry.hash]
        pool.shutdown(wait=False)  # its threads end with the last read
        others = len(self.manifest.files) - len(pages)
        if self.store.objects.remote and self.memory != "lazy" and others >= PACKS_AHEAD_MIN_OBJECTS:
            self._packs_ahead = PacksAhead(self.store.objects.blocks, list(alike.values()))

    def _stop_reading_page_lists(self) -> None:
        """Once laid out: the reads not needed are let go, and none runs on (a page server is
        forked next: no thread may hold a lock of the store's backend then)."""
        coming, self._page_lists_coming = self._page_lists_coming, {}
        for future in coming.values():
            future.cancel()
        wait(list(coming.values()))
        if self._packs_ahead is not None:
            self._packs_ahead.wait()

    def _load_page_lists(self) -> None:
        """Every pages image's page list, read at once (see _start_reading_page_lists): a
        failure to read one is raised here, where they are needed."""
        for name, future in list(self._page_lists_coming.items()):
            self._page_lists[name] = future.result()
            del self._page_lists_coming[name]  # (those not read yet stay, for _stop_reading_page_lists)

    def _page_list(self, entry: FileEntry) -> bytes:
        """A pages image's page list, read once for the forked-memory check and the tree-share plan."""
        if entry.name in self._page_lists_coming:
            self._load_page_lists()
        if entry.name not in self._page_lists:
            self._page_lists[entry.name] = self.store.objects.load_page_list(entry)
        return self._page_lists[entry.name]

    def _linked(self, directory: Path) -> hostcheck.HostReport:
        """The host's report, once the parent images directory is made (a tree sharing its root's pages)."""
        if self.left_to_root:
            try:
                treeshare.link(directory, self.manifest, self.left_to_root)
            except BaseException:
                discard(directory)
                raise
        return self._checked(directory)

    def _host_report(self, directory: Path) -> hostcheck.HostReport:
        """Checked once, with the images but the pages laid out (a mismatch ends the restore)."""
        if self.host is None:
            self.reporter.step("checking this host against the checkpoint")
            self.host = hostcheck.check(self.manifest, self.binary, directory)
            hostcheck.require_match(self.manifest, self.host)
            hostcheck.let_written_files_grow(directory, self.host)
        return self.host

    def _checked(self, directory: Path) -> hostcheck.HostReport:
        try:
            host = self._host_report(directory)  # done already unless the checkpoint has no pages images
        except BaseException:
            discard(directory)
            raise
        for warning in host.warnings:
            self.reporter.warn(warning)
        return host

    def _holes_for(self, directory: Path) -> dict[str, list[tuple[int, int]]] | LeftOut:
        """The pages a page server (or ckpt's filler) is to bring back; none (a full restore),
        and then perhaps those the tree's processes share with its root, laid out once."""
        self._check_host(directory)
        if self.memory == "fill":
            minimum = FILL_MIN_BYTES
        else:
            minimum = self.lazy_min_bytes if self.request.lazy is None else 1
        holes = self.plan.prepare(directory, self.manifest, minimum)
        if holes is None:
            self.reporter.info("restoring all memory first: a mapping that may use huge pages holds pages "
                               "that cannot come back lazily")
        elif holes and (self.memory == "fill" or self.request.lazy is None) and self._forked_memory_shared():
            return self._shared_then_filled(directory)
        return holes or self._shared_with_root(directory) or {}

    def _shared_then_filled(self, directory: Path) -> dict[str, list[tuple[int, int]]] | LeftOut:
        """A tree whose children share most of their memory with their parents (a worker pool):
        restored fully, so that CRIU gives those pages back shared, copy-on-write. The pages a
        process shares with the root come from the root's image (treeshare); what each process
        holds of its own is copied in through userfaultfd before the tree runs, when that is
        possible, instead of being written into its pages image first (100 workers: 350 MiB
        of page cache). CRIU drops the page a child inherited where its own is to come
        (criu/mem.c, restore_priv_vma_content)."""
        self.reporter.info("restoring all memory first: the tree's children share most of their memory with "
                           "their parents, which only a full restore keeps shared")
        left_out = self._shared_with_root(directory)
        if (left_out is None or not self.fill_enabled or not _wants_fill(self.request, self.manifest, self.binary)
                or thp_always()):
            # (under transparent huge pages for every mapping, a child's copy-on-write fault in an
            # inherited huge page could fill in pages that are to come through userfaultfd)
            return left_out or {}
        treeshare.root_in_full(directory, self.manifest)
        holes = self.plan.prepare(directory, self.manifest, FILL_MIN_BYTES)  # counted without those left to the root
        if not holes:
            return left_out
        self.memory = "fill"
        return LeftOut(left_out.ranges, holes)

    def _forked_memory_shared(self) -> bool:
        """Whether the tree's children hold many of their parent's pages (a pool of workers
        forked from one parent): CRIU's restore from the pages images gives such pages back
        shared, copy-on-write, as they were; copied in through userfaultfd or filled in by a
        page server, each process would get a private copy (measured: 100 children of a Python
        parent, 647 MiB instead of about 200 MiB, and slower). A third of the children's pages
        held by their parents decides."""
        by_pid = {proc["pid"]: proc.get("ppid") for proc in self.manifest.processes}
        entries = {entry.name: entry for entry in self.manifest.files if entry.kind == "pages"}
        self._load_page_lists()
        ids: dict[int, np.ndarray] = {}

        def ids_of(pid: int) -> np.ndarray:
            # The first 64 bits of each id (of a 128-bit hash): for a ratio, as good as the
            # whole id, and sorted several times faster than 16-byte strings.
            if pid not in ids:
                image = self.plan.runs[pid][0]
                ids[pid] = distinct(np.frombuffer(self._page_list(entries[image]), dtype=np.uint64)[0::2])
            return ids[pid]

        shared = total = 0
        for pid, parent in by_pid.items():
            if pid not in self.plan.runs or parent not in self.plan.runs or self.plan.runs[pid][0] not in entries:
                continue
            mine = ids_of(pid)
            total += len(mine)
            shared += len(np.intersect1d(mine, ids_of(parent), assume_unique=True))
        return total > 0 and shared * 3 >= total


def wait_for_memory(result: RestoreResult, settings: Settings, reporter: Reporter = NullReporter(),
                    timeout: float | None = None) -> dict:
    """After a lazy restore: waits until the page server has put the tree's last page back,
    reporting pages in (and bytes fetched from a remote store) as they come; returns its
    figures with the times from the restore's start (time_to_running_ms, last_page_ms).
    Raises CriuFailed if the page server failed (its watcher has then ended the tree), and
    leaves the tree and the server alone if the wait is interrupted or times out."""
    lazy = result.lazy
    if lazy is None:
        raise RuntimeError("wait_for_memory after a restore that was not lazy")
    began = time.time() - result.duration_ms / 1000  # when the restore began
    work_dir = Path(lazy["log"]).parent
    deadline = None if timeout is None else time.monotonic() + timeout
    figures: dict | None = None
    while True:
        figures = page_server_stats(lazy["server_pid"], work_dir, settings.lazy_dir) or figures
        status = (figures or {}).get("status", "serving")
        if figures is not None:
            fetched = figures.get("bytes_fetched") or 0
            what = f"memory coming back ({fetched / (1 << 20):.0f} MiB fetched)" if fetched else "memory coming back"
            total = int(figures.get("pages_total") or 1)
            # (more pages than the checkpoint's once the tree forks: the children's are copied in too)
            reporter.progress(min(int(figures.get("pages_served") or 0), total), total, what)
        if status != "serving" or procs.process_state(lazy["server_pid"]) in (None, "Z"):
            break
        if deadline is not None and time.monotonic() > deadline:
            raise UsageError(f"the page server was still filling the tree's memory in after {timeout:.0f} s",
                             hint=f"it goes on: 'ckpt show {result.manifest.id}' reports failures")
        time.sleep(0.1)
    figures = page_server_stats(lazy["server_pid"], work_dir, settings.lazy_dir) or figures or {}
    status = figures.get("status", "unknown")
    if status != "done":
        raise CriuFailed(f"the lazy restore's page server ended before every page was back ({status}); "
                         "its watcher ended the tree", log_path=str(work_dir / "page-server.log"))
    last = figures.get("last_page_s")
    started = figures.get("started_at") or began
    return {"time_to_running_ms": result.duration_ms,
            "last_page_ms": None if last is None else round((started + last - began) * 1000, 1),
            "pages": figures.get("pages_served"), "bytes_fetched": figures.get("bytes_fetched", 0),
            "store_requests": figures.get("store_requests", 0)}


def _only_child(pid: int) -> int:
    """The restored root of a copy: its init's only child."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise UsageError(f"the restored copy's init (PID {pid}) has {len(children)} children, not one")
    return int(children[0])


def _run_post_restore_hook(request: RestoreRequest, pid: int, manifest: Manifest, reporter: Reporter,
                           timeout: float) -> str | None:
    """Runs --post-restore once the tree runs; returns its failure, which leaves the tree alone."""
    if not request.post_restore_hook:
        return None
    from ckpt.schedule.hooks import run_hook

    reporter.step("running the post-restore hook")
    try:
        run_hook(request.post_restore_hook, "post-restore", pid, manifest.id, manifest.name, timeout)
    except HookFailed as exc:
        reporter.warn(f"{exc}; the restored tree keeps running")
        return str(exc)
    return None


def _tcp_connections(manifest: Manifest, images_dir: Path, saved: bool, request: RestoreRequest,
                     host: hostcheck.HostReport, reporter: Reporter) -> list[tcppeers.ConnectionPlan]:
    """How each of the tree's TCP connections comes back (ckpt/restore/tcppeers.py): on another
    host closed unless told otherwise (their peers have moved on, the local address is another
    machine's); on this one each established unless its peer is on this host and no longer
    holds it. Decided as late as it can be, once the tree's PIDs are free (the dumped
    original, killed, has closed its ends). Listening sockets listen again either way. Says in
    one line each when they do not come back as a plain restore would."""
    elsewhere = f"taken on {manifest.host or 'another host'}, this is {host.this_host}"
    close = request.tcp_close
    if not saved:
        if host.another_host:
            reporter.info(f"checkpoint {elsewhere}")
        return []
    from ckpt.criu.images import tcp_connections  # deferred: imports pycriu

    plans = tcppeers.plan(tcp_connections(images_dir), host.another_host, close,
                          [(tuple(local), tuple(remote)) for local, remote in request.group_peers],
                          migrated=request.migrated)
    if request.migrated and close is None:
        for moved in plans:
            reporter.info(moved.describe())
    elif host.another_host and close is None:
        reporter.info(f"checkpoint {elsewhere}: its established TCP connections are restored closed (the program "
                      "sees them fail), listening sockets listen again; --tcp-established restores them as they were")
    elif host.another_host and not close:
        reporter.info(f"checkpoint {elsewhere}: its established TCP connections are restored as they were "
                      "(--tcp-established)")
    elif close:
        reporter.info("established TCP connections are restored closed (--tcp-close)")
    elif close is None:
        for closed in (p for p in plans if p.restored == "closed"):
            reporter.info(closed.describe() + " (the program sees it fail; --tcp-established restores it anyway)")
    return plans


def _wants_lazy(request: RestoreRequest, manifest: Manifest, binary, lazy_min_bytes: int) -> bool:
    """Whether to try a lazy restore (LazyPlan.prepare then decides from the images)."""
    if request.lazy is False:
        return False
    if request.copy is not None:
        return False  # run_copy restores fully (as --new-pidns)
    if request.new_pidns:
        if request.lazy:
            raise UsageError("--lazy and --new-pidns cannot be combined",
                             hint="drop one of them (a restore into a new PID namespace is a full one)")
        return False
    if request.lazy is None and manifest.bytes_total < lazy_min_bytes:
        return False  # too small whatever its pages: spares the kernel check
    if not lazy_supported(binary):
        if request.lazy:
            raise UsageError("this kernel cannot restore lazily (CRIU's uffd-noncoop check fails)",
                             hint="restore with --eager")
        return False
    return True


# Below this much memory, writing the pages image costs less than handing the tree's
# userfaultfds over.
FILL_MIN_BYTES = 16 << 20


def _wants_fill(request: RestoreRequest, manifest: Manifest, binary) -> bool:
    """Whether a full restore copies the tree's memory in through userfaultfd (LazyPlan.prepare
    then decides from the images): the kernel must be able to restore lazily. Copies of a clone
    share one laid out pages image, and a restore into a new PID namespace runs CRIU in
    another process: both read the pages images."""
    if request.copy is not None or request.new_pidns or request.images_from is not None:
        return False
    return manifest.bytes_total >= FILL_MIN_BYTES and lazy_supported(binary)


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
