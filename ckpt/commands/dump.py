"""Use case: checkpoint a process tree into the store.

Pre-flight, CRIU dump into a staging area, ingest the images into the store, commit the
manifest last. With stop=True the commit happens inside CRIU's post-dump notification, while
the tree is still frozen, so the target is killed only once its checkpoint exists.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ckpt.commands.session import Criu, Session, host_criu
from ckpt.settings import Settings, StoreLocation
from ckpt.dump import incremental
from ckpt.dump import unchanged
from ckpt.dump.commit import DumpRecord, ingest_and_commit
from ckpt.dump.dump_options import DumpOptions
from ckpt.dump.target_lock import dumping
from ckpt.errors import CkptError, DamagedCheckpoint, ProcessNotFound, StoreBusy, TargetRefused, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore import copies
from ckpt.restore.lazy import wait_for_lazy_restores
from ckpt.store import Manifest, Origin, Store, ids
from ckpt.store.materialize import materialize_parent
from ckpt.store.password import PasswordSource
from ckpt.store.blocks.blockstore import MERGE_ABOVE
from ckpt.store.blocks.segments import CODECS
from ckpt.system import procs

if TYPE_CHECKING:
    from ckpt.dump import pagestream
    from ckpt.dump.early_ingest import EarlyIngest
    from ckpt.store.staging import DumpStaging


@dataclass
class DumpRequest:
    pid: int
    name: str | None = None
    stop: bool = False
    codec: str = "zstd"
    # None: detect; True/False: forced by the user.
    shell_job: bool | None = None
    tcp_established: bool | None = None
    ext_unix_sk: bool | None = None
    file_locks: bool | None = None
    pre_dump_hook: str | None = None
    # Use the kernel's dirty-page tracking when it has it (False: always a full dump).
    dirty_tracking: bool = True
    # --copy-to of a schedule or `ckpt run`: the store the checkpoint is to be copied to, and who
    # owes the copy ("schedule NAME", "run NAME"); a pending-copy record is written before the commit.
    copy_to: str | None = None
    copy_origin: str = ""
    # Who asks for the checkpoint, recorded in its manifest: the retention of a schedule or of
    # `ckpt run` forgets only the checkpoints of its own origin.
    origin: Origin = Origin("dump")
    # The checkpoint's id, chosen by whoever asked for it (ckpt.checkpoint(), `CHECKPOINT <id>` on
    # ckpt run's socket) so that both sides know it before the freeze; None: a new one.
    checkpoint_id: str | None = None
    # Seconds to wait for the tree's no_checkpoint() sections (None: CKPT_SECTION_TIMEOUT).
    section_timeout: float | None = None
    # A member of a group checkpoint (ckpt/commands/group.py): {"id", "name"} of the group, in
    # the member's manifest.
    group: dict | None = None


@dataclass
class TrackingPlan:
    """A dirty-tracking dump: of which process incarnation, against which parent (None: full)."""

    target: incremental.TargetIdentity
    parent: Manifest | None


@dataclass
class DumpResult:
    manifest: Manifest
    log_path: Path
    # images stored while CRIU still dumped the rest of the tree (ckpt/dump/early_ingest.py)
    images_stored_early: int = 0

    def to_json(self) -> dict:
        m = self.manifest
        return {
            "id": m.id, "name": m.name, "pid": m.pid, "command": m.command,
            "processes": len(m.processes), "bytes_total": m.bytes_total, "bytes_stored": m.bytes_stored,
            "freeze_ms": m.stats.get("freeze_ms"), "duration_ms": m.stats.get("duration_ms"),
            "pages": m.stats.get("pages"), "pages_new": m.stats.get("pages_new"),
            "bytes_dedup": m.stats.get("bytes_dedup"), "compression_ratio": m.stats.get("compression_ratio"),
            "pages_dumped": m.stats.get("pages_dumped"),
            "dirty_tracking": m.criu.get("tracking"),
            # what a restore relays to --output: pipes and UNIX stream sockets to outside the tree
            "external_pipes": m.criu.get("external_pipes", []),
            "external_sockets": m.criu.get("external_sockets", []),
            # datagram sockets a restore connects again to the paths they sent to
            "external_datagram_sockets": m.criu.get("external_datagram_sockets", []),
            "stopped": not DumpOptions.from_manifest(m.criu.get("options", {})).leave_running,
            "images_stored_early": self.images_stored_early,
            "log": str(self.log_path),
        }


def check_request(request: DumpRequest) -> None:
    """Refuses a bad value before anything is frozen or written (a bad codec used to be
    noticed only by the ingest, after CRIU had dumped the tree)."""
    procs.check_pid(request.pid)
    if request.codec not in CODECS:
        raise UsageError(f"unknown compression {request.codec!r}", hint=f"use one of {', '.join(CODECS)}")
    if request.name is not None:
        ids.check_name(request.name)
    if request.checkpoint_id is not None:
        ids.check_new_id(request.checkpoint_id)
    if request.section_timeout is not None and not request.section_timeout >= 0:
        raise UsageError(f"section timeout {request.section_timeout} is not 0 or more seconds")


def dump(store_root: StoreLocation, request: DumpRequest, reporter: Reporter = NullReporter(),
         around_freeze: Callable[[], AbstractContextManager[object]] | None = None, *,
         settings: Settings, passwords: PasswordSource | None = None) -> DumpResult:
    """Checkpoints request.pid into the store at store_root (created if needed): the phases of a
    DumpSession in a row.

    Before anything is frozen, waits for the tree's no_checkpoint() sections to end (SectionTimeout
    when one outlasts the section timeout). around_freeze (`ckpt run`'s socket server) is entered
    once they have, before the pre-flight, and left as soon as CRIU is done."""
    with DumpSession(store_root, request, reporter, around_freeze, settings=settings, passwords=passwords) as session:
        session.prepare()
        session.capture()
        session.commit()
        return session.finish()


class DumpSession(Session[DumpRequest]):
    """One dump of one tree, as the phases a coordinator drives (a group checkpoint, a
    migration): prepare (checks, locks, staging: nothing frozen), capture (CRIU freezes the
    tree, dumps it and lets it go, or with --stop commits while it is frozen and then ends it),
    commit (ingest and manifest: the checkpoint exists from then on), finish (clean up after
    the commit), and abort, safe from any phase and idempotent: the tree is never left frozen
    (CRIU thaws it on any failure), nothing is committed that was not already, the staging is
    removed and every lock released. Used as a context manager, an exception aborts.

    The state lives here, not in closures: what prepare found (facts, options, tracking), what
    it holds (locks, staging, the read-ahead of the earlier checkpoint, the page stream) and
    what capture and commit produced."""

    def __init__(self, store_root: StoreLocation, request: DumpRequest, reporter: Reporter = NullReporter(),  # noqa: PLR0913
                 around_freeze: Callable[[], AbstractContextManager[object]] | None = None, *,
                 settings: Settings, passwords: PasswordSource | None = None, store: Store | None = None,
                 criu: Callable[[Settings], Criu] = host_criu, clock: Callable[[], float] = time.monotonic):
        """settings and passwords: the caller's (the CLI's), passed down; store: the store to dump
        into (default: opened, or created, at store_root by prepare); criu: makes the CRIU client
        (default: this host's, as root); clock: seconds, monotonic (the dump's duration and freeze)."""
        super().__init__(store_root, request, settings, reporter, passwords, store, criu, clock)
        self.around_freeze = around_freeze
        self._window = ExitStack()  # sections and clients held off: released once CRIU lets the tree go
        self.staging: DumpStaging | None = None
        self.stream: pagestream.PageStream | None = None
        self.ahead: EarlyIngest | None = None
        self.earlier: unchanged.EarlierCheckpoint | None = None
        self.marks: dict[str, float] = {}  # CRIU's notifications, by when they came
        # The same by the wall clock (seconds since the epoch): what a group checkpoint records
        # of each member's freeze, comparable across members (and, roughly, across hosts).
        self.wall_marks: dict[str, float] = {}
        self.manifest: Manifest | None = None
        self.images_stored_early = 0
        self.copy: copies.CopyTarget | None = None  # the target is a copy of a clone
        self.copy_root: int | None = None  # the copy's root, by its PID inside its namespace

    # ---- prepare: nothing frozen --------------------------------------------------------

    def _whole_copy(self) -> None:
        """A PID in a copy of a clone (docs/design.md, "Clones"): CRIU dumps a PID namespace
        only from its init, so the copy's whole namespace is dumped, from its init, its network
        namespace as external (a restore gives it a fresh one)."""
        pid = self.request.pid
        self.copy = copy = copies.find_copy(pid, self.settings.copies_dir)
        if copy is None:
            return
        self.copy_root = copies.root_of(copy, pid)
        identity = copy.identity or {}
        which = f"copy {identity['copy']} of clone {identity.get('clone')}" if "copy" in identity else "a copy"
        if pid != copy.init_pid:
            self.reporter.info(f"PID {pid} runs in {which} (PID namespace {copy.pidns_inode}): dumping the whole "
                               f"namespace from its init, PID {copy.init_pid}")
            self.request = replace(self.request, pid=copy.init_pid)
        else:
            self.reporter.info(f"PID {pid} is the init of {which}: dumping its whole PID namespace")

    def prepare(self) -> None:
        """Checks the request, takes the target's lock, waits for its sections, inspects the
        tree and opens the store, then stages: every failure here leaves the tree untouched."""
        check_request(self.request)
        self._whole_copy()
        self.criu = self.new_criu(self.settings)  # as root (the default), or nothing is done
        self.binary = self.criu.binary
        self._hold_target()
        self._inspect()
        self._stage()

    def _hold_target(self) -> None:
        from ckpt.agent.sections import dump_gate

        request, reporter = self.request, self.reporter
        current = self.settings
        timeout = current.section_timeout if request.section_timeout is None else request.section_timeout
        self._held.enter_context(dumping(request.pid, current.lock_timeout, lambda holder: reporter.info(
            f"waiting for another dump of PID {request.pid} (ckpt PID {holder}) to finish")))
        gate = self._held.enter_context(dump_gate(request.pid, timeout, lambda pid: reporter.info(
            f"waiting for PID {pid} to leave its no_checkpoint() section")))
        self._held.callback(self._window.close)
        if self.around_freeze is not None:
            self._window.enter_context(self.around_freeze())
        # Sections may start again, and clients connect again, once CRIU has let the tree go.
        self._window.callback(gate.release)

    def _inspect(self) -> None:
        request, reporter = self.request, self.reporter
        self.facts = procs.preflight(request.pid)
        # CRIU would dump memory a lazy restore has not filled in yet as missing.
        wait_for_lazy_restores(set(self.facts.pids), lambda record: reporter.info(
            f"waiting for the lazy restore of checkpoint {record.get('checkpoint')} to bring back all of its memory"),
            self.settings.lazy_dir)
        store = self._open_store(create=True)
        options = _choose_options(request, self.facts)
        _report_findings(request, self.facts, options, reporter)
        self.tracking = _plan_tracking(store, request, self.binary, reporter)
        self.options = replace(options, track_mem=self.tracking is not None)
        self.checkpoint_id = _new_checkpoint_id(store, request)
        if request.pre_dump_hook:
            from ckpt.schedule.hooks import run_hook

            reporter.step("running the pre-dump hook")
            run_hook(request.pre_dump_hook, "pre-dump", request.pid, self.checkpoint_id, request.name,
                     self.settings.hook_timeout)

    def _stage(self) -> None:
        store = self._store()
        self._hold_store_lock()
        store.remove_leftovers()
        self.staging = store.begin_dump(self.checkpoint_id)
        self.log_dir = store.logs_dir(self.checkpoint_id)
        parent_img, self.tracking = _lay_out_parent(store, self.staging, self.tracking, self.checkpoint_id,
                                                    self.reporter)
        self.criu_options = self.options.to_criu_dump(
            self.staging.images_dir, self.log_dir, "dump.log", self.request.pid, parent_img,
            [f"unix[{s['inode']}]" for s in self.facts.external_sockets]
            + ([f"net[{self.copy.netns_inode}]:{copies.NET_KEY}"] if self.copy and self.copy.netns_inode else []))
        newest = store.newest_of(self.request.pid)
        if newest:
            self.earlier = unchanged.EarlierCheckpoint(newest, store, self.staging.root / "earlier")
        self.stream = _page_stream(store, self.staging, self.tracking, self.earlier, self.settings.page_stream)
        if self.stream is not None:
            self.criu_options.page_stream_fd = self.stream.start()
        elif self.request.stop and self.tracking is None and self.earlier is None:
            self.ahead = _early_ingest(store, self.staging, self.request.codec)

    # ---- capture: the tree frozen, dumped, let go ---------------------------------------

    def capture(self) -> None:
        """Runs CRIU: it freezes the tree, dumps it and resumes it (or, with --stop, this
        session commits in CRIU's post-dump notification, while the tree is still frozen, and
        CRIU then ends it: the target dies only once its checkpoint exists)."""
        self.reporter.step(f"dumping PID {self.request.pid} ({self.facts.command}) with CRIU "
                           f"{self.binary.version_text}")
        phase("dump.staged")
        try:
            self.criu.dump(self.criu_options, on_notify=self._notified, on_started=self._read_ahead)
        except CkptError:
            failure = self.stream.failure() if self.stream is not None else None
            if failure is not None:  # CRIU failed because ckpt stopped receiving
                raise failure from None
            if procs.process_state(self.request.pid) is None:
                raise ProcessNotFound(f"process {self.request.pid} exited during the dump; nothing was saved") \
                    from None
            raise
        finally:
            self._window.close()
        phase("dump.after-criu")
        self._pages_received()

    def capture_frozen(self, hold_limit: float = 300.0) -> None:
        """capture() in two steps, for a coordinator that holds several trees frozen at once (a
        group checkpoint) or acts between the dump and the tree's release (a migration): CRIU
        runs in a thread, and this returns once the tree is frozen and dumped (CRIU's post-dump
        notification; with --stop, the checkpoint is committed by then). The tree stays frozen
        until release() (CRIU thaws it; --stop: ends it); abort() instead refuses the
        notification, and CRIU thaws the tree and fails the dump (a --stop checkpoint already
        committed stays). After hold_limit seconds the hold ends as an abort would: a
        coordinator that died must not leave a tree frozen."""
        self._run_held(self.capture, "the tree was held frozen", hold_limit)

    def _read_ahead(self) -> None:
        """Once CRIU has its request: the index and the earlier checkpoint are read from the
        store alone (the store lock keeps every index file and object in place) while CRIU
        works, so that what is left from the target's resumption to the commit is short.
        Not before: loading the index imports numpy, which delayed CRIU's start by 0.1-0.2 s
        when it ran alongside ckpt's own imports."""
        if self.stream is not None:
            self.stream.criu_started()
        self._store().blocks.preload_index()
        if self.earlier is not None:
            self.earlier.start()
        if self.ahead is not None:
            self.ahead.start()

    def _pages_received(self) -> None:
        if self.stream is not None and self.staging is not None and not self.staging.streamed:
            self.staging.streamed = self.stream.finish()

    def _notified(self, script: str, _pid: int) -> None:
        self.marks[script] = self.clock()
        self.wall_marks[script] = time.time()
        if script != "post-dump":
            return
        phase("dump.frozen")
        self._not_given_up()
        if self.request.stop:
            self._pages_received()
            # CRIU writes its stats only after this point: the freeze so far is measured here.
            frozen_ms = round((self.marks["post-dump"] - self.marks.get("pre-dump", self.started)) * 1000, 1)
            self._commit(frozen_ms)
            self.reporter.step("checkpoint committed; CRIU ends the target")
        self._held_here()

    # ---- commit, finish, abort ----------------------------------------------------------

    def commit(self) -> Manifest:
        """Ingests the images and commits the manifest (done already for --stop, in capture)."""
        return self.manifest if self.manifest is not None else self._commit(None)

    def _commit(self, frozen_ms: float | None) -> Manifest:
        if self.staging is None:
            raise RuntimeError("commit before prepare")  # a coordinator's bug, not the user's
        staging, images_dir = self.staging, self.staging.images_dir
        before_commit = self._record_pending_copy if self.request.copy_to else None
        record, completion = self._record(frozen_ms), self._completion()
        ahead = self.ahead.take() if self.ahead is not None else None  # (aborted by close() unless committed)
        self.images_stored_early = len(ahead.stored) if ahead is not None else 0
        self.manifest = ingest_and_commit(
            self._store(), staging, record, self.request.codec, self.reporter, completion,
            # (a streamed dump knows its unchanged pages already: see StreamedPages)
            earlier=self.earlier.pieces(images_dir) if self.earlier and not staging.streamed else None,
            before_commit=before_commit, ahead=ahead)
        return self.manifest

    def _record(self, frozen_ms: float | None) -> DumpRecord:
        """What CRIU's images and the pre-flight say of the tree: the manifest but its images."""
        from ckpt.criu import images  # deferred: imports pycriu

        facts, tracking, store = self.facts, self.tracking, self._store()
        # CRIU writes its stats-dump image into the work directory, next to its log.
        stats = images.dump_stats(store.logs_dir(self.checkpoint_id))
        processes = images.process_tree(self._staging().images_dir)
        commands = _commands(facts)
        for proc in processes:
            proc["command"] = commands.get(proc["pid"], proc.get("comm", "?"))
        criu_facts = {"version": self.binary.version_text, "options": self.options.to_manifest(),
                      "tty": facts.has_tty}
        for outside in ("external_pipes", "external_sockets", "external_datagram_sockets"):
            if getattr(facts, outside):
                criu_facts[outside] = getattr(facts, outside)
        if self.copy is not None:
            identity = self.copy.identity or {}
            criu_facts["copy"] = {"clone": identity.get("clone"), "copy": identity.get("copy"),
                                  "network": "own" if self.copy.netns_inode else "host",
                                  "root_in_namespace": self.copy_root}
        if self.request.group is not None and self.options.tcp_established:
            # A group restore brings the connections between members back established: it
            # learns which they are from every member's manifest (see "Groups" in docs/design.md).
            criu_facts["tcp_connections"] = [{"local": list(c.local), "remote": list(c.remote)}
                                             for c in images.tcp_connections(self._staging().images_dir)]
        return DumpRecord(
            checkpoint_id=self.checkpoint_id, pid=self.request.pid, command=facts.command, processes=processes,
            started=self.started, name=self.request.name, origin=self.request.origin, criu=criu_facts,
            criu_stats={"freeze_ms": stats.get("frozen_ms", frozen_ms), "pages_written": stats.get("pages_written"),
                        "pages_scanned": stats.get("pages_scanned"),
                        # the wall time CRIU froze the tree (its pre-dump notification): what the
                        # copies of a clone see of the agent's journal ends there
                        "frozen_at": self.wall_marks.get("pre-dump")},
            tracking={"target": tracking.target.key, "parent": tracking.parent.id if tracking.parent else None}
            if tracking is not None else None, group=self.request.group, clock=self.clock)

    def _completion(self):
        """A dirty-tracking dump's completer of its page lists from the parent's (or None)."""
        tracking, staging = self.tracking, self._staging()
        if tracking is None or tracking.parent is None:
            return None
        return incremental.completer(staging.images_dir, staging.root / "parent",
                                     {e.name: e for e in tracking.parent.files}, self._store().objects.load_page_list)

    def _record_pending_copy(self, manifest: Manifest) -> None:
        """--copy-to: the pending-copy record, written right before the commit."""
        from ckpt.store import pending

        pending.add(self._store().root, manifest.id, self.request.copy_to or "", self.request.copy_origin)

    def finish(self) -> DumpResult:
        """After the commit: cleans up, waits for a --stop tree's PIDs, merges index files."""
        if self.manifest is None:
            raise RuntimeError("finish before commit")
        self._release_staging()
        if self.request.stop:
            _wait_for_tree_dead(self.manifest.all_pids, self.clock)
        self._held.close()
        _merge_index_files(self._store(), self.reporter)
        self._finished = True
        return DumpResult(self.manifest, self.log_dir / "dump.log", self.images_stored_early)

    def abort(self) -> None:
        """From any phase: nothing more is committed, the staging goes, every lock is released.
        The tree is never frozen here: CRIU thaws it when its dump fails or is cut short, or
        when the hold of capture_frozen() is refused."""
        self._finished = True
        self._drop_hold()
        try:
            self._release_staging()
        finally:
            self._held.close()

    def _release_staging(self) -> None:
        try:
            if self.stream is not None:
                self.stream.abort()  # nothing left to do if it finished
            if self.ahead is not None:
                self.ahead.close()
            if self.earlier is not None:
                self.earlier.wait()  # it writes into the staging area
        finally:
            if self.staging is not None:
                self.staging.remove()
            self.stream = self.earlier = self.staging = self.ahead = None

    def _staging(self) -> DumpStaging:
        if self.staging is None:
            raise RuntimeError("the staging is made by prepare")
        return self.staging


