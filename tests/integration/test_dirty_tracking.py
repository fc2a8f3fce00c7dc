"""Dirty-page tracking (soft-dirty): a second dump of a mostly unchanged process reads only the
pages written since the first, freezes it for less time, and is stored self-contained.

These need a kernel with soft-dirty; the hosts of this project have none, so `make vm-test`
runs them in a VM with Debian's stock kernel, where CKPT_REQUIRE_DIRTY_TRACKING=1 turns a
missing feature into a failure instead of a skip.
"""

import json
import os
import signal
import subprocess

import pytest

from tests.helpers import alive, ckpt, ckpt_json, read_lines, wait_until

pytestmark = pytest.mark.dirty_tracking

# Read at import: the isolated_env fixture clears CKPT_* variables before each test.
REQUIRED = os.environ.get("CKPT_REQUIRE_DIRTY_TRACKING") == "1"
FIGURES = os.environ.get("CKPT_TEST_FIGURES")
SIZE_MIB = 128
SMALL_MIB = 64  # for the tests that dump many times (the VM emulates its CPU: minutes count)
DIRTY_PAGES = 256


def _criu() -> str:
    return "/usr/local/sbin/criu" if os.path.exists("/usr/local/sbin/criu") else "criu"


@pytest.fixture(scope="module", autouse=True)
def soft_dirty():
    probe = subprocess.run([_criu(), "check", "--feature", "mem_dirty_track"], capture_output=True, text=True)
    if probe.returncode != 0:
        message = "this kernel has no dirty-page tracking (soft-dirty); 'make vm-test' runs these tests"
        if REQUIRED:
            pytest.fail(message + ": " + (probe.stdout + probe.stderr).strip())
        pytest.skip(message)


def record(figures: dict) -> None:
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps(figures) + "\n")


class Memory:
    """The dirtymem fixture and its replies."""

    def __init__(self, procs, tmp_path, thp: str, size_mib: int = SIZE_MIB):
        self.out = tmp_path / f"mem-{thp}.txt"
        self.proc = procs.start("dirtymem.py", self.out, size_mib, thp, DIRTY_PAGES)
        self.pid = self.proc.pid
        wait_until(lambda: "ready" in read_lines(self.out), timeout=120, what="dirtymem to fill its memory")

    def _ask(self, pid: int, sig: int, prefix: str) -> str:
        before = len(read_lines(self.out))
        os.kill(pid, sig)
        wait_until(lambda: len([x for x in read_lines(self.out)[before:] if x.startswith(prefix)]) > 0,
                   timeout=120, what=f"reply '{prefix}'")
        return [x for x in read_lines(self.out)[before:] if x.startswith(prefix)][0]

    def checksum(self, pid: int | None = None) -> str:
        return self._ask(pid or self.pid, signal.SIGUSR1, "sum ").split()[1]

    def dirty(self) -> None:
        self._ask(self.pid, signal.SIGUSR2, "dirtied")


def test_second_dump_reads_only_dirty_pages_and_stands_alone(procs, tmp_path):
    mem = Memory(procs, tmp_path, "off")
    first = ckpt_json("dump", mem.pid, "--name", "mem")
    assert first["dirty_tracking"] == {"target": first["dirty_tracking"]["target"], "parent": None,
                                       "pages_from_parent": 0}
    assert first["pages_dumped"] >= SIZE_MIB * 256  # every page of the mapping was read
    mem.dirty()
    second = ckpt_json("dump", mem.pid, "--name", "mem")
    expected = mem.checksum()
    tracking = second["dirty_tracking"]
    assert tracking["parent"] == first["id"]
    # Only the dirtied pages (plus the interpreter's own few) were read while frozen...
    assert second["pages_dumped"] < first["pages_dumped"] / 10, (first, second)
    assert tracking["pages_from_parent"] >= SIZE_MIB * 256 - DIRTY_PAGES
    # ...and frozen for less time.
    assert second["freeze_ms"] < first["freeze_ms"], (first["freeze_ms"], second["freeze_ms"])
    # The checkpoint is whole: same logical pages as the first.
    assert second["pages"] >= first["pages"] - 64
    record({"test": "thp off", "size_mib": SIZE_MIB, "dirtied_pages": DIRTY_PAGES,
            "first": {k: first[k] for k in ("pages_dumped", "bytes_stored", "freeze_ms", "duration_ms")},
            "second": {k: second[k] for k in ("pages_dumped", "bytes_stored", "freeze_ms", "duration_ms")}})

    # Self-contained: with the parent removed and the store pruned, the second restores whole.
    procs.kill_tree(mem.pid)
    wait_until(lambda: not alive(mem.pid), what="the target to end")
    ckpt("rm", first["id"])
    ckpt("prune")
    assert all(not r["problems"] for r in ckpt_json("verify", "--all"))
    restored = ckpt_json("restore", second["id"])
    procs.adopt(restored["pid"])
    assert mem.checksum(restored["pid"]) == expected


