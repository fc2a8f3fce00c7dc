"""Reading CRIU image files with pycriu's image reader."""

from __future__ import annotations

import bisect
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ckpt.errors import ImageUnreadable
from ckpt.system.files import replace_staged


def warm_up() -> None:
    """Imports pycriu's image reader now (0.1-0.3 s), for a caller that will read images at a
    moment when time counts (a migration's destination, while the source is frozen)."""
    from pycriu import images  # noqa: F401


def load_image(path: Path) -> dict:
    """A CRIU image file decoded by pycriu: {"magic": ..., "entries": [...]}. Raises
    ImageUnreadable when it is truncated or unreadable."""
    from pycriu import images  # deferred: importing pycriu costs ~0.1 s

    with open(path, "rb") as f:
        try:
            return images.load(f)
        except Exception as exc:  # pycriu raises struct.error, its MagicException, even a bare Exception
            raise ImageUnreadable(f"CRIU's image {path.name} is truncated or unreadable ({type(exc).__name__}: "
                                  f"{exc})", hint="if the disk holding it is full, free some space and try again"
                                  ) from exc


def dump_stats(image_dir: Path) -> dict:
    """Figures from CRIU's stats-dump image: frozen time (ms), pages scanned and written.

    Empty if the file cannot be read: CRIU writes it into the store's log directory and does
    not fail when it cannot (a full disk leaves it empty); figures are not worth failing a
    dump for, and the dump's own writes then report the full disk."""
    path = image_dir / "stats-dump"
    if not path.exists():
        return {}
    try:
        entry = load_image(path)["entries"][0].get("dump", {})
    except (ImageUnreadable, IndexError):
        return {}
    return {
        "frozen_ms": round(int(entry.get("frozen_time", 0)) / 1000, 1),
        "freezing_ms": round(int(entry.get("freezing_time", 0)) / 1000, 1),
        "pages_scanned": int(entry.get("pages_scanned", 0)),
        "pages_written": int(entry.get("pages_written", 0)),
    }


def process_tree(image_dir: Path) -> list[dict]:
    """pstree.img as plain dicts: pid, ppid, pgid, sid, threads, comm."""
    result = []
    for item in load_image(image_dir / "pstree.img")["entries"]:
        pid = int(item["pid"])
        comm = "?"
        core_path = image_dir / f"core-{pid}.img"
        if core_path.exists():
            comm = _core_comm(core_path)
        result.append({
            "pid": pid, "ppid": int(item.get("ppid", 0)), "pgid": int(item.get("pgid", 0)),
            "sid": int(item.get("sid", 0)), "threads": [int(t) for t in item.get("threads", [pid])],
            "comm": comm,
        })
    return result


def _first_entry(path: Path, kind: str, message_type: str):
    """The first entry of a CRIU image of that kind (its magic's name, e.g. "CORE"), parsed
    with protobuf alone into pycriu's message_type (e.g. "core_entry"). load_image turns a
    whole entry into dicts (registers, signal masks, every mapping's fields): 4-12 ms a
    process, seconds for a tree of 100 processes. Raises ImageUnreadable as load_image does."""
    from pycriu.images import magic, pb  # deferred: importing pycriu costs ~0.1 s

    with open(path, "rb") as f:
        try:
            found, = struct.unpack("i", f.read(4))
            if found in (magic.by_name["IMG_COMMON"], magic.by_name["IMG_SERVICE"]):  # images v1.1
                found, = struct.unpack("i", f.read(4))
            if magic.by_val.get(found) != kind:
                raise ValueError(f"magic {found:#x} is not {kind}'s")
            size, = struct.unpack("i", f.read(4))
            message = getattr(pb, message_type)()
            message.ParseFromString(f.read(size))
        except Exception as exc:  # as load_image: pycriu and protobuf raise many kinds
            raise ImageUnreadable(f"CRIU's image {path.name} is truncated or unreadable ({type(exc).__name__}: "
                                  f"{exc})", hint="if the disk holding it is full, free some space and try again"
                                  ) from exc
    return message


