"""What a restore checks of this host before CRIU runs (ckpt/restore/hostcheck.py), and the
ELF build id as CRIU finds it (ckpt/criu/elf.py)."""

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from ckpt.criu.binary import CriuBinary
from ckpt.criu.elf import build_id, build_id_of
from ckpt.criu.images import OpenedFile, drop_size_checks, opened_files
from ckpt.errors import ExitCode, HostMismatch
from ckpt.restore import hostcheck
from ckpt.store import Manifest
from ckpt.system import procfs


def manifest(**kwargs) -> Manifest:
    values = {"id": "20261201-120000-000-abcdef", "created": "2026-12-01T12:00:00+00:00", "pid": 4242,
              "command": "agent", "processes": [{"pid": 4242, "threads": [4242]}], "files": [],
              "host": socket.gethostname(), "system": procfs.host_facts(), "criu": {"version": "4.2.1"}}
    return Manifest(**{**values, **kwargs})


def criu(version: str) -> CriuBinary:
    return CriuBinary("/usr/local/sbin/criu", tuple(int(x) for x in version.split(".")), version)


def report_of(m: Manifest) -> hostcheck.HostReport:
    return hostcheck.HostReport(socket.gethostname(), hostcheck.is_another_host(m))


@pytest.mark.skipif(not shutil.which("readelf"), reason="readelf (binutils) is not installed")
@pytest.mark.parametrize("path", [sys.executable, "/bin/sh", shutil.which("criu") or "/usr/local/sbin/criu"])
def test_build_id_is_the_one_readelf_shows(path):
    path = os.path.realpath(path)
    if not os.path.exists(path):
        pytest.skip(f"{path} is absent")
    shown = re.search(r"Build ID: ([0-9a-f]+)", subprocess.run(["readelf", "-n", path], capture_output=True,
                                                               text=True).stdout)
    assert (build_id(path) or b"").hex() == (shown.group(1) if shown else "")


def test_no_build_id_where_criu_finds_none(tmp_path):
    assert build_id_of(b"") is None and build_id_of(b"#!/bin/sh\n") is None
    assert build_id_of(b"\x7fELF\x02\x01\x01" + bytes(9)) is None  # a header cut short
    assert build_id(str(tmp_path / "absent")) is None


def elf_copy(tmp_path, name="lib.so"):
    source = os.path.realpath(sys.executable)
    if not build_id(source):
        pytest.skip("the Python executable has no build id")
    copy = tmp_path / name
    shutil.copy(source, copy)
    return copy


def opened(path, **kwargs) -> OpenedFile:
    st = os.stat(path)
    values = {"path": str(path), "mode": st.st_mode, "size": st.st_size, "build_id": None}
    return OpenedFile(**{**values, **kwargs})


def test_files_as_they_were_match(tmp_path):
    library = elf_copy(tmp_path)
    data = tmp_path / "data"
    data.write_text("x" * 10)
    report = report_of(manifest())
    hostcheck.compare_files([opened(library, build_id=build_id(str(library))), opened(data), opened(tmp_path)],
                            set(), report)
    assert report.mismatches == []


def test_every_file_that_differs_is_named_with_its_cause(tmp_path):
    library = elf_copy(tmp_path)
    recorded = opened(library, build_id=build_id(str(library)))
    content = bytearray(library.read_bytes())
    content[content.find(recorded.build_id)] ^= 0xFF
    library.write_bytes(bytes(content))
    grown, gone, locked, was_dir = (tmp_path / n for n in ("grown", "gone", "locked", "was_dir"))
    for path in (grown, gone, locked):
        path.write_text("0123456789")
    was_dir.mkdir()
    files = [recorded, opened(grown), opened(gone), opened(locked), opened(was_dir)]
    grown.write_text("0123456789more")
    gone.unlink()
    locked.chmod(0o600)
    was_dir.rmdir()
    was_dir.write_text("")
    report = report_of(manifest())
    hostcheck.compare_files(files, set(), report)
    assert report.mismatches == [
        f"{library} has another ELF build id here ({build_id(str(library)).hex()}, the checkpoint's "
        f"{recorded.build_id.hex()}): another build of it",
        f"on this host {grown} has size 14, the checkpoint's had 10",
        f"{gone} is missing",
        f"{locked} has mode 0600 here, the checkpoint's had 0644",
        f"{was_dir} is a regular file here, the checkpoint's was a directory",
    ]
    assert report.kinds == ["files"] * 5


def test_what_criu_does_not_check_is_not_a_mismatch(tmp_path):
    log = tmp_path / "app.log"
    log.write_text("appended since")
    proc_of_tree = OpenedFile("/proc/4242/status", 0o100444, 0, None)
    report = report_of(manifest())
    # A log opened write-only with O_APPEND: CRIU records no size. A build id CRIU cannot find
    # now (the file is no longer ELF) leaves the size alone to decide.
    hostcheck.compare_files([opened(log, size=None), opened(log, build_id=b"\x01\x02\x03\x04"), proc_of_tree],
                            {4242}, report)
    assert report.mismatches == []