def test_a_dump_into_another_store_forces_a_full_dump(procs, tmp_path, isolated_env):
    """Another store's dump clears the soft-dirty bits too: trusting them would lose the pages
    written before it. The next dump into the first store must read everything."""
    mem = Memory(procs, tmp_path, "off", SMALL_MIB)
    first = ckpt_json("dump", mem.pid)
    mem.dirty()
    other = ckpt_json("dump", mem.pid, env={"CKPT_STORE": str(tmp_path / "other-store")})
    assert other["dirty_tracking"]["parent"] is None
    mem.dirty()
    third = ckpt_json("dump", mem.pid)
    assert third["dirty_tracking"]["parent"] is None
    assert third["pages_dumped"] >= SMALL_MIB * 256
    # And a failed dump (here: its checkpoint removed before the next) is never a parent.
    fourth = ckpt("dump", mem.pid)  # as a person reads it
    assert f"unchanged since {third['id']}" in fourth.stderr and "dirty pages read while frozen" in fourth.stderr
    ckpt("rm", fourth.stdout.strip())
    mem.dirty()
    fifth = ckpt_json("dump", mem.pid)
    assert fifth["dirty_tracking"]["parent"] is None
    expected = mem.checksum()
    procs.kill_tree(mem.pid)
    wait_until(lambda: not alive(mem.pid), what="the target to end")
    restored = ckpt_json("restore", fifth["id"])
    procs.adopt(restored["pid"])
    assert mem.checksum(restored["pid"]) == expected
    assert first["id"] != fifth["id"]


def test_huge_pages_and_a_stopping_dump(procs, tmp_path):
    """With transparent huge pages the kernel tracks 2 MiB at a time: more is read, nothing is
    lost. A --stop dump (moving a process) uses the parent as well."""
    mem = Memory(procs, tmp_path, "on", SMALL_MIB)
    first = ckpt_json("dump", mem.pid)
    mem.dirty()
    expected = mem.checksum()
    second = ckpt_json("dump", mem.pid, "--stop")
    mem.proc.wait(timeout=30)  # reap it: its PID must be free for the restore
    assert second["dirty_tracking"]["parent"] == first["id"]
    # 256 random pages touch nearly every 2 MiB huge page of 64 MiB: nearly all is read again,
    # yet the store, which dedups 4 KiB pages, takes only the changed ones.
    assert second["pages_dumped"] <= first["pages_dumped"]
    assert second["bytes_stored"] < 8 << 20, second
    record({"test": "thp on, --stop", "size_mib": SMALL_MIB, "dirtied_pages": DIRTY_PAGES,
            "first": {k: first[k] for k in ("pages_dumped", "bytes_stored", "freeze_ms")},
            "second": {k: second[k] for k in ("pages_dumped", "bytes_stored", "freeze_ms")}})
    restored = ckpt_json("restore", second["id"])
    procs.adopt(restored["pid"])
    assert mem.checksum(restored["pid"]) == expected


def _flip_middle_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_parent_gives_a_full_dump_not_a_broken_one(procs, tmp_path, isolated_env):
    """CRIU takes the unchanged pages from the parent without reading them: a parent whose
    pages are known to be damaged, or whose pagemap is damaged, must not be used."""
    mem = Memory(procs, tmp_path, "off", SMALL_MIB)
    first = ckpt_json("dump", mem.pid)
    # The largest pack: CRIU's pages image, whose random pages do not compress (the
    # interpreter's pages, compressed, may be in the dump's own pack).
    _flip_middle_byte(max((isolated_env / "packs").glob("*/*"), key=lambda p: p.stat().st_size))
    assert ckpt("verify", first["id"], check=False).returncode == 6  # found, and recorded
    mem.dirty()
    dumped = ckpt("dump", mem.pid, "--json")
    second = json.loads(dumped.stdout)
    assert "reads every page this time" in dumped.stderr and "recorded as damaged" in dumped.stderr
    assert second["dirty_tracking"]["parent"] is None and second["pages_dumped"] >= SMALL_MIB * 256

    manifest = json.loads((isolated_env / "checkpoints" / f"{second['id']}.json").read_text())
    pagemap = next(f for f in manifest["files"] if f["name"].startswith("pagemap-") and f["size"] > 100)
    _flip_middle_byte(next((isolated_env / "objects" / pagemap["hash"][:2]).glob(pagemap["hash"] + "*")))
    mem.dirty()
    dumped = ckpt("dump", mem.pid, "--json")
    third = json.loads(dumped.stdout)
    assert "reads every page this time" in dumped.stderr and pagemap["name"] in dumped.stderr
    assert third["dirty_tracking"]["parent"] is None and third["pages_dumped"] >= SMALL_MIB * 256

    expected = mem.checksum()
    procs.kill_tree(mem.pid)
    wait_until(lambda: not alive(mem.pid), what="the target to end")
    assert ckpt_json("verify", third["id"])[0]["problems"] == []
    restored = ckpt_json("restore", third["id"])
    procs.adopt(restored["pid"])
    assert mem.checksum(restored["pid"]) == expected


@pytest.mark.parametrize("thp", ["on", "off"])
def test_lazy_restore_of_a_checkpoint_that_took_pages_from_its_parent(procs, tmp_path, thp):
    """Its mappings mix lazy pages with pages taken from the parent (restored first). Those are
    served eagerly; with MADV_HUGEPAGE the restore is not lazy at all (in this VM's Linux 6.1 the
    lazy one never ended)."""
    mem = Memory(procs, tmp_path, thp, SMALL_MIB)
    ckpt_json("dump", mem.pid)
    mem.dirty()
    expected = mem.checksum()
    second = ckpt_json("dump", mem.pid, "--stop")
    mem.proc.wait(timeout=30)
    assert second["dirty_tracking"]["pages_from_parent"] > 0
    restored = ckpt_json("restore", second["id"], "--lazy")
    procs.adopt(restored["pid"])
    if thp == "on":
        assert restored["lazy"] is None
    assert mem.checksum(restored["pid"]) == expected
    if restored["lazy"]:
        server = restored["lazy"]["server_pid"]
        wait_until(lambda: not alive(server), timeout=120, what="the page server to finish")
