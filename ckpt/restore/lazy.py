"""Lazy restore: the tree runs again before its memory is back.

A restore of a large tree spends most of its time writing a pages image that CRIU then reads
once. A lazy restore writes only the pages CRIU cannot take lazily (stacks, shared and file
mappings) and leaves the private anonymous memory as holes; CRIU recreates the tree with that
memory registered with userfaultfd, and a lazy-pages daemon fills it in (where the tree
touches it first, then the rest in the background) from the store's packs: ckpt's own, which
is the page server process this module starts (ckpt/restore/uffdlazy.py), or, with
CKPT_LAZY_FILL=0, CRIU's, asking that page server for pages. Every page is verified before
the tree is restored, as in a full restore.

The page server is a detached process: it outlives `ckpt restore`, holds the store's shared
lock (so no prune removes a pack it reads), and removes the staged images once the daemon is
done. While it runs, it leaves a record in /run/ckpt/lazy naming the tree's PIDs: a dump of
the tree waits for it, as CRIU would otherwise dump the pages not filled in yet as missing.
A watcher process beside it (ckpt/restore/lazywatch.py) makes sure that the tree never runs on memory
that a page server which ended early did not fill in.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ckpt.criu import lazypages
from ckpt.criu.binary import CriuBinary
from ckpt.criu.client import error_lines, has_feature
from ckpt.errors import CriuFailed, UsageError
from ckpt.restore.lazyplan import LazyPlan, needed_segments
from ckpt.restore.lazywatch import HANDOVER_TIMEOUT_S, Watcher, protect_from_oom
from ckpt.store import Store
from ckpt.store.blocks.blockstore import PAGE
from ckpt.store.staging import discard
from ckpt.system import procfs
from ckpt.system.detach import detach_stdio
from ckpt.system.textutil import human_bytes

if TYPE_CHECKING:
    from ckpt.restore.uffdlazy import LazyFiller
    from ckpt.store.blocks.prefetch import Prefetcher

READY_TIMEOUT_S = 30.0


def supported(binary: CriuBinary) -> bool:
    """Whether this kernel and CRIU can restore lazily (userfaultfd with fork/remap events)."""
    return has_feature(binary, "uffd-noncoop")


class _StorePages:
    """lazypages.PageSource over a LazyPlan: pages come out of the store's packs; those of a
    remote store are fetched ahead (BlockStore.page_sender) into spool_dir."""

    def __init__(self, store: Store, plan: LazyPlan, spool_dir: Path | None = None):
        self.plan = plan
        self.starts = {pid: [vaddr for vaddr, _, _ in runs] for pid, (_, runs) in plan.runs.items()}
        # (a local store's packs are mapped: nothing to fetch ahead, no order to work out)
        self.sender = store.blocks.page_sender(needed_segments(plan) if store.remote else (), spool_dir)
        self.served = 0
        self.last_page_at: float | None = None  # time.monotonic() of the plan's last page sent

    def _run(self, pid: int, vaddr: int) -> tuple[str, tuple[int, int, int]] | None:
        starts = self.starts.get(pid)
        if not starts:
            return None
        i = bisect.bisect_right(starts, vaddr) - 1
        image, runs = self.plan.runs[pid]
        if i < 0 or vaddr >= runs[i][0] + runs[i][1] * PAGE or vaddr % PAGE:
            return None
        return image, runs[i]

    def available(self, pid: int, vaddr: int, nr_pages: int) -> int:
        found = self._run(pid, vaddr)
        if found is None:
            return 0
        start, count, _ = found[1]
        return min(nr_pages, count - (vaddr - start) // PAGE)

    def send(self, pid: int, vaddr: int, nr_pages: int, out_fd: int) -> None:
        found = self._run(pid, vaddr)
        if found is None:  # serve() asks available() first
            raise LookupError(f"process {pid} has no lazy pages at {vaddr:#x}")
        image, (start, _, first) = found
        self.sender.send(self.plan.locations[image], first + (vaddr - start) // PAGE, nr_pages, out_fd)
        self.served += nr_pages
        if self.served >= self.plan.pages and self.last_page_at is None:
            self.last_page_at = time.monotonic()

    @property
    def prefetcher(self) -> Prefetcher | None:
        return self.sender.prefetcher

    def close(self, keep_copies_in: Store | None = None) -> None:
        """Ends the prefetch; with keep_copies_in (all served), first hands the spooled packs
        to that store's cache (Prefetcher.keep_in)."""
        prefetcher = self.sender.prefetcher
        if keep_copies_in is not None and prefetcher is not None and self.last_page_at is not None:
            prefetcher.keep_in(keep_copies_in.backend)
        self.sender.close()


