"""Use case: restore one checkpoint N times at once (`ckpt clone REF --copies N`, `ckpt restore
REF --copies N`), each copy in a PID namespace of its own (ckpt/restore/copies.py) and, when the
tree listens on a TCP port, a network namespace of its own (docs/design.md, "Clones").

All or nothing: every copy is prepared, then every one restored, each a RestoreSession in a
thread of its own; if any copy fails, those already running are ended (abort) and the error
names the copy and why. Once every copy runs, the clone's registry `<copies dir>/clone-<clone
id>.json` lists them for `ckpt list` and `ckpt show` (running_copies below).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from ckpt.agent.identity import copies_dir
from ckpt.commands.results import JsonResult
from ckpt.errors import CkptError, CloneFailed, UsageError
from ckpt.reporting import NullReporter, PrefixedReporter, Reporter
from ckpt.restore import copies as copies_module
from ckpt.restore import copynet, copywatch
from ckpt.restore.copies import CopyPlacement, end_copy
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Manifest, Store, ids
from ckpt.store.password import PasswordSource
from ckpt.system import procfs
from ckpt.system.files import atomic_write_bytes, make_readable_dir
from ckpt.system.signals import terminations_interrupt

MAX_COPIES = 64
NETWORKS = ("auto", "own", "host")
REGISTRY_FORMAT = 1
# How long the copies' prepare and restore may take, each (a bound on every wait for a thread).
PHASE_TIMEOUT = 600.0

T = TypeVar("T")


@dataclass
class CloneRequest:
    ref: str
    copies: int
    # "own": a network namespace per copy (its ports answer at its address); "host": the host's
    # (ports clash); "auto": own when the checkpoint has a listening TCP socket.
    network: str = "auto"
    lazy: bool | None = None  # as RestoreRequest.lazy
    output: str | None = None  # as RestoreRequest.output
    tcp_close: bool | None = None  # as RestoreRequest.tcp_close
    pid_wait_s: float = 10.0


@dataclass(frozen=True)
class RunningCopy:
    """One copy of a clone, as its registry records it."""

    index: int
    pid: int  # the restored root, in the host's PID namespace
    init_pid: int  # the copy's init (PID 1 of its namespace), in the host's
    init_start: int  # the init's start time (clock ticks since boot): with init_pid, names it
    pid_in_namespace: int
    pidns_inode: int
    netns: str | None
    address: str | None

    def to_json(self) -> dict:
        return {"index": self.index, "pid": self.pid, "init_pid": self.init_pid, "init_start": self.init_start,
                "pid_in_namespace": self.pid_in_namespace, "pidns_inode": self.pidns_inode, "netns": self.netns,
                "address": self.address}

    @classmethod
    def from_json(cls, data: dict) -> RunningCopy:
        return cls(int(data["index"]), int(data["pid"]), int(data["init_pid"]), int(data["init_start"]),
                   int(data["pid_in_namespace"]), int(data.get("pidns_inode") or 0), data.get("netns"),
                   data.get("address"))

    def alive(self) -> bool:
        """Whether the copy still runs: its init lives, the same process (its start time)."""
        try:
            return procfs.start_ticks(self.init_pid) == self.init_start
        except (OSError, ValueError, IndexError):
            return False


@dataclass(frozen=True)
class CloneResult(JsonResult):
    clone: str
    manifest: Manifest
    network: str  # "own" or "host": what "auto" became
    ports: list[int]  # the TCP ports the tree listened on at the checkpoint
    copies: list[RunningCopy]
    registry: Path
    duration_ms: float
    restores: list[dict] = field(default_factory=list)  # each copy's RestoreResult.to_json()
    watcher: int | None = None  # the PID of the clean-up watcher (ckpt/restore/copywatch.py)

    def to_json(self) -> dict:
        return {"clone": self.clone, "checkpoint": self.manifest.id, "name": self.manifest.name,
                "network": self.network, "ports": self.ports, "copies": [c.to_json() for c in self.copies],
                "registry": str(self.registry), "duration_ms": self.duration_ms, "restores": self.restores,
                "watcher": self.watcher}


class CopySession(Protocol):
    """What the clone asks of each copy's restore (RestoreSession; a fake in the tests)."""

    def prepare(self) -> None:
        ...

    def prepared_images(self) -> Path | None:
        ...

    def restore(self) -> int:
        ...

    def finish(self) -> Any:
        ...

    def abort(self) -> None:
        ...