WRITTEN, APPENDED = os.O_WRONLY, os.O_WRONLY | os.O_APPEND


def test_a_grown_file_the_tree_only_writes_to_is_no_mismatch_and_criu_is_told_not_to_compare_it(tmp_path):
    """A log opened `> app.log` (write-only, CRIU records its size) and `>> app.log` (CRIU
    records none): grown, it restores; the restored process writes on at its offset, over what
    was written since, which one warning says. Not grown, nothing is said but CRIU still is told
    (the log may grow before CRIU opens it)."""
    log, quiet = tmp_path / "app.log", tmp_path / "quiet.log"
    log.write_text("x" * 100)
    quiet.write_text("y" * 10)
    files = [opened(log, id=5, flags=WRITTEN, offset=100), opened(log, id=6, flags=WRITTEN, offset=100),
             opened(log, id=7, flags=APPENDED, size=None, offset=100), opened(quiet, id=8, flags=WRITTEN, offset=10)]
    log.write_text("x" * 160)
    report = report_of(manifest())
    hostcheck.compare_files(files, set(), report)
    assert report.mismatches == []
    assert report.sizes_unchecked == {5, 6, 8}
    assert report.warnings == [f"{log} grew from 100 to 160 bytes after the checkpoint; the tree only writes to it, "
                               "so it is restored, and the restored process writes on at its offset then (100), "
                               "overwriting what was written there after the checkpoint"]


@pytest.mark.parametrize("also", [
    {"flags": os.O_RDONLY},  # read back through another descriptor, or mapped (CRIU records it so)
    {"flags": os.O_RDWR},
], ids=["read-only", "read-write"])
def test_a_grown_file_the_tree_reads_is_a_mismatch(tmp_path, also):
    log = tmp_path / "app.log"
    log.write_text("x" * 100)
    files = [opened(log, id=5, flags=WRITTEN, offset=100), opened(log, id=6, **also)]
    log.write_text("x" * 160)
    report = report_of(manifest())
    hostcheck.compare_files(files, set(), report)
    assert report.mismatches == [f"on this host {log} has size 160, the checkpoint's had 100"]
    assert not report.sizes_unchecked and not report.warnings


