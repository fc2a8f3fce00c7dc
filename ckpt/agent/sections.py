"""Critical sections: `with ckpt.no_checkpoint():` keeps every dump of the process out while
any thread of it (or of any process of the dumped tree) is inside one.

The two sides meet in SECTIONS_DIR (/run/ckpt/sections, mode 1777 like /tmp), through names
only, so that no descriptor is held across a freeze:

- a thread entering its outermost section creates a marker `<pid>.<tid>.<random>` holding the
  process's start time (a restored or reused PID has another), the boot id, and the section's
  owner (PID and start time): the process itself, or for `ckpt run`'s BEGIN the supervisor
  that holds the section on a client's behalf; then it looks for a flag
  `dumping.<P>` for its own PID and every ancestor's; if one exists (and its dumper lives), it
  removes its marker, sleeps 10 ms and tries again. Leaving the outermost section removes the
  marker; nested sections only count in memory, per thread.
- a dump of the tree rooted at R creates `dumping.<R>` (holding the dumper's PID and start time)
  first, then waits until no live marker of any PID of the tree remains (CKPT_SECTION_TIMEOUT,
  `ckpt dump --section-timeout`), then freezes; the flag goes once CRIU is done.

Either the thread sees the flag or the dumper sees the marker (both write, then read: Dekker's
argument), so no thread is inside a section at the freeze. A marker is void, and ignored (and
removed by the next dumper that sees it), when its process or its owner is gone: the PID gone
or now another process's (another start time), or written on another boot. A supervisor killed
with SIGKILL cannot remove the markers of its BEGINs: their owner ends them. Flags of a dumper
that died are ignored.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ckpt.system import procfs
from ckpt.system.files import write_all

SECTIONS_DIR = Path("/run/ckpt/sections")
FLAG_PREFIX = "dumping."
RETRY_S = 0.01
# A thread waits at most this long for a dump to finish before it enters its section anyway:
# a dumper's flag lasts from before its pre-flight to the end of CRIU's work, seconds at most;
# one that stays longer is stuck, and a program must not hang on it forever.
ENTER_WAIT_S = 600.0
# A marker is written right after it is created; one still empty after this long lost its
# writer between the two (killed), and counts for nothing.
EMPTY_MARKER_S = 5.0


def _start_ticks(pid: int) -> int | None:
    try:
        return procfs.start_ticks(pid)
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str:
    # Read at each use, not cached: a process restored on another boot carries the old one in
    # its memory.
    try:
        return procfs.boot_id()
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        return int(procfs.stat_fields(pid)[1])  # [1]: the parent's PID
    except (OSError, ValueError, IndexError):
        return None


def ensure_dir(directory: Path = SECTIONS_DIR) -> None:
    """Makes the directory, world-writable and sticky (any user's program may hold sections;
    none may remove another's markers)."""
    if directory.is_dir():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o1777)
    except FileExistsError:
        return
    os.chmod(directory, 0o1777)  # the umask took bits away


# ---- the program's side ---------------------------------------------------------------------

_local = threading.local()


def in_section() -> bool:
    """Whether the calling thread is inside no_checkpoint() (a checkpoint it asked for would wait
    for its own section)."""
    return getattr(_local, "depth", 0) > 0


def _live_flag(path: Path) -> bool:
    """Whether a dumping flag is a live dumper's: written by root (dumps need root; anyone may
    create names in the directory), holding a PID that still runs with that start time."""
    try:
        if path.lstat().st_uid != 0:
            return False
        words = path.read_text().split()
    except OSError:
        return False
    if not words:
        return True  # being written
    try:
        pid = int(words[0])
        started = int(words[1]) if len(words) > 1 else None
    except ValueError:
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and (started is None or ticks == started)