@dataclass
class PageServer:
    """The parent's handle on a started page server, its daemon and its watcher."""

    pid: int
    group: int  # the process group of all three
    watcher_pid: int
    work_dir: Path
    log_path: Path
    records: Path  # CKPT_LAZY_DIR, where the server's record is
    watcher: socket.socket | None = None
    locked: int = -1  # where the server says it holds its own lock on the store (wait_locked)

    def wait_locked(self) -> None:
        """Before the tree runs (CRIU's post-restore notification: a failure here makes CRIU
        end the tree, which has not run) and before the restore lets go of its lock on the
        store: the server takes its own beside its start (an S3 store's costs it two requests
        and a new client, 0.3 s that the tree no longer waits for), and until it holds it, the
        restore's keeps every pack it reads from a prune. Once it has said so, returns at once."""
        fd, self.locked = self.locked, -1
        if fd < 0:
            return
        try:
            answer = os.read(fd, 512) if select.select([fd], [], [], READY_TIMEOUT_S + 5)[0] else b""
        finally:
            os.close(fd)
        if answer != b"L":
            cause = answer[1:].decode(errors="replace").strip() if answer else "it did not answer"
            raise CriuFailed(f"the lazy restore's page server could not lock the store: {cause}",
                             log_path=str(self.log_path), hint="try again; restore with --eager if it persists")

    def hand_over(self, processes: int) -> None:
        """Called once CRIU has restored the tree, before it runs: the watcher takes a copy of
        the tree's userfaultfds (processes: how many of the tree's processes have lazy memory)."""
        try:
            if self.watcher is None:
                raise OSError("its connection was closed")
            self.watcher.sendall(b"G%d\n" % processes)
            self.watcher.settimeout(HANDOVER_TIMEOUT_S + 5)
            answer = self.watcher.recv(512)
        except OSError as exc:
            answer = b"E" + str(exc).encode()
        if answer != b"K\n":
            cause = answer[1:].decode(errors="replace").strip() if answer else "the watcher ended"
            raise CriuFailed(f"the lazy restore's watcher could not take hold of the tree's memory: {cause}",
                             log_path=str(self.log_path),
                             hint="restore with --eager (a full restore needs no page server)")

    def release(self) -> None:
        """The restore is done: the watcher goes on alone."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None

    def stop(self) -> None:
        """Ends the server, its daemon and its watcher (the restore failed); the caller removes
        the images."""
        self.release()
        if self.locked >= 0:
            os.close(self.locked)
            self.locked = -1
        try:
            os.killpg(self.group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        (self.records / f"{self.pid}.json").unlink(missing_ok=True)
        (self.work_dir / "lazy-pages.socket").unlink(missing_ok=True)
        # A server killed leaves its spool of fetched segments (up to the tree's memory): nobody else removes it.
        shutil.rmtree(self.work_dir / SPOOL_DIR, ignore_errors=True)


def lazy_processes(plan: LazyPlan) -> int:
    """How many of the tree's processes have memory restored lazily (each has a userfaultfd)."""
    return sum(1 for _, runs in plan.runs.values() if any(nr_pages for _, nr_pages, _ in runs))