TREE_DEATH_WAIT_S = 3.0


def _wait_for_tree_dead(pids: list[int], clock: Callable[[], float]) -> None:
    """After --stop: waits (briefly) until every process of the tree has died, so that the
    command returns with the target gone. Dead is enough, a zombie counts: who reaps it (the
    root's parent, or this machine's init for the orphaned children, a second or two late) is
    not ckpt's to wait for, and a restore waits for the PIDs to be free itself
    (procs.wait_for_pids_free). Waiting for the reaping here cost every dump of a tree whose
    root's parent reaps late the whole 3 s timeout (a profile of a 26-process tree: 3.0 of
    its 4.2 s)."""
    deadline = clock() + TREE_DEATH_WAIT_S
    alive = list(pids)
    while alive:
        alive = [pid for pid in alive if procs.process_state(pid) not in (None, "Z", "X")]
        if not alive or clock() >= deadline:
            return
        time.sleep(0.01)


def _new_checkpoint_id(store: Store, request: DumpRequest) -> str:
    """The id the asker chose (ckpt.checkpoint(), CKPT_SOCKET), which must be new, or a fresh one."""
    if request.checkpoint_id is None:
        return ids.new_id()
    if request.checkpoint_id in store.checkpoint_ids():
        raise UsageError(f"a checkpoint with ID {request.checkpoint_id} exists already",
                         hint="an ID given with --id must be new: take one from ckpt.store.ids.new_id()")
    return request.checkpoint_id


