"""Does this host have what a checkpoint needs? Checked before CRIU runs, every mismatch at once.

CRIU itself refuses, midway through a restore and one file at a time, a file the tree had open
or mapped that is missing or differs in size, mode or ELF build id (criu/files-reg.c,
validate_file); a restore on another machine meets several at once (another libc, another
python). ckpt makes the same checks on the images first and names them all in one error, but
for one: a file the tree only writes to (a log) may have grown since the dump, since the
restored process writes on at its own offset, as it would have. CRIU compares every recorded
size exactly and has no option against it, so the staged images are told not to record those
sizes (let_written_files_grow).
What else must match: the CRIU here must be at least as new (in major.minor) as the one that
dumped (CRIU reads older images, not newer ones), the machine architecture the same (images
hold registers), and the CPU must have every instruction-set extension the dumping one had
(procfs.cpu_instruction_flags): glibc picks its string functions by the CPU a process starts
on, so a tree started on an AVX-512 host and restored on one without dies of SIGILL at its
next memset, after a restore CRIU reports as a success (CRIU's own cpuinfo check is off by
default and compares more than instructions). The kernel is only compared: an older one is a
warning, since CRIU restores across kernels and fails by itself on the rare feature that is
missing.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.criu.binary import CriuBinary
from ckpt.criu.elf import build_id as elf_build_id
from ckpt.criu.images import OpenedFile
from ckpt.errors import HostMismatch
from ckpt.store import Manifest
from ckpt.system import procfs

SHOWN = 10  # mismatches named in the error; `ckpt check ID` lists every one


@dataclass
class HostReport:
    """What the comparison of a checkpoint with this host found."""

    this_host: str
    another_host: bool  # taken on another machine (host name or machine id differs)
    mismatches: list[str] = field(default_factory=list)  # each would make CRIU's restore fail
    # What each mismatch is about, for what to do: "files", "criu", "arch" or "socket".
    kinds: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # worth saying, not refused
    # The reg-files (ids in files.img) whose size CRIU must not compare: the tree only writes
    # to them, and they are as large here as at the dump or larger.
    sizes_unchecked: set[int] = field(default_factory=set)

    def add(self, kind: str, message: str) -> None:
        self.kinds.append(kind)
        self.mismatches.append(message)


def _version(text: str, parts: int = 2) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:parts])


def is_another_host(manifest: Manifest) -> bool:
    """Whether the checkpoint was taken on another machine: another host name, or (where both
    are recorded) another machine id, which tells apart machines sharing a name (clones)."""
    if manifest.host and manifest.host != socket.gethostname():
        return True
    recorded = manifest.system.get("machine_id") or ""
    here = procfs.machine_id()
    return bool(recorded and here and recorded != here)


def compare_system(manifest: Manifest, binary: CriuBinary, report: HostReport) -> None:
    """CRIU's version, the architecture and the kernel against what the manifest recorded."""
    dumped_with = str(manifest.criu.get("version") or "")
    if dumped_with and _version(binary.version_text) < _version(dumped_with):
        report.add("criu", f"CRIU here is {binary.version_text}, older than the {dumped_with} that took the "
                           "checkpoint (CRIU reads the images of older versions, not of newer ones)")
    facts = procfs.host_facts()
    arch = manifest.system.get("arch")
    if arch and arch != facts["arch"]:
        report.add("arch", f"this machine is {facts['arch']}, the checkpoint's was {arch}")
    missing = sorted(set(manifest.system.get("cpu_flags") or ()) - set(facts["cpu_flags"]))
    if missing and (not arch or arch == facts["arch"]):
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        report.add("cpu", f"this CPU lacks instructions the checkpoint's had ({shown}): code the tree chose "
                          "when it started (glibc's memcpy and memset, numpy, a JIT) may use them, and the "
                          "restored tree would die of SIGILL")
    kernel = manifest.system.get("kernel")
    if kernel and _version(facts["kernel"]) < _version(kernel):
        report.warnings.append(f"the checkpoint was taken on Linux {kernel}, this is {facts['kernel']}: an older "
                               "kernel may lack a feature the tree used (CRIU then says which)")


def compare_datagram_peers(manifest: Manifest, report: HostReport) -> None:
    """CRIU connects the tree's datagram sockets to the paths they sent to; without the socket
    there, it fails midway ("Can't connect ... socket")."""
    for sock in manifest.criu.get("external_datagram_sockets", []):
        path = sock.get("peer_path")
        if path and not path.startswith("@") and not os.path.exists(path):
            report.add("socket", f"PID {sock['pid']} sent datagrams to {path}, which does not exist here")


def compare_files(files: list[OpenedFile], tree_pids: set[int], report: HostReport) -> None:
    """Each file against the one at its path here, as CRIU will compare them: there at all,
    then its mode, its size (where CRIU recorded one) and its ELF build id (where CRIU recorded
    one and finds one now). Where the tree only writes to a file (every descriptor of it
    write-only, none mapping it: a log), a larger size is no mismatch: see _written_files."""
    written_only = {f.path for f in files} - {f.path for f in files if not f.write_only}
    seen: set[tuple] = set()
    for opened in files:
        key = (opened.path, opened.mode, opened.size, opened.build_id)
        if key in seen or _made_by_the_restore(opened.path, tree_pids):
            continue
        seen.add(key)
        problem = _file_problem(opened, may_grow=opened.path in written_only)
        if problem and problem not in report.mismatches:
            report.add("files", problem)
    _written_files([f for f in files if f.path in written_only and f.size is not None], report)