def reg_file(id_: int, name: str, flags: str, size: int | None) -> dict:
    reg = {"id": id_, "flags": flags, "pos": 100, "name": name, "mode": 0o100644,
           "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}}
    return {"type": "REG", "id": id_, "reg": reg if size is None else {**reg, "size": size}}


def test_criu_is_told_not_to_compare_a_size_in_the_staged_images_only(tmp_path):
    """files.img is rewritten without the sizes named, and replaced, not written through: the
    staged file may be a hard link to the stored object."""
    from pycriu import images

    entries = [reg_file(5, "/srv/app.log", "O_WRONLY | O_LARGEFILE", 100),
               reg_file(6, "/srv/data.db", "O_RDWR | O_LARGEFILE", 4096),
               reg_file(7, "/srv/more.log", "O_WRONLY | O_APPEND | O_LARGEFILE", None)]
    stored = tmp_path / "object"
    with open(stored, "wb") as f:
        images.dump({"magic": "FILES", "entries": entries}, f)
    staged = tmp_path / "images"
    staged.mkdir()
    os.link(stored, staged / "files.img")
    before = stored.read_bytes()

    found = opened_files(staged)
    assert [(f.id, f.flags & os.O_ACCMODE, bool(f.flags & os.O_APPEND), f.offset, f.size) for f in found] == [
        (5, os.O_WRONLY, False, 100, 100), (6, os.O_RDWR, False, 100, 4096), (7, os.O_WRONLY, True, 100, None)]
    drop_size_checks(staged, {5})
    assert [f.size for f in opened_files(staged)] == [None, 4096, None]
    assert stored.read_bytes() == before
    with open(stored, "rb") as f, open(staged / "files.img", "rb") as g:
        original, rewritten = images.load(f)["entries"], images.load(g)["entries"]
    original[0]["reg"].pop("size")
    assert rewritten == original


def test_a_written_file_that_shrank_is_a_mismatch(tmp_path):
    """Truncated (by logrotate's copytruncate, say): the restored process would write past
    the end, leaving a hole; refused as before."""
    log = tmp_path / "app.log"
    log.write_text("x" * 100)
    files = [opened(log, id=5, flags=WRITTEN, offset=100)]
    log.write_text("")
    report = report_of(manifest())
    hostcheck.compare_files(files, set(), report)
    assert report.mismatches == [f"on this host {log} has size 0, the checkpoint's had 100"]
    assert not report.sizes_unchecked


def test_the_same_file_held_twice_is_named_once(tmp_path):
    report = report_of(manifest())
    missing = OpenedFile(str(tmp_path / "gone"), 0o100644, 3, None)
    hostcheck.compare_files([missing, missing, OpenedFile(missing.path, 0o100644, None, None)], set(), report)
    assert report.mismatches == [f"{missing.path} is missing"]


def test_an_older_criu_and_another_architecture_are_mismatches_an_older_kernel_a_warning():
    facts = procfs.host_facts()
    newer_kernel = f"{int(facts['kernel'].split('.')[0]) + 1}.0.0"
    m = manifest(criu={"version": "4.3.0"}, system={**facts, "arch": "riscv64", "kernel": newer_kernel})
    report = report_of(m)
    hostcheck.compare_system(m, criu("4.2.1"), report)
    assert report.kinds == ["criu", "arch"]
    assert "CRIU here is 4.2.1, older than the 4.3.0" in report.mismatches[0]
    assert f"this machine is {facts['arch']}, the checkpoint's was riscv64" == report.mismatches[1]
    assert len(report.warnings) == 1 and f"Linux {newer_kernel}" in report.warnings[0]

    same = report_of(manifest())
    hostcheck.compare_system(manifest(criu={"version": "4.2.0"}), criu("4.2.1"), same)  # newer CRIU here
    hostcheck.compare_system(manifest(criu={"version": "4.2.9"}), criu("4.2.1"), same)  # patch level only
    assert same.mismatches == [] and same.warnings == []


def test_a_cpu_lacking_an_instruction_set_the_checkpoints_had_is_a_mismatch():
    """A tree started on a CPU with AVX-512 uses glibc's AVX-512 memset: restored on one without,
    it dies of SIGILL after a restore CRIU calls a success (the compat fixture did, here)."""
    facts = procfs.host_facts()
    assert "sse2" in facts["cpu_flags"] or os.uname().machine != "x86_64"
    m = manifest(system={**facts, "cpu_flags": [*facts["cpu_flags"], "avx512_never_made", "amx_never_made"]})
    report = report_of(m)
    hostcheck.compare_system(m, criu("4.2.1"), report)
    assert report.kinds == ["cpu"]
    assert "lacks instructions the checkpoint's had (amx_never_made, avx512_never_made)" in report.mismatches[0]
    with pytest.raises(HostMismatch) as raised:
        hostcheck.require_match(m, report)
    assert raised.value.exit_code == ExitCode.HOST_MISMATCH and "whose CPU has these" in raised.value.hint

    fewer = manifest(system={**facts, "cpu_flags": facts["cpu_flags"][:3]})  # a CPU with less: fine here
    same = report_of(fewer)
    hostcheck.compare_system(fewer, criu("4.2.1"), same)
    assert same.mismatches == []


def test_the_cpu_flags_recorded_name_instructions_only(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 hypervisor avx2 constant_tsc avx512f amx_tile bmi2\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    real_path = procfs.Path
    monkeypatch.setattr(procfs, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert procfs.cpu_instruction_flags() == ["amx_tile", "avx2", "avx512f", "bmi2", "sse2"]
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd aes sve\n")
    assert procfs.cpu_instruction_flags() == ["aes", "asimd", "fp", "sve"]


def test_an_old_manifest_without_system_facts_compares_what_it_has():
    m = manifest(system={})
    report = report_of(m)
    hostcheck.compare_system(m, criu("4.2.1"), report)
    assert report.mismatches == [] and report.warnings == [] and report.another_host is False


def test_another_host_by_name_or_machine_id():
    here = procfs.machine_id()
    assert hostcheck.is_another_host(manifest()) is False
    assert hostcheck.is_another_host(manifest(host="elsewhere")) is True
    if here:
        assert hostcheck.is_another_host(manifest(system={"machine_id": "0" * 32})) is True
    assert hostcheck.is_another_host(manifest(system={})) is False  # recorded by an older ckpt


def test_one_error_names_the_first_ten_and_says_where_the_rest_are():
    m = manifest(host="builder")
    report = hostcheck.HostReport("here", True)
    for i in range(12):
        report.add("files", f"/srv/f{i} is missing")
    report.add("criu", "CRIU here is 4.1.0, older than the 4.2.1 that took the checkpoint")
    with pytest.raises(HostMismatch) as raised:
        hostcheck.require_match(m, report)
    error = raised.value
    assert error.exit_code == ExitCode.HOST_MISMATCH == 10
    assert error.message.startswith(f"cannot restore {m.id} on this host: /srv/f0 is missing; /srv/f1 is missing")
    assert "/srv/f9 is missing" in error.message and "/srv/f10" not in error.message
    assert f"and 3 more ('ckpt check {m.id}' lists them all)" in error.message
    assert error.hint == ("install the same versions of these files, or restore on the original host (builder); "
                          "install CRIU 4.2.1 or newer ('make setup'), then restore again")
    hostcheck.require_match(m, hostcheck.HostReport("here", True))  # nothing to say: no error