def _page_stream(store: Store, staging, tracking: TrackingPlan | None,
                 earlier: unchanged.EarlierCheckpoint | None, wanted: bool) -> pagestream.PageStream | None:
    """The receiver of the pages CRIU streams (ckpt/dump/pagestream.py), or None: a dump with
    dirty-page tracking has CRIU write pages images (it needs their parent images), as does
    the first dump of a target (nothing to compare its pages with), and CKPT_PAGE_STREAM=0
    asks for that path.

    Everything the receiver compares pages with is read now, before CRIU freezes the tree:
    the earlier checkpoint's pages by address. With damage recorded in the store every page
    is kept: a page known only from a damaged segment must be stored again (BlockIndex.held)."""
    if tracking is not None or earlier is None or not wanted:
        # A first dump keeps every page: streamed, they would be copied twice more while the
        # tree is frozen than CRIU's own pages image (which then becomes the pack as it is).
        return None
    from ckpt.dump.pagestream import PageStream, earlier_pages  # deferred: imports numpy

    known: dict = {}
    if not store.blocks.index().has_damage:
        known = earlier_pages(earlier.read_now())
    return PageStream(staging.images_dir, staging.root / "streamed", store.blocks.seed, known)


def _early_ingest(store: Store, staging, codec: str) -> EarlyIngest | None:
    """The ingest of images as CRIU closes them (ckpt/dump/early_ingest.py), for a first dump
    that ends its tree; None where inotify is not to be had (the ingest after CRIU stores
    every image, as it always could)."""
    from ckpt.dump.early_ingest import EarlyIngest  # deferred: only dumps that end their tree

    try:
        return EarlyIngest(staging.images_dir, store.objects, codec, staging.root / "early")
    except OSError:
        return None


