"""Lazy restores (ckpt/lazy.py): the tree runs before its memory is back, a page server fills it
in from the store. Each test checks the memory itself, not only that the tree runs."""

import json
import os
import re
import signal
from pathlib import Path

from tests.helpers import alive, ckpt, ckpt_json, dumped_file_reader, read_lines, wait_until

LAZY_RECORDS = Path("/run/ckpt/lazy")


def started_bigmem(procs, tmp_path, mib: int):
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, mib)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem to fill its memory")
    return target, out, read_lines(out)[0].split()[0]


def wait_for_server_end(procs, lazy: dict) -> str:
    """Waits for the page server to finish; returns its log line."""
    server = lazy["server_pid"]
    procs.pids.add(server)  # ended by the test's clean-up should anything go wrong
    wait_until(lambda: not alive(server), timeout=120, what="the page server to finish")
    return (Path(lazy["log"]).parent / "page-server.log").read_text()


def test_lazy_restore_brings_back_every_page_while_the_tree_runs(procs, tmp_path, isolated_env):
    target, out, original_sum = started_bigmem(procs, tmp_path, 256)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()

    restored = ckpt_json("restore", dumped["id"])  # 256 MiB: lazily by default
    procs.adopt(restored["pid"])
    lazy = restored["lazy"]
    assert lazy is not None and lazy["bytes"] >= 256 << 20, restored
    # Hashing touches every page, most of them still with the page server.
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), timeout=60, what="restored bigmem to report")
    restored_sum, counter = read_lines(out)[0].split()
    assert restored_sum == original_sum and int(counter) > 0

    log = wait_for_server_end(procs, lazy)
    assert re.fullmatch(rf"done; {lazy['pages']} pages served of {lazy['pages']} in \d+ requests in [\d.]+ s; "
                        r"daemon exit code 0\n", log), log
    assert alive(restored["pid"])
    assert not any((isolated_env / "tmp").iterdir()), "the page server left its staged images"
    assert not any(str(lazy["server_pid"]) in p.name for p in LAZY_RECORDS.glob("*.json"))
    # The page server held the store's shared lock; it is free again.
    ckpt("prune", env={"CKPT_LOCK_TIMEOUT": "5"})


def test_eager_restore_writes_every_page_before_the_tree_runs(procs, tmp_path):
    target, out, original_sum = started_bigmem(procs, tmp_path, 128)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()
    restored = ckpt_json("restore", dumped["id"], "--eager")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is None
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), timeout=60, what="restored bigmem to report")
    assert read_lines(out)[0].split()[0] == original_sum


def test_dump_right_after_a_lazy_restore_holds_every_page(procs, tmp_path):
    """A dump while pages are still arriving would record them as missing: it waits."""
    target, out, original_sum = started_bigmem(procs, tmp_path, 384)
    first = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    restored = ckpt_json("restore", first["id"], "--lazy")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is not None
    second = ckpt("dump", str(restored["pid"]), "--stop", "--json")
    procs.pids.add(restored["lazy"]["server_pid"])
    assert "done" in wait_for_server_end(procs, restored["lazy"])
    wait_until(lambda: not alive(restored["pid"]), timeout=30, what="--stop to end the restored tree")
    out.unlink()

    again = ckpt_json("restore", json.loads(second.stdout)["id"], "--eager")
    procs.adopt(again["pid"])
    os.kill(again["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem restored from the second checkpoint")
    assert read_lines(out)[0].split()[0] == original_sum


def test_failed_lazy_restore_leaves_no_page_server_and_nothing_staged(procs, tmp_path, isolated_env):
    data, _, dumped = dumped_file_reader(procs, tmp_path, lines=1000, records=3)
    data.unlink()  # CRIU's restore fails: the file it reopens is gone

    before = {p.name for p in LAZY_RECORDS.glob("*.json")}
    failed = ckpt("restore", dumped["id"], "--lazy", check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert f"is gone: {data}" in failed.stderr
    assert {p.name for p in LAZY_RECORDS.glob("*.json")} <= before, "a page server outlived the failed restore"
    assert not any((isolated_env / "tmp").iterdir()), "the failed restore left its staged images"
    ckpt("prune", env={"CKPT_LOCK_TIMEOUT": "5"})  # no page server holds the store's lock


def test_lazy_restore_of_memory_in_huge_pages(procs, tmp_path):
    """A MADV_HUGEPAGE mapping whose pages are all lazy: the daemon fills it 4 KiB at a time."""
    out = tmp_path / "mem.txt"
    target = procs.start("dirtymem.py", out, 64, "on", 16)
    wait_until(lambda: "ready" in read_lines(out), timeout=60, what="dirtymem to fill its memory")
    os.kill(target.pid, signal.SIGUSR1)
    wait_until(lambda: any(x.startswith("sum ") for x in read_lines(out)), what="the checksum")
    expected = [x for x in read_lines(out) if x.startswith("sum ")][0].split()[1]
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()
    restored = ckpt_json("restore", dumped["id"], "--lazy")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is not None and restored["lazy"]["bytes"] >= 64 << 20
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: any(x.startswith("sum ") for x in read_lines(out)), timeout=60, what="the restored checksum")
    assert [x for x in read_lines(out) if x.startswith("sum ")][0].split()[1] == expected
    assert "done" in wait_for_server_end(procs, restored["lazy"])