def dump_under_way(pid: int | None = None, directory: Path = SECTIONS_DIR) -> bool:
    """Whether a live dump flag names the process or one of its ancestors."""
    try:
        flags = {n[len(FLAG_PREFIX):] for n in os.listdir(directory) if n.startswith(FLAG_PREFIX)}
    except OSError:
        return False
    if not flags:
        return False
    current: int | None = os.getpid() if pid is None else pid
    for _ in range(4096):  # bounded: a PID chain cannot be longer than pid_max, nor loop
        if current is None or current <= 0:
            break
        if str(current) in flags and _live_flag(directory / f"{FLAG_PREFIX}{current}"):
            return True
        current = _parent(current) if current != 1 else None
    return False


def create_marker(pid: int, tid: int, directory: Path = SECTIONS_DIR, uid: int | None = None,
                  owner: int | None = None) -> Path:
    """A marker of a section of thread tid of process pid. Its content: pid's start time, the
    boot id, and the owner's PID and start time (owner: the process whose end ends the section;
    by default pid itself). Raises ProcessLookupError when another owner, or its pid, is gone."""
    ensure_dir(directory)
    ticks = _start_ticks(pid)
    if owner is None or owner == pid:
        # A start time this process cannot read (another PID namespace's /proc) makes an
        # empty marker, as one being written: its PID means nothing to a dumper there anyway.
        content = "" if ticks is None else f"{ticks} {_boot_id() or '-'} {pid} {ticks}"
    else:
        owner_ticks = _start_ticks(owner)
        if ticks is None or owner_ticks is None:
            raise ProcessLookupError(f"no process {pid if ticks is None else owner}")
        content = f"{ticks} {_boot_id() or '-'} {owner} {owner_ticks}"
    while True:
        path = directory / f"{pid}.{tid}.{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
        try:
            write_all(fd, f"{content}\n".encode())
            if uid is not None:
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
        return path


def try_enter(pid: int, tid: int, directory: Path = SECTIONS_DIR, uid: int | None = None,
              owner: int | None = None) -> Path | None:
    """One attempt at entering a section: the marker, or None if a dump of the process is under
    way (the marker is then removed again)."""
    marker = create_marker(pid, tid, directory, uid, owner)
    # The marker exists before the flags are read: a dumper that created its flag after this
    # read finds the marker and waits.
    if dump_under_way(pid, directory):
        marker.unlink(missing_ok=True)
        return None
    return marker


@contextmanager
def no_checkpoint(directory: Path = SECTIONS_DIR) -> Iterator[None]:
    """While the block runs, no dump freezes this process (nor its tree): a dump started from
    outside (`ckpt dump`, a schedule, `ckpt run`) waits until every thread has left its sections,
    up to its section timeout (CKPT_SECTION_TIMEOUT, 60 s), then fails or, for a schedule,
    records a skip. Entering waits while a dump of the process is already under way.

    Nests (per thread), works from any thread and any process of the tree; holds no descriptor
    (a marker file in /run/ckpt/sections exists while the outermost section runs).
    """
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        pid, tid = os.getpid(), threading.get_native_id()
        deadline = time.monotonic() + ENTER_WAIT_S
        marker = try_enter(pid, tid, directory)
        while marker is None and time.monotonic() < deadline:
            time.sleep(RETRY_S)
            marker = try_enter(pid, tid, directory)
        if marker is None:
            marker = create_marker(pid, tid, directory)  # a dumper stuck that long: go on anyway
        _local.marker = marker
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _local.marker.unlink(missing_ok=True)
            _local.marker = None


# ---- the dumper's side ----------------------------------------------------------------------

def _marker_is_live(path: Path, pid: int) -> bool | None:
    """Whether a marker counts: True while its process is the one that made it (same start time,
    same boot) and its owner too, and it was made by that process's user (or root, for `ckpt
    run`'s BEGIN on a client's behalf); None while it is being written (empty, and new); False
    when it is void for good."""
    try:
        st = path.lstat()
        owner_uid = os.stat(f"/proc/{pid}").st_uid
        text = path.read_text().split()
    except OSError:
        return False
    if st.st_uid not in (owner_uid, 0):
        return False
    if not text:
        return None if time.time() - st.st_mtime < EMPTY_MARKER_S else False
    try:
        ticks = int(text[0])
        boot = text[1] if len(text) > 1 else None
        owner, owner_ticks = (int(text[2]), int(text[3])) if len(text) > 3 else (pid, ticks)
    except ValueError:
        return False
    if _start_ticks(pid) != ticks:
        return False
    if boot not in (None, "-") and boot != _boot_id():
        return False
    return owner == pid or _start_ticks(owner) == owner_ticks