def _report_findings(request: DumpRequest, facts: procs.TargetFacts, options: DumpOptions,
                     reporter: Reporter) -> None:
    """Says which CRIU options were detected, what the tree shares with the outside, which
    deleted files go into the checkpoint, and which logs will keep a restore from working."""
    detected = [k for k in DumpOptions.DETECTED if getattr(options, k) and getattr(request, k) is None]
    if detected:
        reporter.info("detected: " + ", ".join(f"--{k.replace('_', '-')}" for k in detected))
    for note in _outside_notes(facts):
        reporter.warn(note)
    for deleted in facts.deleted_files:
        if deleted["size"] > CRIU_GHOST_LIMIT:
            held = f"fd {deleted['fd']}" if deleted["fd"] is not None else "mapped"
            reporter.info(f"PID {deleted['pid']} holds a deleted file, {deleted['path']} ({held}, "
                          f"{deleted['size'] / (1 << 20):.1f} MiB): its content is saved in the checkpoint")
    for log in facts.logs_read_back:
        reporter.warn(f"PID {log['pid']} writes a log, {log['path']} (fd {log['fd']}), that the tree also reads "
                      f"({log['how']}): once it grows, a restore of this checkpoint is refused (only a file the "
                      "tree just writes to may grow: opened write-only, as by '>' or '>>')")