def _written_files(files: list[OpenedFile], report: HostReport) -> None:
    """The files the tree only writes to whose size CRIU recorded (opened without O_APPEND, as
    by `> app.log`), as large here as at the dump or larger: CRIU is not to compare their size.
    The restored process writes on at its offset at the dump: where the file grew since (the
    lost process wrote on), that overwrites what it wrote, once said in a warning."""
    by_path: dict[str, list[OpenedFile]] = {}
    for opened in files:
        by_path.setdefault(opened.path, []).append(opened)
    for path, held in by_path.items():
        try:
            st = os.stat(path)
        except OSError:
            continue  # a mismatch already
        recorded = max(f.size or 0 for f in held)
        if not stat.S_ISREG(st.st_mode) or st.st_size < recorded:
            continue  # a mismatch already: the restored process would write past the end
        report.sizes_unchecked.update(f.id for f in held)
        offsets = sorted({f.offset for f in held if not f.flags & os.O_APPEND and f.offset < st.st_size})
        if st.st_size > recorded and offsets:
            at = ", ".join(map(str, offsets))
            report.warnings.append(f"{path} grew from {recorded} to {st.st_size} bytes after the checkpoint; "
                                   "the tree only writes to it, so it is restored, and the restored process writes "
                                   f"on at its offset then ({at}), overwriting what was written there after the "
                                   "checkpoint")


def let_written_files_grow(image_dir: Path, report: HostReport) -> None:
    """Tells CRIU, in the staged images, not to compare the sizes the check let pass (see
    _written_files): it would refuse a grown log ("File ... has bad size")."""
    if report.sizes_unchecked and not report.mismatches:
        from ckpt.criu.images import drop_size_checks  # deferred: imports pycriu

        drop_size_checks(image_dir, report.sizes_unchecked)


def _made_by_the_restore(path: str, tree_pids: set[int]) -> bool:
    """/proc/PID/... of a process of the tree exists once CRIU has restored that process."""
    parts = path.split("/")
    return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) in tree_pids


def _file_problem(opened: OpenedFile, may_grow: bool = False) -> str | None:
    path = opened.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except NotADirectoryError:
        return f"{path} is missing (a directory on its path is a file here)"
    except OSError as exc:
        return f"{path} cannot be examined here ({exc.strerror})"
    return _mode_problem(opened, st) or _content_problem(opened, st, may_grow)


def _mode_problem(opened: OpenedFile, st: os.stat_result) -> str | None:
    if opened.mode is None or st.st_mode == opened.mode:
        return None
    if stat.S_IFMT(st.st_mode) != stat.S_IFMT(opened.mode):
        return f"{opened.path} is {_kind(st.st_mode)} here, the checkpoint's was {_kind(opened.mode)}"
    return f"{opened.path} has mode {stat.S_IMODE(st.st_mode):04o} here, the checkpoint's had " \
           f"{stat.S_IMODE(opened.mode):04o}"


def _content_problem(opened: OpenedFile, st: os.stat_result, may_grow: bool) -> str | None:
    if opened.size is None:
        return None
    if st.st_size < opened.size or (st.st_size > opened.size and not may_grow):
        return f"on this host {opened.path} has size {st.st_size}, the checkpoint's had {opened.size}"
    if opened.build_id:
        here = elf_build_id(opened.path)
        # CRIU compares only when it finds a build id now, padded to whole 32-bit words as recorded.
        if here and here + bytes(-len(here) % 4) != opened.build_id:
            return f"{opened.path} has another ELF build id here ({here.hex()}, the checkpoint's " \
                   f"{opened.build_id.hex()}): another build of it"
    return None


def _kind(mode: int) -> str:
    return {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
            stat.S_IFLNK: "a symbolic link"}.get(stat.S_IFMT(mode), f"of type {stat.S_IFMT(mode):o}")


def check(manifest: Manifest, binary: CriuBinary, image_dir: Path | None) -> HostReport:
    """Compares the checkpoint with this host; image_dir holds its laid-out images (at least
    files.img and remap-fpath.img; None: the files are not compared)."""
    report = HostReport(socket.gethostname(), is_another_host(manifest))
    compare_system(manifest, binary, report)
    compare_datagram_peers(manifest, report)
    if image_dir is not None:
        from ckpt.criu.images import opened_files  # deferred: imports pycriu

        compare_files(opened_files(image_dir), set(manifest.all_pids), report)
    return report


def fix_for(kind: str, manifest: Manifest, report: HostReport) -> str:
    """What to do about a mismatch of that kind."""
    if kind == "files" and report.another_host:
        return f"install the same versions of these files, or restore on the original host ({manifest.host})"
    if kind == "files":
        return "put these files back as they were (or install the same versions)"
    if kind == "criu":
        return f"install CRIU {manifest.criu.get('version')} or newer ('make setup')"
    if kind == "arch":
        return "restore on a machine of the checkpoint's architecture"
    if kind == "cpu":
        return "restore on a host whose CPU has these instructions (a cloud instance of the same family), " \
               "or start the program afresh here"
    return "start the program that receives the datagrams (for /dev/log: a syslog daemon or journald)"


def require_match(manifest: Manifest, report: HostReport) -> None:
    """Raises HostMismatch naming the mismatches (the first SHOWN) and what to do."""
    if not report.mismatches:
        return
    named = "; ".join(report.mismatches[:SHOWN])
    if len(report.mismatches) > SHOWN:
        named += f"; and {len(report.mismatches) - SHOWN} more ('ckpt check {manifest.id}' lists them all)"
    hints = [fix_for(kind, manifest, report) for kind in dict.fromkeys(report.kinds)]
    raise HostMismatch(f"cannot restore {manifest.id} on this host: {named}",
                       hint="; ".join(hints) + ", then restore again")