def open_sections(tree_pids: set[int], directory: Path = SECTIONS_DIR) -> list[int]:
    """The PIDs of the tree with a live marker (each once, in marker order); removes the void
    markers (their process or their owner gone: kill -9 of a program in its section, or of the
    `ckpt run` that held a BEGIN), the tree's or not: nobody else cleans them up."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found: list[int] = []
    for name in names:
        if name.startswith((FLAG_PREFIX, ".")):
            continue
        try:
            pid = int(name.split(".", 1)[0])
        except ValueError:
            continue
        if pid in found:
            continue
        path = directory / name
        live = _marker_is_live(path, pid)
        if live is False:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # not ours to remove (a dumper that is not root): it counts for nothing anyway
        elif pid in tree_pids:
            found.append(pid)  # live, or being written: its writer reads the flag next
    return found


class DumpGate:
    """The dumper's flag for one tree: raise() then wait(); release() when CRIU is done."""

    def __init__(self, root_pid: int, directory: Path = SECTIONS_DIR):
        self.root_pid = root_pid
        self.directory = directory
        self.path = directory / f"{FLAG_PREFIX}{root_pid}"
        self.raised = False

    def raise_flag(self) -> None:
        ensure_dir(self.directory)
        # Anything already at the name is no live dumper's (one dump of a PID at a time: the
        # target lock), or was put there by someone else (the directory is world-writable).
        self.path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, f"{os.getpid()} {_start_ticks(os.getpid())}\n".encode())
        finally:
            os.close(fd)
        self.raised = True

    def release(self) -> None:
        if self.raised:
            self.path.unlink(missing_ok=True)
            self.raised = False

    def wait(self, timeout: float, tree: Callable[[], set[int]],
             on_wait: Callable[[int], None] | None = None) -> int | None:
        """Waits until no process of the tree (asked afresh each time: it may fork) is in a
        section. Returns None, or the PID still in one when the timeout ran out. An empty tree
        (the root is gone) ends the wait: the pre-flight says so."""
        deadline = time.monotonic() + timeout
        told: set[int] = set()
        while True:
            try:
                names = [n for n in os.listdir(self.directory) if not n.startswith((FLAG_PREFIX, "."))]
            except OSError:
                names = []
            if not names:
                return None
            pids = tree()
            if not pids:
                return None
            inside = open_sections(pids, self.directory)
            if not inside:
                return None
            for pid in inside:
                if pid not in told and on_wait is not None:
                    on_wait(pid)
                told.add(pid)
            if time.monotonic() >= deadline:
                return inside[0]
            time.sleep(RETRY_S)


def tree_of(root_pid: int) -> set[int]:
    """The PIDs of the tree rooted at root_pid (empty when it is gone)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        return {root_pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.Error:
        return set()


@contextmanager
def dump_gate(root_pid: int, timeout: float, on_wait: Callable[[int], None] | None = None,
              directory: Path = SECTIONS_DIR) -> Iterator[DumpGate]:
    """Raises the dumping flag of the tree, waits for its sections to end, yields the gate (whose
    release() the dump calls once CRIU is done), and removes the flag at the end in any case.
    Raises SectionTimeout (nothing frozen) when a section outlasts the timeout."""
    from ckpt.errors import SectionTimeout

    gate = DumpGate(root_pid, directory)
    gate.raise_flag()
    try:
        stuck = gate.wait(timeout, lambda: tree_of(root_pid), on_wait)
        if stuck is not None:
            raise SectionTimeout(
                f"PID {stuck} stayed in a no_checkpoint() section for {timeout:g} s; nothing was frozen",
                hint="try again later, or give the section more time with --section-timeout "
                     "or CKPT_SECTION_TIMEOUT")
        yield gate
    finally:
        gate.release()