def _lay_out_parent(store: Store, staging, tracking: TrackingPlan | None, checkpoint_id: str,
                    reporter: Reporter) -> tuple[str | None, TrackingPlan | None]:
    """For a dirty-tracking dump: records the attempt and lays out the parent checkpoint for
    CRIU. Returns CRIU's parent_img (None: read every page) and the tracking plan in effect."""
    if tracking is None:
        return None, None
    # Recorded before CRIU clears the target's soft-dirty bits: if this dump is never
    # committed, the next one knows not to trust them (see ckpt/dump/incremental.py).
    incremental.TrackingLog(store.settings.tracking_dir).record_attempt(tracking.target, store.root, checkpoint_id)
    if tracking.parent is None:
        return None, tracking
    try:
        materialize_parent(store.objects, tracking.parent, staging.root / "parent")
    except DamagedCheckpoint as exc:
        # A damaged older checkpoint must not stop a new one: read every page.
        reporter.warn(f"{exc.message}; dirty-page tracking reads every page this time")
        return None, TrackingPlan(tracking.target, None)
    return "../parent", tracking  # CRIU takes it relative to the images directory


def _choose_options(request: DumpRequest, facts: procs.TargetFacts) -> DumpOptions:
    """The dump's options: what the pre-flight found, unless the user forced them."""
    def chosen(forced: bool | None, found: bool) -> bool:
        return found if forced is None else forced

    tcp_established = chosen(request.tcp_established, facts.has_tcp_established)
    return DumpOptions(
        shell_job=chosen(request.shell_job, facts.needs_shell_job),
        tcp_established=tcp_established,
        # CRIU dumps a datagram socket connected outside the tree only with --ext-unix-sk (and
        # connects it to the same path on restore).
        ext_unix_sk=chosen(request.ext_unix_sk, bool(facts.external_datagram_sockets)),
        file_locks=chosen(request.file_locks, facts.has_file_locks),
        leave_running=not request.stop,
        # The network lock keeps established TCP connections quiet while they are dumped (and,
        # with --stop, until they are restored). Without any, there is nothing to lock: taking
        # the nftables lock anyway cost 0.1-0.2 s of every freeze here (most of a small agent's),
        # and a --stop dump left its empty table behind until a restore removed it. A connection
        # opened since the pre-flight makes CRIU refuse the dump, with a hint to retry.
        network_lock="nftables" if tcp_established else "skip",
        ghost_limit=_ghost_limit(facts),
    )


