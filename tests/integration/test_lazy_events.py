"""A lazy restore while the restored tree forks, moves, drops and unmaps memory not filled in
yet (tests/fixtures/lazy_events.py): the userfaultfd events FORK, REMAP, REMOVE and UNMAP. The
memory kept must be the dumped bytes, the memory dropped must read as zeros (never the
checkpoint's old bytes), at once and after the page server has filled in everything else."""

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import alive, ckpt_json, read_lines, wait_until
from tests.integration.test_lazy import wait_for_server_end

SIZE_MIB = 512  # 4 regions of 128 MiB: lazy (CKPT_LAZY_MIN_MIB is 64), and still being filled in when the events come


def resident_mib(pid: int) -> int:
    """How much of the four regions is in memory (their mappings' Rss in /proc/PID/smaps)."""
    resident, region = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            region = end - start == (SIZE_MIB << 20) // 4
        elif line.startswith("Rss:") and region:
            resident += int(line.split()[1])
    return resident >> 10


def fields(line: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in line.split()[1:])


def line_of(out, kind: str) -> dict[str, str] | None:
    found = [fields(line) for line in read_lines(out) if line.split()[0] == kind]
    return found[-1] if found else None


def assert_state(state: dict[str, str], sums: dict[str, str], when: str) -> None:
    """The bytes kept are the dumped ones; the grown tail of region 1, the dropped middle of
    region 2 and the new region 3 are zeros."""
    kept = {key: state[key] for key in ("r0", "r1", "r2head", "r2tail")}
    assert kept == {key: sums[key] for key in kept}, f"{when}: the bytes kept differ from the dumped ones"
    zeros = {key: state[key] for key in ("r1tail_zeros", "r2middle_zeros", "r3_zeros")}
    assert zeros == dict.fromkeys(zeros, "1"), f"{when}: memory dropped or new is not zeros: {zeros}"


@pytest.mark.parametrize("delay", ["at once", "after a random delay"])
def test_lazy_restore_while_the_tree_forks_moves_drops_and_unmaps_its_memory(procs, tmp_path, delay):
    out = tmp_path / "events.txt"
    target = procs.start("lazy_events.py", out, SIZE_MIB)
    sums = fields(wait_until(lambda: read_lines(out), timeout=60, what="lazy_events to fill its memory")[0])
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    out.unlink()

    restored = ckpt_json("restore", dumped["id"], "--lazy", "--no-wait")
    pid, lazy = restored["pid"], restored["lazy"]
    procs.adopt(pid)
    procs.pids.add(lazy["server_pid"])
    assert lazy["bytes"] >= SIZE_MIB << 20, restored
    pause = round(random.uniform(0.0, 0.5), 2) if delay != "at once" else 0.0
    time.sleep(pause)
    resident = resident_mib(pid)
    os.kill(pid, signal.SIGUSR1)

    wait_until(lambda: line_of(out, "parent") and line_of(out, "child"), timeout=60,
               what=f"the restored tree's events ({pause} s after the restore)")
    parent, child = line_of(out, "parent"), line_of(out, "child")
    assert child == {"r0": sums["r0"], "r1": sums["r1"]}, "the forked child's copies differ from the dumped bytes"
    assert parent["child_exit"] == "0", "the forked child did not end well (a negative code: a signal)"
    assert parent["moved"] == "1", "region 1 grew in place: no REMAP event"
    assert parent["r3_same_place"] == "1", "the new region 3 is not where the one unmapped was"
    assert parent["readers"].split(",") == [sums["r0"]] * 2, "a thread read other bytes than the dumped ones"
    assert_state(parent, sums, "right after the events")

    log = wait_for_server_end(procs, lazy)
    # Copied may be more pages than the checkpoint's (the forked child's missing pages are
    # copied into it too) or fewer (what the tree dropped is not copied). A fork is followed
    # unless the child was forked after its parent had every page.
    found = re.fullmatch(r"done; \d+ pages copied of \d+ in \d+ copies \(\d+ faults, (\d+) forks followed\) in "
                         r"[\d.]+ s(; not protected from the OOM killer \(.*\))?\n", log)
    assert found, log
    if resident < SIZE_MIB // 4:  # most pages were missing at the fork: the child's were followed
        assert found[1] == "1", log
    # Every page is in now: none of the background copy went where the tree dropped memory.
    os.kill(pid, signal.SIGUSR2)
    after = wait_until(lambda: line_of(out, "after"), timeout=30, what="the state once the page server is done")
    assert_state(after, sums, "once the page server is done")
    assert int(after["counter"]) > int(parent["counter"]) > 0
    assert alive(pid)
    print(f"{delay} ({pause} s): {resident} MiB of {SIZE_MIB} in at the events, done in {parent['changed_in']}; "
          f"page server: {log.strip()}")