def _core_comm(path: Path) -> str:
    """The command name in a core-PID.img (4 ms a process through load_image: 0.4 s of a
    100-process tree's dump, while the tree is frozen with --stop)."""
    core = _first_entry(path, "CORE", "core_entry")
    return core.tc.comm if core.HasField("tc") and core.tc.comm else "?"


def _vmas(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, madv) of every mapping in an mm-PID.img, sorted."""
    return sorted((vma.start, vma.end, vma.madv) for vma in _first_entry(path, "MM", "mm_entry").vmas)


def _addr(value) -> str:
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], int):
            import socket
            import struct
            return socket.inet_ntoa(struct.pack("<I", value[0]))
        return ":".join(str(v) for v in value)
    return str(value)


def _describe_file(entry: dict) -> dict:
    kind = entry.get("type", "?")
    if "reg" in entry:
        reg = entry["reg"]
        return {"type": "file", "path": reg.get("name"), "offset": int(reg.get("pos", 0)),
                "flags": int(reg.get("flags", 0))}
    if "isk" in entry:
        sk = entry["isk"]
        proto = {6: "tcp", 17: "udp"}.get(int(sk.get("proto", 0)), str(sk.get("proto")))
        states = {1: "ESTABLISHED", 7: "CLOSE", 10: "LISTEN"}
        return {"type": proto, "local": f"{_addr(sk.get('src_addr', []))}:{sk.get('src_port')}",
                "remote": f"{_addr(sk.get('dst_addr', []))}:{sk.get('dst_port')}",
                "state": states.get(int(sk.get("state", 0)), str(sk.get("state")))}
    if "usk" in entry:
        sk = entry["usk"]
        name = sk.get("name") or ""
        return {"type": "unix", "path": name if isinstance(name, str) else repr(name),
                "peer": int(sk.get("peer", 0))}
    if "pipe" in entry:
        return {"type": "pipe", "pipe_id": int(entry["pipe"].get("pipe_id", 0))}
    return {"type": str(kind).lower()}


def describe(image_dir: Path, manifest_processes: list[dict]) -> list[dict]:
    """Per process: threads, memory mappings and pages, open files with offsets, sockets."""
    files_by_id = {}
    if (image_dir / "files.img").exists():
        for entry in load_image(image_dir / "files.img")["entries"]:
            files_by_id[int(entry["id"])] = _describe_file(entry)
    result = []
    for proc in manifest_processes:
        pid = int(proc["pid"])
        info = {"pid": pid, "ppid": proc.get("ppid"), "command": proc.get("command", proc.get("comm")),
                "threads": proc.get("threads", [pid]), "mappings": 0, "mapped_bytes": 0, "pages": 0, "fds": []}
        mm_path = image_dir / f"mm-{pid}.img"
        if mm_path.exists():
            vmas = load_image(mm_path)["entries"][0].get("vmas", [])
            info["mappings"] = len(vmas)
            info["mapped_bytes"] = sum(int(v["end"]) - int(v["start"]) for v in vmas)
        pm_path = image_dir / f"pagemap-{pid}.img"
        if pm_path.exists():
            info["pages"] = sum(int(e.get("nr_pages", 0)) for e in load_image(pm_path)["entries"][1:])
        ids_path = image_dir / f"ids-{pid}.img"
        files_id = None
        if ids_path.exists():
            files_id = load_image(ids_path)["entries"][0].get("files_id")
        fdinfo = image_dir / f"fdinfo-{files_id}.img"
        if files_id is not None and fdinfo.exists():
            for fd in load_image(fdinfo)["entries"]:
                desc = dict(files_by_id.get(int(fd["id"]), {"type": str(fd.get("type", "?")).lower()}))
                desc["fd"] = int(fd["fd"])
                info["fds"].append(desc)
            info["fds"].sort(key=lambda d: d["fd"])
        result.append(info)
    return result


@dataclass(frozen=True)
class OpenedFile:
    """A file the tree had open or mapped by path (CRIU's reg-file in files.img): what CRIU
    checks on restore before it opens the file again (criu/files-reg.c, validate_file)."""

    path: str
    mode: int | None  # st_mode at the dump: CRIU refuses another (type and permission bits)
    size: int | None  # None where CRIU does not check it: not a regular file, or opened write-only with O_APPEND
    # An ELF file's build id as CRIU recorded it: uint32 words copied from bytes in the dumping
    # host's order (same architecture as this one, or the restore is refused anyway), zero-padded.
    build_id: bytes | None
    id: int = 0  # the reg-file's id in files.img
    flags: int = os.O_RDONLY  # the open flags (a mapping's are O_RDONLY: CRIU sets them when it maps)
    offset: int = 0  # the file position at the dump, where a restored descriptor goes on

    @property
    def write_only(self) -> bool:
        return self.flags & os.O_ACCMODE == os.O_WRONLY


def opened_files(image_dir: Path) -> list[OpenedFile]:
    """The files of the tree that a restore opens again by path: open descriptors, mapped
    executables and libraries, working and root directories. Left out: deleted files CRIU
    carries itself (ghost files and other remaps, remap-fpath.img), terminals, and files named
    to CRIU as external (their descriptors are given to it)."""
    files_path = image_dir / "files.img"
    if not files_path.exists():
        return []
    skipped: set[int] = set()
    remap_path = image_dir / "remap-fpath.img"
    if remap_path.exists():
        skipped = {int(e["orig_id"]) for e in load_image(remap_path)["entries"]}
    entries = load_image(files_path)["entries"]
    # A terminal's path is recorded as a reg-file too (the TTY entry's regf_id), but CRIU does not
    # reopen it by that path: a pty comes back as a new pair, a --shell-job terminal is the restorer's.
    skipped |= {int(e["tty"]["regf_id"]) for e in entries if "regf_id" in e.get("tty", {})}
    from pycriu.images import pb2dict  # deferred: importing pycriu costs ~0.1 s

    found = []
    for entry in entries:
        reg = entry.get("reg")
        if reg is None or int(reg.get("id", entry.get("id", 0))) in skipped or reg.get("ext"):
            continue
        words = reg.get("build_id") or []
        flags = reg.get("flags", 0)  # pycriu writes them as "O_WRONLY | O_APPEND | 0x..."
        found.append(OpenedFile(
            path=str(reg["name"]), mode=int(reg["mode"]) if "mode" in reg else None,
            size=int(reg["size"]) if "size" in reg else None,
            build_id=struct.pack(f"={len(words)}I", *(int(w) for w in words)) if words else None,
            id=int(reg.get("id", entry.get("id", 0))),
            flags=pb2dict.unmap_flags(flags, pb2dict.rfile_flags_map) if isinstance(flags, str) else int(flags),
            offset=_number(reg.get("pos", 0))))
    return found


def drop_size_checks(image_dir: Path, ids: set[int]) -> None:
    """Rewrites the staged files.img (atomically: the staged file may be a hard link to a
    stored object) without the recorded size of the reg-files with those ids, so that CRIU
    reopens them whatever their size (criu/files-reg.c, validate_file: it compares only a
    recorded size, and has no option to skip that). Every other message is kept byte for byte."""
    def drop(entry) -> bool:
        if entry.HasField("reg") and entry.reg.id in ids and entry.reg.HasField("size"):
            entry.reg.ClearField("size")
            return True
        return False

    _rewrite_files_image(image_dir, drop)


def _rewrite_files_image(image_dir: Path, change) -> None:
    """Rewrites the staged files.img atomically (the staged file may be a hard link to a stored
    object: the store's copy must not change), each entry through change(entry), which edits it
    in place and says whether it did; every entry it leaves alone is kept byte for byte."""
    from pycriu.images import magic, pb  # deferred: importing pycriu costs ~0.1 s

    path = image_dir / "files.img"
    try:
        head, messages = _split(path.read_bytes(), path.name, "FILES", magic)
    except ValueError as exc:
        raise ImageUnreadable(f"CRIU's image {exc}") from exc
    entry = pb.file_entry()
    parts = [head]
    for message in messages:
        entry.Clear()
        entry.ParseFromString(message)
        kept = entry.SerializeToString() if change(entry) else message
        parts.append(struct.pack("<i", len(kept)) + kept)
    replace_staged(path, b"".join(parts))


def _split(data: bytes, name: str, kind: str, magic) -> tuple[bytes, list[bytes]]:
    """An image's magics (a common/service magic, then that of `kind`, pycriu's name) and its
    size-prefixed messages, as pycriu's image reader reads them. Raises ValueError."""
    try:
        (found,) = struct.unpack_from("<i", data, 0)
        pos = 4
        if found in (magic.by_name["IMG_COMMON"], magic.by_name["IMG_SERVICE"]):
            (found,) = struct.unpack_from("<i", data, pos)
            pos += 4
        if found != magic.by_name[kind]:
            raise ValueError(f"{name} is not a {kind.lower()} image")
        head, messages = data[:pos], []
        while pos < len(data):
            (size,) = struct.unpack_from("<i", data, pos)
            if size < 0 or pos + 4 + size > len(data):
                raise ValueError(f"{name} is truncated")
            messages.append(data[pos + 4:pos + 4 + size])
            pos += 4 + size
    except struct.error as exc:
        raise ValueError(f"{name} is truncated") from exc
    return head, messages


# pagemap entry flags (CRIU's images/pagemap.proto): the one copy ckpt uses
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4


# VmaEntry.status and .flags bits (criu/include/image.h) that decide whether CRIU can take a
# mapping's pages from a parent images directory.
VMA_AREA_REGULAR, VMA_FILE_PRIVATE, VMA_ANON_PRIVATE = 1 << 0, 1 << 6, 1 << 9
VMA_AREA_AIORING, VMA_EXT_PLUGIN = 1 << 13, 1 << 27
MAP_HUGETLB, PROT_READ = 0x40000, 0x1


def parent_readable_mappings(image_dir: Path, pid: int) -> list[tuple[int, int]]:
    """(start, end) of the process's mappings whose pages CRIU's restore can read from a parent
    images directory, by address: private, readable, neither hugetlb nor an AIO ring nor a
    plugin's. CRIU restores the others without premapping them and reads their pages from the
    process's own pages image whatever the pagemap says (criu/mem.c: its own dump never gives
    them a parent either)."""
    mm = image_dir / f"mm-{pid}.img"
    if not mm.exists():
        return []
    found = []
    for vma in _first_entry(mm, "MM", "mm_entry").vmas:
        private = vma.status & VMA_AREA_REGULAR and vma.status & (VMA_ANON_PRIVATE | VMA_FILE_PRIVATE)
        if (private and vma.prot & PROT_READ and not vma.flags & MAP_HUGETLB
                and not vma.status & (VMA_AREA_AIORING | VMA_EXT_PLUGIN)):
            found.append((vma.start, vma.end))
    return sorted(found)


def held_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(vaddr, nr_pages) of the pagemap runs whose pages the pages image holds, in its order:
    present, not "in parent"."""
    return [(vaddr, nr_pages) for vaddr, nr_pages, flags in runs
            if flags & PE_PRESENT and not flags & PE_PARENT and nr_pages > 0]


def mappings(image_dir: Path, pid: int) -> set[tuple[int, int]]:
    """The process's memory mappings as (start, end) addresses (its mm image; none if it has none)."""
    mm = image_dir / f"mm-{pid}.img"
    if not mm.exists():
        return set()
    return {(int(v["start"]), int(v["end"])) for v in load_image(mm)["entries"][0].get("vmas", [])}


def page_addresses(image_dir: Path, pid: int) -> tuple[str | None, list[int]]:
    """The pages image of a process and the virtual address of each page it holds, in order."""
    path = image_dir / f"pagemap-{pid}.img"
    if not path.exists():
        return None, []
    pages_id, runs = read_pagemap(path)
    addresses: list[int] = []
    for start, nr_pages in held_runs(runs):
        addresses.extend(range(start, start + nr_pages * 4096, 4096))
    return f"pages-{pages_id}.img", addresses


def _number(value) -> int:
    return int(value, 0) if isinstance(value, str) else int(value)


class _ReadPagemaps:
    """Pagemaps read or written by this process, by path and identity (inode, size, modification
    time: a rewrite is a new file, see write_pagemap): a restore's plans read each pagemap of a
    tree up to four times (101 processes: 405 reads, 0.055 s). At most KEPT_RUNS runs in all
    are kept (the oldest pagemaps are forgotten first), so a long-lived process stays small."""

    KEPT_RUNS = 1 << 18

    def __init__(self) -> None:
        self._by_path: dict[str, tuple[tuple[int, int, int], int, tuple[tuple[int, int, int], ...]]] = {}
        self._runs = 0
        self._lock = threading.Lock()  # a dump reads an earlier checkpoint's pagemaps in a thread

    def get(self, path: Path) -> tuple[int, list[tuple[int, int, int]]] | None:
        with self._lock:
            known = self._by_path.get(str(path))
        if known is None or known[0] != _identity(path):
            return None
        return known[1], list(known[2])

    def put(self, path: Path, pages_id: int, runs: list[tuple[int, int, int]]) -> None:
        identity, kept = _identity(path), tuple(runs)
        with self._lock:
            self._forget(str(path))
            if len(kept) > self.KEPT_RUNS:
                return
            while self._by_path and self._runs + len(kept) > self.KEPT_RUNS:
                self._forget(next(iter(self._by_path)))
            self._by_path[str(path)] = (identity, pages_id, kept)
            self._runs += len(kept)

    def _forget(self, key: str) -> None:
        gone = self._by_path.pop(key, None)
        if gone is not None:
            self._runs -= len(gone[2])


def _identity(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


_PAGEMAPS = _ReadPagemaps()


def read_pagemap(path: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """A pagemap image: its pages image id and its runs (vaddr, nr_pages, flags).

    Parsed with pycriu's message classes rather than its image reader, which turns every
    field into a dict entry: 60 ms for the 300 runs of a 2 GiB process, which a dump pays
    twice (ckpt/dump/unchanged.py). Same layout as pycriu's pagemap handler reads: the magic (after
    a common/service magic), then size-prefixed messages, a head and then the entries."""
    known = _PAGEMAPS.get(path)
    if known is not None:
        return known
    pages_id, runs = _parse_pagemap(path)
    _PAGEMAPS.put(path, pages_id, runs)
    return pages_id, runs


def _parse_pagemap(path: Path) -> tuple[int, list[tuple[int, int, int]]]:
    from pycriu.images import magic, pb  # deferred: importing pycriu costs ~0.1 s

    _, messages = _split(path.read_bytes(), path.name, "PAGEMAP", magic)
    if not messages:
        raise ValueError(f"{path.name} has no pagemap head")
    head = pb.pagemap_head()
    head.ParseFromString(messages[0])
    runs = []
    entry = pb.pagemap_entry()
    for message in messages[1:]:
        entry.Clear()
        entry.ParseFromString(message)
        flags = entry.flags if entry.HasField("flags") else (PE_PARENT if entry.in_parent else PE_PRESENT)
        runs.append((entry.vaddr, entry.nr_pages or entry.compat_nr_pages, flags))
    return head.pages_id, runs


def write_pagemap(path: Path, pages_id: int, runs: list[tuple[int, int, int]]) -> None:
    """Replaces a pagemap image (atomically) with the given runs.

    The messages are serialized one by one, byte for byte as pycriu's image writer writes
    them (tests/unit check), whose dict per entry took 1-2 s for the 131,000 entries of a
    sparse heap (a dump's page stream writes every pagemap): a head {pages_id}, then an
    entry {vaddr, compat_nr_pages = 0 (CRIU reads nr_pages), flags, nr_pages} per run, each
    after its size, behind the IMG_COMMON and PAGEMAP magics."""
    from pycriu.images import magic, pb  # deferred: importing pycriu costs ~0.1 s

    head = pb.pagemap_head()
    head.pages_id = pages_id
    parts = [struct.pack("<ii", magic.by_name["IMG_COMMON"], magic.by_name["PAGEMAP"]), _sized(head)]
    entry = pb.pagemap_entry()
    for vaddr, nr_pages, flags in runs:
        entry.vaddr, entry.compat_nr_pages, entry.flags, entry.nr_pages = vaddr, 0, flags, nr_pages
        parts.append(_sized(entry))
    replace_staged(path, b"".join(parts))
    _PAGEMAPS.put(path, pages_id, list(runs))


def _sized(message) -> bytes:
    data = message.SerializeToString()
    return struct.pack("<i", len(data)) + data


MADV_HUGEPAGE_BIT, MADV_NOHUGEPAGE_BIT = 1 << 14, 1 << 15  # VmaEntry.madv: 1 << MADV_*


def lazy_runs(image_dir: Path,
              huge_pages_everywhere: bool = False) -> dict[int, tuple[str, list[tuple[int, int, int]]]] | None:
    """Prepares staged images for a lazy restore. Returns per process its pages image and the
    pagemap entries a lazy restore serves as (vaddr, nr_pages, position of the first page in
    the pages image).

    CRIU marks PE_LAZY the pages of private anonymous memory (but each thread's stack page).
    A mapping is served lazily only if every page of it is: CRIU writes the other pages into
    it before userfaultfd watches it, and with transparent huge pages one such write fills a
    whole 2 MiB with zeros where lazy pages were to arrive (CRIU guards against that only for
    images with a parent; ckpt's are flattened). The pagemaps of such mappings are rewritten
    without PE_LAZY. CRIU still watches such a mapping with userfaultfd, and if it uses huge
    pages (MADV_HUGEPAGE; with huge_pages_everywhere any mapping not MADV_NOHUGEPAGE) the
    restored process hangs or its memory comes back wrong (seen in the test VM, Linux 6.1, with
    a flattened dirty-tracking checkpoint): then None, the restore must not be lazy. (Each
    thread's one eager stack page under THP "always" restored right in the VM.)"""
    result = {}
    for path in sorted(image_dir.glob("pagemap-*.img")):
        pid = path.name[len("pagemap-"):-len(".img")]
        if not pid.isdigit():  # pagemap-shmem-*: shared memory is never lazy
            continue
        pages_id, runs = read_pagemap(path)
        mm_path = image_dir / f"mm-{pid}.img"
        entries = _vmas(mm_path) if mm_path.exists() else []
        eager = _entries_in_mixed_mappings(runs, [(start, end) for start, end, _ in entries])
        # Pages read from a parent images directory (a tree's pages shared with its root) are
        # written by CRIU before userfaultfd watches the mapping too.
        from_parent = {i for i, (_, _, flags) in enumerate(runs) if flags & PE_PARENT}
        if _huge_pages_in(runs, eager | from_parent, entries, huge_pages_everywhere):
            return None
        demoted = {i for i in eager if runs[i][2] & PE_LAZY}
        if demoted:
            runs = [(vaddr, nr_pages, flags & ~PE_LAZY if i in demoted else flags)
                    for i, (vaddr, nr_pages, flags) in enumerate(runs)]
            write_pagemap(path, pages_id, runs)
        lazy, position = [], 0
        for vaddr, nr_pages, flags in runs:
            if flags & PE_PRESENT and not flags & PE_PARENT:
                if flags & PE_LAZY:
                    lazy.append((vaddr, nr_pages, position))
                position += nr_pages
        result[int(pid)] = (f"pages-{pages_id}.img", lazy)
    return result


def _mappings_of(starts: list[int], vaddr: int, nr_pages: int) -> range:
    """The indexes of the mappings (sorted by start) a pagemap entry falls in."""
    first = max(bisect.bisect_right(starts, vaddr) - 1, 0)
    last = max(bisect.bisect_right(starts, vaddr + nr_pages * 4096 - 1) - 1, 0)
    return range(first, last + 1)


def _huge_pages_in(runs: list[tuple[int, int, int]], entries: set[int], vmas: list[tuple[int, int, int]],
                   everywhere: bool) -> bool:
    """Whether any of these pagemap entries lies in a mapping (start, end, madv) that uses
    transparent huge pages (everywhere: unless it opted out)."""
    if not everywhere and not any(madv & MADV_HUGEPAGE_BIT for _, _, madv in vmas):
        return False  # (the common case, known without finding each entry's mappings)
    starts = [start for start, _, _ in vmas]
    return any(madv & MADV_HUGEPAGE_BIT or (everywhere and not madv & MADV_NOHUGEPAGE_BIT)
               for i in entries for _, _, madv in (vmas[m] for m in _mappings_of(starts, *runs[i][:2])))


def _entries_in_mixed_mappings(runs: list[tuple[int, int, int]], vmas: list[tuple[int, int]]) -> set[int]:
    """The indexes of the present pagemap entries that share a mapping with a present page that
    is not lazy (an entry may span mappings: repeated until nothing changes). Without the
    mappings (no mm image), every entry."""
    present = [i for i, (_, _, flags) in enumerate(runs) if flags & PE_PRESENT and not flags & PE_PARENT]
    if not vmas:
        return set(present)
    starts = [start for start, _ in vmas]

    def mappings(i: int) -> range:
        return _mappings_of(starts, *runs[i][:2])

    eager = {i for i in present if not runs[i][2] & PE_LAZY}
    while True:
        mixed = {m for i in eager for m in mappings(i)}
        more = {i for i in present if i not in eager and any(m in mixed for m in mappings(i))}
        if not more:
            return eager
        eager |= more


# The TCP states CRIU dumps as connections (criu/sk-inet.c, can_dump_ipproto: TCP repair
# restores them): ESTABLISHED, SYN-SENT, FIN-WAIT-1/2, CLOSE-WAIT, LAST-ACK, CLOSING.
TCP_CONNECTED_STATES = frozenset({1, 2, 4, 5, 8, 9, 11})
TCP_CLOSE, SK_SHUTDOWN_BOTH = 7, 3


@dataclass(frozen=True)
class TcpConnection:
    """A TCP connection of the tree, from its inet socket entry in files.img."""

    id: int  # the socket's id in files.img
    state: int  # the kernel's TCP state at the dump (ckpt/system/inetdiag.py names them)
    local: tuple[str, int]  # address, port
    remote: tuple[str, int]


def tcp_connections(image_dir: Path) -> list[TcpConnection]:
    """The tree's TCP connections (not listening or unconnected sockets), in files.img's order."""
    from pycriu.images import magic, pb  # deferred: importing pycriu costs ~0.1 s

    path = image_dir / "files.img"
    if not path.exists():
        return []
    try:
        _, messages = _split(path.read_bytes(), path.name, "FILES", magic)
    except ValueError as exc:
        raise ImageUnreadable(f"CRIU's image {exc}") from exc
    entry = pb.file_entry()
    found = []
    for message in messages:
        entry.Clear()
        entry.ParseFromString(message)
        if not entry.HasField("isk"):
            continue
        sk = entry.isk
        if sk.proto != 6 or sk.state not in TCP_CONNECTED_STATES:
            continue
        found.append(TcpConnection(sk.id, sk.state, (_ip(sk.src_addr), sk.src_port), (_ip(sk.dst_addr), sk.dst_port)))
    return found


def _ip(words) -> str:
    """An address as CRIU records it: the bytes of the address in uint32 words, in the dumping
    host's order (one word for IPv4, four for IPv6)."""
    import ipaddress

    raw = struct.pack(f"={len(words)}I", *words)
    return str(ipaddress.ip_address(raw[:4] if len(words) < 4 else raw[:16]))


def close_connections(image_dir: Path, ids: set[int]) -> None:
    """Rewrites the staged files.img (atomically: it may be a hard link to a stored object) so
    that CRIU restores the TCP connections with those socket ids closed, as its --tcp-close
    restores every one (criu/sk-tcp.c, restore_one_tcp: a new socket, shut down both ways):
    state CLOSE, no ports (CRIU then neither binds nor connects it), shut down both ways (CRIU
    calls shutdown(2), which on a socket never connected fails with ENOTCONN, which CRIU
    expects of a CLOSE socket, but marks it shut all the same). The program reads end of file
    and its writes fail with EPIPE. Every other message is kept byte for byte."""
    def close(entry) -> bool:
        if entry.HasField("isk") and entry.isk.id in ids:
            entry.isk.state, entry.isk.src_port, entry.isk.dst_port = TCP_CLOSE, 0, 0
            entry.isk.shutdown = SK_SHUTDOWN_BOTH
            return True
        return False

    _rewrite_files_image(image_dir, close)


def proc_of_new_pid_namespace(image_dir: Path) -> None:
    """Rewrites the staged images so that CRIU's restore of the tree into a copy's PID namespace
    (restore/copies.py) mounts a /proc of that namespace for the restored tasks.

    The copy's tree joins the host's mount namespace (join_ns mnt, so that a dump of the copy
    has no mount namespace to dump). CRIU's restore then opens that namespace's /proc, the
    host's, whenever it restores in no namespace of its own (criu/cr-restore.c, mount_proc:
    root_ns_mask == 0), and looks the restored tasks up there by their PIDs inside the copy:
    it fails when the host has no such PID ("Can't open PROC_SELF"), and opens the original's
    /proc/PID (its map_files, for shared memory) when it runs. Told that the root has a time
    namespace of its own (root_ids.time_ns_id of inventory.img made different, the clocks
    image copied under the root's time namespace id), CRIU mounts a new /proc of the current
    PID namespace instead; the join_ns time that follows puts the tree back in the host's
    time namespace, which the copy's init is in (CRIU dumps no nested time namespace)."""
    import io

    from pycriu import images  # deferred: importing pycriu costs ~0.1 s

    inventory = load_image(image_dir / "inventory.img")
    root = int(load_image(image_dir / "pstree.img")["entries"][0]["pid"])
    time_ns = int(load_image(image_dir / f"ids-{root}.img")["entries"][0]["time_ns_id"])
    root_ids = inventory["entries"][0]["root_ids"]
    if int(root_ids.get("time_ns_id", 0)) != time_ns:
        return  # the tree has a time namespace of its own already
    clocks = image_dir / "timens-0.img"
    if not clocks.exists():
        raise ImageUnreadable("the checkpoint has no clocks image (timens-0.img), which a copy's restore needs",
                              hint="restore it without --copies (this kernel had no time namespaces at the dump?)")
    root_ids["time_ns_id"] = max(int(v) for v in root_ids.values() if isinstance(v, int)) + 1
    out = io.BytesIO()
    images.dump(inventory, out)
    replace_staged(image_dir / "inventory.img", out.getvalue())  # (may be a hard link)
    replace_staged(image_dir / f"timens-{time_ns}.img", clocks.read_bytes())