def start_page_server(store: Store, checkpoint_id: str, binary: CriuBinary, images_dir: Path, work_dir: Path,
                      plan: LazyPlan, tree_pids: list[int], log_level: int) -> PageServer:
    """Starts the detached page server and its lazy-pages daemon (ckpt's own, in the server's
    process; CKPT_LAZY_FILL=0: CRIU's, asking the server for pages over a TCP connection);
    returns once the daemon listens on work_dir/lazy-pages.socket, where the restoring CRIU
    finds it."""
    ours, theirs = (None, None) if store.settings.lazy_fill else _connected_pair()
    ready_read, ready_write = os.pipe()
    locked_read, locked_write = os.pipe()
    control, control_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log_path = work_dir / "lazy-pages.log"
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked server, reported through the pipe
        code = 1
        try:
            os.close(ready_read)
            os.close(locked_read)
            control.close()
            code = _spawn(store, checkpoint_id, binary, images_dir, work_dir, plan, tree_pids, log_level,
                          ours.detach() if ours else -1, theirs.detach() if theirs else -1, ready_write,
                          control_theirs.detach(), locked_write)
        finally:
            os._exit(code)
    for end in (ours, theirs):
        if end is not None:
            end.close()
    control_theirs.close()
    os.close(ready_write)
    os.close(locked_write)
    os.waitpid(child, 0)  # the first child only forks the server and the watcher, and leaves
    try:
        server_pid, watcher_pid, ready = _read_ready(ready_read)
    except BaseException:
        os.close(locked_read)
        raise
    finally:
        os.close(ready_read)
    server = PageServer(server_pid, child, watcher_pid, work_dir, log_path, store.settings.lazy_dir, control,
                        locked_read)
    if not ready:
        server.stop()
        lines = error_lines(log_path)
        raise CriuFailed(f"the lazy-pages daemon did not start: {lines[-1] if lines else 'no error in its log'}",
                         log_path=str(log_path), log_lines=lines,
                         hint="restore with --eager (a full restore needs no daemon)")
    return server


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection. CRIU's page server protocol is TCP's: over a UNIX
    socket the daemon logs a warning for each request (TCP_NODELAY) and cannot cork. The
    listener lives for one accept, and the connection accepted must be the one made here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        theirs = socket.create_connection(listener.getsockname())
        while True:
            ours, peer = listener.accept()
            if peer == theirs.getsockname():
                # Each answer is a header then pages: without NODELAY the header waits for an ACK.
                ours.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return ours, theirs
            ours.close()  # another local program raced to connect: not ours


def _read_ready(fd: int) -> tuple[int, int, bool]:
    """The first child writes the server's and the watcher's PIDs (4 bytes each), then the
    daemon writes one byte once it listens. End of file before that byte: the daemon failed."""
    data = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(data) < 9:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        chunk = os.read(fd, 9 - len(data))
        if not chunk:
            break
        data += chunk
    pid, watcher = struct.unpack("=ii", data[:8]) if len(data) >= 8 else (0, 0)
    if pid == 0:
        raise CriuFailed("the lazy restore's page server did not start",
                         hint="restore with --eager (a full restore needs no page server)")
    return pid, watcher, len(data) == 9


def _detach_stdio(keep: set[int]) -> None:  # pragma: no cover - runs in the forked server and watcher
    detach_stdio(keep)
    # Ending the server, its daemon or the watcher early would end the tree: a Ctrl-C meant
    # for `ckpt restore`, a hang-up or a stray SIGTERM must not. The daemon inherits this
    # (ignored signals survive exec), and the OOM protection. The server ends by itself in seconds.
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)


def _spawn(store: Store, checkpoint_id: str, binary: CriuBinary, images_dir: Path, work_dir: Path,  # noqa: PLR0913
           plan: LazyPlan, tree_pids: list[int], log_level: int, ours_fd: int, theirs_fd: int,
           ready_write: int, control_fd: int, locked_write: int) -> int:  # pragma: no cover - in the first child
    """Forks the server and its watcher, in a session of their own, reparented to init once
    this first child exits; the server tells the watcher over a pipe the daemon's PID, then
    whether the daemon was done ("D") or failed ("F...")."""
    os.setsid()
    status_read, status_write = os.pipe()
    server = os.fork()
    if server == 0:
        code = 1
        try:
            os.close(status_read)
            os.close(control_fd)
            code = _server_main(store, checkpoint_id, binary, images_dir, work_dir, plan, tree_pids, log_level,
                                ours_fd, theirs_fd, ready_write, status_write, locked_write)
        finally:
            os._exit(code)
    os.close(status_write)
    os.close(locked_write)
    for fd in (ours_fd, theirs_fd):
        if fd >= 0:
            os.close(fd)
    watcher = os.fork()
    if watcher == 0:
        code = 1
        try:
            _detach_stdio({status_read, control_fd})
            protect_from_oom()
            code = Watcher(status_read, control_fd, checkpoint_id, tree_pids, server, work_dir).run()
        finally:
            os._exit(code)
    os.write(ready_write, struct.pack("=ii", server, watcher))
    return 0