def _merge_index_files(store: Store, reporter: Reporter) -> None:
    """Bounds the number of index files a lookup goes through ("Merging index files" in
    docs/design.md): only if the exclusive lock is free at once, since the checkpoint is
    committed already and another command may hold the store."""
    if len(store.blocks.index_file_names()) <= MERGE_ABOVE:
        return
    try:
        with store.lock(exclusive=True, timeout=0):
            merged = store.blocks.merge_index_files()
    except StoreBusy:
        return  # a later dump merges them
    except (OSError, CkptError) as exc:
        reporter.warn(f"the store's index files were not merged ({exc}); a later dump tries again")
        return
    if merged:
        reporter.info(f"merged {len(merged)} index files into one")


def _plan_tracking(store: Store, request: DumpRequest, binary, reporter: Reporter) -> TrackingPlan | None:
    """Whether this dump uses dirty-page tracking, and against which parent checkpoint."""
    from ckpt.criu.client import has_feature

    if not request.dirty_tracking:
        return None
    target = incremental.identify(request.pid)
    if target is None or not has_feature(binary, "mem_dirty_track"):
        return None  # no soft-dirty in this kernel: the block store still stores only new pages
    log = incremental.TrackingLog(store.settings.tracking_dir)
    log.forget_gone()
    last = log.last_attempt(target)
    parent = None
    if last:
        try:
            candidate = store.load(last["checkpoint"])
        except (CkptError, KeyError):
            candidate = None
        if incremental.choose_parent(last, store.root, target,
                                     candidate.criu.get("tracking") if candidate else None):
            parent = candidate
    if parent is not None:
        reporter.info(f"dirty-page tracking: reading only pages written since {parent.id}")
    else:
        reporter.info("dirty-page tracking: first tracked dump of this process, all pages are read")
    return TrackingPlan(target, parent)