# (placement, request, checkpoint id, reporter, images laid out by the first copy or None).
SessionFactory = Callable[[CopyPlacement, "CloneRequest", str, Reporter, "Path | None"], CopySession]
# Starts the watcher that cleans up after each copy once it ends: (copies dir, clone id) -> its PID.
WatcherStarter = Callable[[Path, str], int]


def check_request(request: CloneRequest) -> None:
    """The request's values, before anything is read or started."""
    if isinstance(request.copies, bool) or not isinstance(request.copies, int) \
            or not 1 <= request.copies <= MAX_COPIES:
        raise UsageError(f"--copies must be 1 to {MAX_COPIES}, not {request.copies}",
                         hint="each copy is a whole restore of the checkpoint")
    if request.network not in NETWORKS:
        raise UsageError(f"--net must be one of {', '.join(NETWORKS)}, not {request.network!r}")


def clone(store_root: StoreLocation, request: CloneRequest, reporter: Reporter = NullReporter(), *,
          settings: Settings, passwords: PasswordSource | None = None, store: Store | None = None,
          new_session: SessionFactory | None = None, start_watcher: WatcherStarter = copywatch.start) -> CloneResult:
    """Restores the checkpoint request.ref names request.copies times at once, each copy in a
    PID namespace of its own; all of them run, or none (the error names the copy that failed).
    new_session(placement, request, checkpoint id, reporter, images) makes a copy's restore
    (default: a RestoreSession with copy=placement, images_from=images); store: the store to read the checkpoint from
    (default: opened at store_root); start_watcher: starts the clean-up after the copies end."""
    check_request(request)
    started = time.monotonic()
    if store is None:
        store = Store.open(store_root, create=False, settings=settings, passwords=passwords)
    with store.lock(exclusive=False, timeout=settings.lock_timeout):
        manifest = store.load(store.resolve(request.ref))
        ports = listening_ports(store, manifest)
    network = request.network if request.network != "auto" else ("own" if ports else "host")
    clone_id = ids.new_id()
    reporter.step(f"clone {clone_id}: {request.copies} cop{'y' if request.copies == 1 else 'ies'} of checkpoint "
                  f"{manifest.id}, network {network}" + (f" (it listens on TCP {_ports(ports)})" if ports else ""))
    make = new_session or _restore_session_factory(store_root, settings, passwords)
    _remove_stale(copies_dir(settings), reporter)
    run = _Cloning(clone_id, manifest.id, request, network, reporter, make)
    registry = copywatch.registry_path(copies_dir(settings), clone_id)
    with terminations_interrupt():  # `timeout ckpt clone`: the copies are ended, never left unlisted
        results = run.run()
        try:
            copies = [_running_copy(index, result) for index, result in enumerate(results, 1)]
            write_registry(registry, clone_id, manifest, copies)
        except OSError as exc:  # a copy already ended (its init gone), or the registry not written
            run.end_all()
            raise CloneFailed(f"clone {clone_id}: could not list its copies in {registry}: {exc.strerror or exc}",
                              hint="every copy was ended: none runs unlisted") from exc
        except BaseException:
            run.end_all()  # interrupted before the copies were listed: none may run unlisted
            raise
    watcher = _start_watcher(start_watcher, copies_dir(settings), clone_id, reporter)
    return CloneResult(clone_id, manifest, network, ports, copies, registry,
                       round((time.monotonic() - started) * 1000, 1),
                       [r.to_json() if hasattr(r, "to_json") else {} for r in results], watcher)


def _remove_stale(directory: Path, reporter: Reporter) -> None:
    """What copies that ended left when their watcher could not clean up (it was killed): their
    networks, and identity files (a new copy's namespace may take one's inode)."""
    try:
        networks = copynet.remove_stale(directory) if any(directory.glob("net-*.json")) else []
        identities = copies_module.remove_stale_identities(directory)
    except (OSError, CkptError) as exc:
        reporter.warn(f"could not clean up after ended copies in {directory}: {exc}")
        return
    if networks or identities:
        reporter.info(f"removed what ended copies left: {len(networks)} network namespace(s), "
                      f"{len(identities)} identity file(s)")