def _server_main(store: Store, checkpoint_id: str, binary: CriuBinary, images_dir: Path, work_dir: Path,  # noqa: PLR0913
                 plan: LazyPlan, tree_pids: list[int], log_level: int, ours_fd: int, theirs_fd: int,
                 ready_write: int, status_fd: int, locked_write: int) -> int:  # pragma: no cover - in the server
    _detach_stdio({ours_fd, theirs_fd, ready_write, status_fd, locked_write} - {-1})
    oom_refused = protect_from_oom()
    records = store.settings.lazy_dir  # tmpfs by default: forgotten at reboot, as the servers are
    record = _Record(records / f"{os.getpid()}.json",
                     {"server_pid": os.getpid(), "server_start": procfs.start_ticks(os.getpid()),
                      "pidns": _pid_namespace(), "checkpoint": checkpoint_id, "pids": tree_pids,
                      "store": str(store.root)})
    records.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Beside the start (see PageServer.wait_locked); the record is written once the lock is held.
    lock = _ServerLock(store, locked_write, record.write)
    try:
        figures = _Figures(plan, time.monotonic())
        if ours_fd < 0:
            how = _fill_lazily(store, plan, work_dir, ready_write, status_fd, record, figures)
        else:
            how = _serve_criu_daemon(store, binary, images_dir, work_dir, plan, log_level,
                                     (ours_fd, theirs_fd, ready_write, status_fd), record, figures)
        _write_final(work_dir, store, figures, how, oom_refused)
    finally:
        record.stop()
        lock.release()  # (its thread may still write the record: removed after it)
        record.path.unlink(missing_ok=True)
        discard(images_dir)
    return 0


class _ServerLock:  # pragma: no cover - runs in the forked server
    """The server's own shared lock on the store, taken by a thread while the server starts;
    once it holds it, on_locked() (the server's record: what a dump of the tree waits for), then
    it tells `ckpt restore` over the pipe that it does ("L"), or why not ("E...")."""

    def __init__(self, store: Store, tell_fd: int, on_locked: Callable[[], None]):
        self._held = contextlib.ExitStack()
        self._thread = threading.Thread(target=self._take, args=(store, tell_fd, on_locked),
                                        name="ckpt-server-lock", daemon=True)
        self._thread.start()

    def _take(self, store: Store, tell_fd: int, on_locked: Callable[[], None]) -> None:
        try:
            self._held.enter_context(store.lock(exclusive=False, timeout=READY_TIMEOUT_S))
            on_locked()
            message = b"L"
        except Exception as exc:  # noqa: BLE001 - told to `ckpt restore`, which fails the restore
            message = b"E" + str(exc).encode()[:400].replace(b"\n", b" ")
        try:
            os.write(tell_fd, message)
        except OSError:
            pass  # `ckpt restore` is gone: it has let go of the tree
        finally:
            os.close(tell_fd)

    def release(self) -> None:
        self._thread.join()
        self._held.close()


def _fill_lazily(store: Store, plan: LazyPlan, work_dir: Path, ready_write: int, status_fd: int,  # noqa: PLR0913
                 record: _Record, figures: _Figures) -> str:  # pragma: no cover - runs in the forked server
    """ckpt's own lazy-pages daemon (ckpt/restore/uffdlazy.py), in this process: the watcher
    is told this PID as the daemon's. Returns the log line's account of the copies."""
    from ckpt.restore.uffdlazy import LazyFiller  # deferred: numpy, which a dump importing this does not need

    try:
        filler = LazyFiller(store, plan, work_dir, work_dir / SPOOL_DIR)
    except Exception as exc:  # what `ckpt restore` then tells (it reads this log)
        _write_private(work_dir / "lazy-pages.log", f"Error: {exc}\n")
        raise
    try:
        os.write(ready_write, b"\0")  # listening: the restoring CRIU may connect
        os.close(ready_write)
        _tell(status_fd, b"P%d" % os.getpid())
        figures.pages = filler
        record.follow(figures)
        _run_and_tell(lambda: _prepared_then_run(filler, work_dir), status_fd, record, figures)
    finally:
        filler.close()  # after a success, keeps the packs fetched ahead in the cache
    return (f"{filler.served} pages copied of {plan.pages} in {filler.copies} copies "
            f"({filler.faults} faults, {filler.forks} forks followed)")


def _prepared_then_run(filler, work_dir: Path) -> None:  # pragma: no cover - runs in the forked server
    """filler.prepare(), its failure written where `ckpt restore` looks for the daemon's error
    (it said it listened already: CRIU is restoring), then filler.run()."""
    try:
        filler.prepare()
    except Exception as exc:
        _write_private(work_dir / "lazy-pages.log", f"Error: {exc}\n")
        raise
    filler.run()


