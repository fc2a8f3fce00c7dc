"""Lazy restores (ckpt/restore/lazy.py): the tree runs before its memory is back, a page server fills it
in from the store. Each test checks the memory itself, not only that the tree runs."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT, alive, echo_server, ckpt, ckpt_json, dumped_file_reader, read_lines, wait_until

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
    assert re.fullmatch(rf"done; {lazy['pages']} pages copied of {lazy['pages']} in \d+ copies \(\d+ faults, 0 forks "
                        r"followed\) in [\d.]+ s(; not protected from the OOM killer \(.*\))?\n", log), log
    assert alive(restored["pid"])
    assert not any((isolated_env / "tmp").iterdir()), "the page server left its staged images"
    assert not any(str(lazy["server_pid"]) in p.name for p in LAZY_RECORDS.glob("*.json"))
    # The page server held the store's shared lock; it is free again.
    ckpt("prune", env={"CKPT_LOCK_TIMEOUT": "5"})


def test_lazy_restore_through_crius_own_daemon(procs, tmp_path):
    """CKPT_LAZY_FILL=0: CRIU's lazy-pages daemon fills the memory in, asking ckpt's page server."""
    target, out, original_sum = started_bigmem(procs, tmp_path, 96)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()
    restored = ckpt_json("restore", dumped["id"], "--lazy", "--no-wait", env={"CKPT_LAZY_FILL": "0"})
    procs.adopt(restored["pid"])
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), timeout=60, what="restored bigmem to report")
    assert read_lines(out)[0].split()[0] == original_sum
    log = wait_for_server_end(procs, restored["lazy"])
    assert re.match(rf"done; {restored['lazy']['pages']} pages served of {restored['lazy']['pages']} in \d+ "
                    r"requests \(daemon exit code 0\) in [\d.]+ s", log), log


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
    server, port, log = echo_server(procs, tmp_path)
    dumped = ckpt_json("dump", server.pid, "--stop")
    server.wait(timeout=10)

    before = {p.name for p in LAZY_RECORDS.glob("*.json")}
    # CRIU's restore fails once the page server runs: the server's port is taken (a missing
    # file would be refused before, by the host check).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        failed = ckpt("restore", dumped["id"], "--lazy", check=False)
    assert failed.returncode == 5 and "Traceback" not in failed.stderr, failed.stderr
    assert {p.name for p in LAZY_RECORDS.glob("*.json")} <= before, "a page server outlived the failed restore"
    assert not any((isolated_env / "tmp").iterdir()), "the failed restore left its staged images"
    ckpt("prune", env={"CKPT_LOCK_TIMEOUT": "5"})  # no page server holds the store's lock


def test_lazy_restore_refused_by_the_host_check_starts_no_page_server(procs, tmp_path, isolated_env):
    data, _, dumped = dumped_file_reader(procs, tmp_path, lines=1000, records=3)
    data.unlink()
    before = {p.name for p in LAZY_RECORDS.glob("*.json")}
    refused = ckpt("restore", dumped["id"], "--lazy", check=False)
    assert refused.returncode == 10 and f"{data} is missing" in refused.stderr, refused.stderr
    assert {p.name for p in LAZY_RECORDS.glob("*.json")} <= before, "a page server was started"
    assert not list((isolated_env / "logs" / dumped["id"]).glob("lazy-*")), "a lazy restore was begun"
    assert not any((isolated_env / "tmp").iterdir()), "the refused restore left its staged images"


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


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_page_server_killed_midway_never_leaves_the_tree_on_missing_memory(procs, tmp_path, isolated_env):
    """The page server and its daemon killed (SIGKILL) at several moments of a lazy restore of a
    1 GiB process that checks its memory: it never reports a wrong checksum (unwatched, the
    memory not filled in yet would read as zeros), and ckpt says what happened."""
    target, out, original_sum = started_bigmem(procs, tmp_path, 1024)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    # (from when, seconds): from the start of `ckpt restore`, or from when the tree runs
    moments = [("start", 0.1), ("start", 0.5), ("start", 1.5), ("running", 0.0), ("running", 0.5),
               ("running", round(random.uniform(0.0, 2.0), 2))]
    outcomes = []
    for anchor, moment in moments:
        out.unlink(missing_ok=True)
        before = {p.name for p in LAZY_RECORDS.glob("*.json")}
        began = time.monotonic()
        restore = subprocess.Popen([sys.executable, "-m", "ckpt", "restore", dumped["id"], "--lazy", "--json"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        server = None
        while time.monotonic() - began < 60 and server is None:  # the server's record names it
            for path in LAZY_RECORDS.glob("*.json"):
                if path.name not in before and f'"{dumped["id"]}"' in path.read_text():
                    server = int(path.name.split(".")[0])
            time.sleep(0.005)
        assert server is not None, "no page server started"
        procs.pids.add(server)
        daemon = _children(server)
        if anchor == "start":
            time.sleep(max(0.0, began + moment - time.monotonic()))
            for pid in [server, *daemon]:
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = restore.communicate(timeout=120)
        if restore.returncode != 0:  # killed before CRIU was done: the restore fails, and says so
            assert anchor == "start" and "Traceback" not in stderr and "lazy" in stderr, stderr
            outcomes.append((anchor, moment, "restore failed"))
            continue
        restored = json.loads(stdout)
        procs.adopt(restored["pid"])
        work_dir = Path(restored["lazy"]["log"]).parent
        try:
            os.kill(restored["pid"], signal.SIGUSR1)  # hashing touches every page
        except ProcessLookupError:
            pass
        if anchor == "running":
            time.sleep(moment)
            for pid in [server, *daemon]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        wait_until(lambda: (work_dir / "lazy-failure.json").exists() or read_lines(out), timeout=60,
                   what="a checksum or a failure record")
        for line in read_lines(out):
            assert line.split()[0] == original_sum, f"wrong memory after a kill at {anchor} + {moment} s"
        failure = work_dir / "lazy-failure.json"
        if not failure.exists():
            outcomes.append((anchor, moment, "all pages were in"))
            procs.kill_tree(restored["pid"])
            continue
        record = json.loads(failure.read_text())
        assert restored["pid"] in record["killed"] and "killed so that it never ran on missing memory" in \
            record["message"], record
        wait_until(lambda: not alive(restored["pid"]), timeout=10, what="the tree to be dead")
        wait_until(lambda: not alive(restored["lazy"]["watcher_pid"]), timeout=10, what="the watcher to end")
        outcomes.append((anchor, moment, "tree killed"))
    print(outcomes)
    assert any(outcome == "tree killed" for _, _, outcome in outcomes), outcomes
    killed = sum(outcome == "tree killed" for _, _, outcome in outcomes)
    shown = ckpt("show", dumped["id"], "--json")
    assert len(json.loads(shown.stdout)["lazy_restore_failures"]) == killed
    assert "lost its page server before the memory was back" in shown.stderr
    listed = ckpt("list", "--json")
    assert [row["lazy_restore_failures"] for row in json.loads(listed.stdout)] == [killed]
    assert listed.stderr.count("lost its page server") == killed


def test_criu_dies_with_ckpt_and_the_target_runs_on(procs, tmp_path):
    """kill -9 of `ckpt dump` while its CRIU is stopped at several moments of the dump: CRIU
    gets SIGKILL at once (PR_SET_PDEATHSIG; without it CRIU would stay, seizing the target,
    until it next talks to ckpt), and the target, detached by the kernel, runs on with its
    memory whole."""
    target, out, original_sum = started_bigmem(procs, tmp_path, 64)
    stopped = []
    for delay in (0.0, 0.05, 0.15, 0.3, round(random.uniform(0.0, 0.5), 2)):
        dump = subprocess.Popen([sys.executable, "-m", "ckpt", "dump", str(target.pid)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        criu = wait_until(lambda: [c for c in _children(dump.pid) if b"swrk" in _cmdline(c)],
                          timeout=30, interval=0.002, what="ckpt's CRIU")[0]
        time.sleep(delay)
        try:
            os.kill(criu, signal.SIGSTOP)
        except ProcessLookupError:  # this dump's CRIU was done before the moment chosen
            dump.wait()
            continue
        stopped.append(delay)
        procs.pids.add(criu)
        # A helper CRIU forked (a child of the same image, `criu swrk` too) does not die with
        # ckpt: it is ended at teardown, by PID, with CRIU (once a stopped one was left behind).
        procs.pids.update(_children(criu))
        dump.kill()
        dump.wait()
        wait_until(lambda: not alive(criu), timeout=2, what=f"CRIU to die with ckpt ({delay} s into the dump)")
        lines = len(read_lines(out))
        os.kill(target.pid, signal.SIGUSR1)
        wait_until(lambda: len(read_lines(out)) > lines, timeout=30, what="the target to answer")
        assert read_lines(out)[-1].split()[0] == original_sum
    assert len(stopped) >= 2, f"CRIU was stopped at only {stopped} s into the dump"


def test_restore_wait_reports_the_last_page(procs, tmp_path):
    """--wait: the command returns once every page is back, with the times in --json."""
    target, out, original_sum = started_bigmem(procs, tmp_path, 96)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()
    restored = ckpt_json("restore", dumped["id"], "--lazy", "--wait")
    procs.adopt(restored["pid"])
    lazy = restored["lazy"]
    procs.pids.add(lazy["server_pid"])
    figures = lazy["figures"]
    assert figures["pages"] == lazy["pages"] and figures["bytes_fetched"] == 0, figures
    assert figures["last_page_ms"] >= figures["time_to_running_ms"] == restored["duration_ms"], figures
    # Every page is back already: the page server is done, and the memory is the dumped one.
    wait_until(lambda: not alive(lazy["server_pid"]), timeout=10, what="the page server to end")
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), timeout=60, what="restored bigmem to report")
    assert read_lines(out)[0].split()[0] == original_sum