CRIU_GHOST_LIMIT = 1 << 20  # CRIU saves deleted files up to this size unless told otherwise
MAX_GHOST_LIMIT = (1 << 32) - 1  # the RPC field is 32 bits


def _ghost_limit(facts: procs.TargetFacts) -> int | None:
    """The size up to which CRIU is to save deleted files (None: its default will do): twice
    the largest the tree holds, which may still grow while CRIU works."""
    largest = max((f["size"] for f in facts.deleted_files), default=0)
    if largest <= CRIU_GHOST_LIMIT:
        return None
    if largest > MAX_GHOST_LIMIT:
        biggest = max(facts.deleted_files, key=lambda f: f["size"])
        raise TargetRefused(f"PID {biggest['pid']} holds a deleted file of {largest / (1 << 30):.1f} GiB "
                            f"({biggest['path']}): CRIU cannot save a deleted file over 4 GiB",
                            hint="make the program close (or truncate) it, then dump again")
    return min(MAX_GHOST_LIMIT, -(-2 * largest // (1 << 20)) << 20)


def _outside_notes(facts: procs.TargetFacts) -> list[str]:
    """What a restore will do with the tree's pipes and sockets to programs outside it."""
    to_output = "after a restore that output goes to a file ('ckpt restore --output' chooses where)"
    notes = []
    for pipe in facts.external_pipes:
        peer = pipe["peer"] or "a process outside the tree"
        if pipe["end"] == "write":
            notes.append(f"PID {pipe['pid']} writes (fd {pipe['fd']}) into a pipe that {peer} reads: {to_output}")
        else:
            notes.append(f"PID {pipe['pid']} reads (fd {pipe['fd']}) from a pipe that {peer} writes: after a "
                         "restore it reads end of file there")
    for sock in facts.external_sockets:
        notes.append(f"PID {sock['pid']} has a UNIX stream socket (fd {sock['fd']}) connected to "
                     f"{sock['peer'] or 'a process outside the tree'}: {to_output}")
    for sock in facts.external_datagram_sockets:
        where = sock["peer_path"] or "an unnamed socket"
        holder = f" ({sock['peer']})" if sock["peer"] else ""
        notes.append(f"PID {sock['pid']} sends datagrams (fd {sock['fd']}) to {where}{holder}: a restore "
                     "connects it there again, so that socket must exist then")
    return notes


def _commands(facts: procs.TargetFacts) -> dict[int, str]:
    import psutil

    result = {}
    for pid in facts.pids:
        try:
            result[pid] = procs.command_line(psutil.Process(pid))
        except psutil.Error:
            pass
    return result