def _serve_criu_daemon(store: Store, binary: CriuBinary, images_dir: Path, work_dir: Path,  # noqa: PLR0913
                       plan: LazyPlan, log_level: int, fds: tuple[int, int, int, int], record: _Record,
                       figures: _Figures) -> str:  # pragma: no cover - runs in the forked server
    """CRIU's lazy-pages daemon (CKPT_LAZY_FILL=0), asking this page server for the pages."""
    ours_fd, theirs_fd, ready_write, status_fd = fds
    daemon = lazypages.start_daemon(binary, images_dir, work_dir, theirs_fd, ready_write,
                                    "lazy-pages.log", log_level)
    os.close(theirs_fd)
    os.close(ready_write)
    _tell(status_fd, b"P%d" % daemon.pid)
    sock = socket.socket(fileno=ours_fd)
    served = requests = 0
    started: list[_StorePages] = []

    def serve() -> None:
        nonlocal served, requests
        pages = _StorePages(store, plan, work_dir / SPOOL_DIR)
        started.append(pages)
        figures.pages = pages
        record.follow(figures)
        served, requests = lazypages.serve(sock, pages)

    try:
        _run_and_tell(serve, status_fd, record, figures)
    finally:
        sock.close()
        for pages in started:  # the prefetch's threads and spool files
            pages.close(keep_copies_in=store if figures.status == "done" else None)
    daemon.wait()
    (work_dir / "lazy-pages.socket").unlink(missing_ok=True)
    return f"{served} pages served of {plan.pages} in {requests} requests (daemon exit code {daemon.returncode})"


def _run_and_tell(serve, status_fd: int, record: _Record, figures: _Figures) -> None:  # pragma: no cover
    """Runs serve() and tells the watcher how it went: done ("D": every page is in, it lets the
    tree go) or failed ("F...": it kills the tree)."""
    try:
        serve()
        figures.status = "done"
        _tell(status_fd, b"D")
    except Exception as exc:  # noqa: BLE001 - any failure is logged: nobody else would see it
        figures.status = f"failed: {exc}"
        _tell(status_fd, b"F" + str(exc).encode()[:400].replace(b"\n", b" "))
    finally:
        record.stop()
    if figures.status == "done":  # every page is in: neither a dump of the tree nor
        try:  # `restore --wait` waits for the packs kept in the cache after this
            record.write(figures)
        except OSError:
            record.path.unlink(missing_ok=True)