def _start_watcher(start: WatcherStarter, directory: Path, clone_id: str, reporter: Reporter) -> int | None:
    """The copies run either way: without a watcher, what each leaves is removed by the next
    clone's clean-up instead."""
    try:
        return start(directory, clone_id)
    except OSError as exc:
        reporter.warn(f"no watcher cleans up after the copies of clone {clone_id} ({exc.strerror or exc}): the "
                      "next 'ckpt clone' removes what they leave")
        return None


def _ports(ports: list[int]) -> str:
    return ", ".join(str(p) for p in ports)


def listening_ports(store: Store, manifest: Manifest) -> list[int]:
    """The TCP ports the tree listened on at the checkpoint, read from its images (as `ckpt
    show` lists sockets: the manifest itself records only what reaches outside the tree)."""
    from ckpt.criu import images  # deferred: imports pycriu
    from ckpt.store.materialize import materialize
    from ckpt.store.staging import discard

    image_dir = materialize(store.objects, store.staging_area(), manifest, skip_pages=True)
    try:
        described = images.describe(image_dir, manifest.processes)
    finally:
        discard(image_dir)
    ports = {int(fd["local"].rpartition(":")[2]) for proc in described for fd in proc["fds"]
             if fd.get("type") == "tcp" and fd.get("state") == "LISTEN" and fd["local"].rpartition(":")[2].isdigit()}
    return sorted(ports)


def _restore_session_factory(store_root: StoreLocation, settings: Settings,
                             passwords: PasswordSource | None) -> SessionFactory:
    """A RestoreSession per copy, with copy=placement (ckpt/restore/copies.py)."""
    from ckpt.commands.restore import RestoreRequest, RestoreSession

    def make(placement: CopyPlacement, request: CloneRequest, checkpoint: str, reporter: Reporter,
             images: Path | None) -> CopySession:
        restore = RestoreRequest(ref=checkpoint, lazy=request.lazy, output=request.output, tcp_close=request.tcp_close,
                                 pid_wait_s=request.pid_wait_s, copy=placement, images_from=images)
        return RestoreSession(store_root, restore, reporter, settings=settings, passwords=passwords)

    return make


def _join_quietly(threads: list[threading.Thread], deadline: float) -> None:
    """Joins threads until deadline, through further interrupts."""
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
            except KeyboardInterrupt:
                continue


def _running_copy(index: int, result: Any) -> RunningCopy:
    """The registry's row of a copy, from its RestoreResult (its `copy`: a CopyInfo)."""
    info = result.copy
    return RunningCopy(index, int(info.pid), int(info.init_pid), procfs.start_ticks(int(info.init_pid)),
                       int(info.pid_in_namespace), int(info.pidns_inode), info.netns, info.address)