def _write_final(work_dir: Path, store: Store, figures: _Figures, how: str,
                 oom_refused: str | None) -> None:  # pragma: no cover - in the server
    """The final figures (page-server-stats.json) and the line of page-server.log."""
    final = figures.to_json(final=True)
    _write_private(work_dir / STATS_FILE, json.dumps(final) + "\n")
    with open(os.open(work_dir / "page-server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "w") as log:
        read_again = store.backend.copies_read_again()
        fetched = (f"; {human_bytes(final['bytes_fetched'])} fetched ahead from the store in "
                   f"{final['store_requests']} requests" if final["store_requests"] else "")
        log.write(f"{figures.status}; {how} in {time.monotonic() - figures.began:.2f} s" + fetched
                  + (f"; {len(read_again)} damaged cache copies read again from the store (intact)"
                     if read_again else "")
                  + (f"; not protected from the OOM killer ({oom_refused})" if oom_refused else "") + "\n")


SPOOL_DIR = "spool"  # in the work directory: the prefetched segments, removed when the server ends
STATS_FILE = "page-server-stats.json"  # in the work directory: the final figures
STATS_EVERY_S = 0.25  # the record's figures are rewritten this often at most


class _Figures:
    """What the page server tells about its progress (see page_server_stats)."""

    def __init__(self, plan: LazyPlan, began: float):
        self.plan, self.began = plan, began
        self.began_at = time.time()
        self.pages: _StorePages | LazyFiller | None = None
        self.status = "serving"

    def to_json(self, final: bool = False) -> dict:
        pages = self.pages
        prefetcher = pages.prefetcher if pages is not None else None
        fetch = prefetcher.stats if prefetcher is not None else None
        last = pages.last_page_at if pages is not None else None
        figures = {
            "status": self.status,
            "pages_total": self.plan.pages,
            "pages_served": pages.served if pages is not None else 0,
            "bytes_fetched": fetch.bytes if fetch is not None else 0,
            "store_requests": fetch.requests if fetch is not None else 0,
            "started_at": self.began_at,
            "last_page_s": None if last is None else round(last - self.began, 3),
            "all_fetched_s": None if fetch is None or fetch.all_down_at is None
            else round(fetch.all_down_at - self.began, 3),
        }
        if final:
            figures["fetches"] = [list(f) for f in fetch.fetches] if fetch is not None else []
        return figures


class _Record:
    """The server's record in CKPT_LAZY_DIR (what a dump of the tree waits for), with its live
    figures rewritten by a thread every STATS_EVERY_S, each time whole (written aside, renamed)."""

    def __init__(self, path: Path, fields: dict):
        self.path, self.fields = path, fields
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written = threading.Event()  # the first write is the server's (see _ServerLock)
        self._writing = threading.Lock()  # that thread's and follow's: one file aside

    def write(self, figures: _Figures | None = None) -> None:
        content = dict(self.fields)
        if figures is not None:
            content["stats"] = figures.to_json()
        aside = self.path.with_name(f".{self.path.name}.tmp")
        with self._writing:
            _write_private(aside, json.dumps(content))
            os.replace(aside, self.path)
        self._written.set()

    def follow(self, figures: _Figures) -> None:
        def loop() -> None:
            while not self._stop.wait(STATS_EVERY_S):
                if not self._written.is_set():
                    continue  # not before the server holds its lock on the store
                try:
                    self.write(figures)
                except (OSError, RuntimeError):
                    pass  # figures are best effort
        self._thread = threading.Thread(target=loop, name="ckpt-lazy-record", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _write_private(path: Path, text: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(text)


def page_server_stats(server_pid: int, work_dir: Path, records: Path) -> dict | None:
    """A lazy restore's page server's figures, given its PID, its work directory and
    CKPT_LAZY_DIR (PageServer.pid, .work_dir, .records): the final ones once it ended
    (work_dir/page-server-stats.json, with "fetches": [pack, offset, length, segments] of each
    request to the store), else the live ones of its record (rewritten 4 times a second), else
    None (not started yet, or ended without figures). Keys: status ("serving", "done",
    "failed: ..."), pages_total, pages_served, bytes_fetched and store_requests (what the
    prefetch of a remote store's segments downloaded, in how many requests), started_at
    (epoch seconds when it began serving), last_page_s and all_fetched_s (seconds after
    started_at when the last page was sent and the last segment was down; None until then)."""
    try:
        return json.loads((work_dir / STATS_FILE).read_text())
    except (OSError, ValueError):
        pass
    try:
        record = json.loads((records / f"{server_pid}.json").read_text())
    except (OSError, ValueError):
        return None
    stats = record.get("stats")
    return stats if isinstance(stats, dict) else None


def _tell(fd: int, message: bytes) -> None:  # pragma: no cover - runs in the forked server
    try:
        os.write(fd, message + b"\n")
    except OSError:
        pass  # the watcher is gone: nobody to tell


def wait_for_lazy_restores(pids: set[int], on_wait, records: Path, timeout: float = 600.0) -> None:
    """Waits until no page server is still filling in memory of these processes: a dump taken
    before would miss the pages not there yet."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        busy = [r for r in _live_records(records) if pids & set(r.get("pids", []))
                and (r.get("stats") or {}).get("status") != "done"]  # done: only keeping copies
        if not busy:
            return
        if not told:
            on_wait(busy[0])
            told = True
        if time.monotonic() > deadline:
            raise UsageError(f"the memory of process {sorted(pids & set(busy[0]['pids']))[0]} is still being "
                             f"restored lazily (page server {busy[0]['server_pid']})",
                             hint="try the dump again once it is done")
        time.sleep(0.1)


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _live_records(directory: Path) -> list[dict]:
    """The records (CKPT_LAZY_DIR) of the page servers still running in this PID namespace
    (one of another names PIDs of its own). A record whose server is gone is removed: its PID
    may be another process's by now (a record whose server was killed in a PID namespace of
    its own named PID 10, a kernel thread's here, and every later dump of one of its tree's
    PIDs waited 600 s for it), so the server's start time must match too."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    live, here = [], _pid_namespace()
    for name in names:
        if name.startswith("."):
            continue  # a record being rewritten
        path = directory / name
        try:
            record = json.loads(path.read_text())
            if record.get("pidns", here) != here:
                continue
            if not _server_alive(int(record["server_pid"]), record.get("server_start")):
                path.unlink(missing_ok=True)  # its server was killed
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        live.append(record)
    return live


def _server_alive(pid: int, start: int | None) -> bool:
    if start is not None:
        return procfs.is_running(pid, int(start))
    try:  # a record of an older ckpt: no start time; a kernel thread has no command line
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False