class _Cloning:
    """The copies' sessions, driven phase by phase, all at once: prepare (nothing runs), restore
    (the copies run), finish. A failure in any phase aborts every session (a restored copy is
    ended: abort kills its tree) before the error goes up: no half clone."""

    def __init__(self, clone_id: str, checkpoint: str, request: CloneRequest, network: str,  # noqa: PLR0913
                 reporter: Reporter, make: SessionFactory):
        self.clone_id, self.checkpoint, self.request = clone_id, checkpoint, request
        self.network, self.reporter, self.make = network, reporter, make
        self.sessions: list[CopySession] = []

    def run(self) -> list[Any]:
        count = self.request.copies
        finished = False
        try:
            self.reporter.step(f"preparing {count} copies")
            # The first copy lays the images out once; the others share its files (hard links),
            # prepared at once: N copies of a large checkpoint do not write it N times.
            self._add(1, None)
            self._each("be prepared", lambda s: s.prepare())
            images = self.sessions[0].prepared_images()
            for index in range(2, count + 1):
                self._add(index, images)
            self._each("be prepared", lambda s: s.prepare(), start=1)
            self.reporter.step(f"restoring {count} copies")
            self._each("be restored", lambda s: s.restore())
            results = self._each("finish", lambda s: s.finish())
            finished = True
            return results
        finally:
            if not finished:
                self.end_all()

    def _add(self, index: int, images: Path | None) -> None:
        count = self.request.copies
        placement = CopyPlacement(clone_id=self.clone_id, index=index, count=count, network=self.network)
        told = PrefixedReporter(self.reporter, f"[copy {index}/{count}] ")
        self.sessions.append(self.make(placement, self.request, self.checkpoint, told, images))

    def _each(self, what: str, step: Callable[[CopySession], T], start: int = 0) -> list[T]:
        """step(session) for every copy from sessions[start] on, at once; the lowest-numbered
        failure raises CloneFailed once every step has ended (or PHASE_TIMEOUT passed)."""
        answers: dict[int, T] = {}
        failures: dict[int, BaseException] = {}

        def run(index: int, session: CopySession) -> None:
            try:
                answers[index] = step(session)
            except BaseException as exc:  # noqa: BLE001 (handed to the clone's thread)
                failures[index] = exc

        threads = [threading.Thread(target=run, args=(i, s), name=f"ckpt-copy-{i + 1}", daemon=True)
                   for i, s in enumerate(self.sessions) if i >= start]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + PHASE_TIMEOUT
        try:
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        except BaseException:
            # Interrupted (Ctrl-C): the copies' steps end first, so that the abort that follows
            # finds every copy they started (a copy's init is in a session of its own).
            _join_quietly(threads, deadline)
            raise
        late = [i + 1 + start for i, t in enumerate(threads) if t.is_alive()]
        if failures:
            raise _copy_failed(self.clone_id, min(failures) + 1, what, failures[min(failures)])
        if late:
            raise CloneFailed(f"clone {self.clone_id}: copy {late[0]} did not {what} within {PHASE_TIMEOUT:g} s",
                              hint="every copy was ended: no half clone runs")
        return [answers[i] for i in range(start, len(self.sessions))]

    def end_all(self) -> None:
        """Every session aborted and every copy ended, finished or not (a finished session's
        abort leaves its tree: a failed clone must leave none running); one whose end fails
        is told of, the others are ended all the same."""
        for index, session in enumerate(self.sessions, 1):
            try:
                session.abort()
                began = getattr(session, "began_init", None)
                if began is not None:
                    end_copy(*began)
            except Exception as exc:  # noqa: BLE001 (the others must be ended all the same)
                self.reporter.warn(f"copy {index} could not be ended cleanly: {exc}")


def _copy_failed(clone_id: str, index: int, what: str, exc: BaseException) -> BaseException:
    if isinstance(exc, CkptError):
        failed = CloneFailed(f"clone {clone_id}: copy {index} failed to {what}: {exc.message}",
                             hint=(exc.hint + "; " if exc.hint else "") + "every copy was ended: no half clone runs",
                             exit_code=int(exc.exit_code))
        failed.__cause__ = exc
        return failed
    return exc  # an interruption, or a bug: as it is


# ---- the registry ---------------------------------------------------------------------------


def write_registry(path: Path, clone_id: str, manifest: Manifest, copies: list[RunningCopy]) -> None:
    """<copies dir>/clone-<clone id>.json, owner-only, atomically (docs/design.md, "Clones")."""
    make_readable_dir(path.parent)
    record = {"format": REGISTRY_FORMAT, "clone": clone_id, "checkpoint": manifest.id, "name": manifest.name,
              "created": datetime.now(timezone.utc).isoformat(), "copies": [c.to_json() for c in copies]}
    atomic_write_bytes(path, json.dumps(record).encode() + b"\n", durable=False)  # tmpfs


def read_registries(directory: Path) -> list[dict]:
    """Every clone registry in directory that can be read (a stranger's or damaged file is
    skipped: only root writes in the directory (0755), and the files are written whole)."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not (name.startswith("clone-") and name.endswith(".json") and ids.is_id(name[6:-5])):
            continue
        try:
            record = json.loads((directory / name).read_bytes())
            copies = [RunningCopy.from_json(c) for c in record["copies"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if record.get("format") == REGISTRY_FORMAT and isinstance(record.get("checkpoint"), str):
            found.append({**record, "copies": copies})
    return found


def running_copies(directory: Path, checkpoint_id: str | None = None) -> dict[str, list[dict]]:
    """Per checkpoint (or of one), the copies of its clones that still run: `ckpt list` and
    `ckpt show` (docs/json.md, `running copy`)."""
    running: dict[str, list[dict]] = {}
    for record in read_registries(directory):
        if checkpoint_id is not None and record["checkpoint"] != checkpoint_id:
            continue
        for copy in record["copies"]:
            if copy.alive():
                row = {"clone": record["clone"], **copy.to_json()}
                running.setdefault(record["checkpoint"], []).append(row)
    return running
