"""A tree of many processes (a worker pool: one parent, N children of 2 MiB each), with the real
CRIU: dumped with --stop (the first time, its pages stored while CRIU dumps the rest of the
tree), restored eagerly and lazily; every child comes back under its own PID,
as its parent's child, with its memory intact, and counts on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.helpers import alive, ckpt, ckpt_json, read_lines, state, wait_until

CHILDREN = 25
MIB = 2


def start_pool(procs, tmp_path: Path):
    out = tmp_path / "pool.txt"
    root = procs.start("manytree.py", out, CHILDREN, MIB)
    line = wait_until(lambda: [x for x in read_lines(out) if x.startswith("ready ")], timeout=60,
                      what="the pool to fill its memory")[0]
    pids = [int(p) for p in line.split()[1:]]
    assert pids[0] == root.pid and len(pids) == CHILDREN + 1
    return root, out, pids


def reports(out: Path, root: int) -> dict[int, tuple[int, int, str, int]]:
    """Asks every child to check its memory: by child index, (pid, ppid, ok|bad, counter)."""
    before = len(read_lines(out))
    os.kill(root, signal.SIGUSR1)
    lines = wait_until(lambda: (new := [x for x in read_lines(out)[before:] if x.startswith("child ")])
                       and len(new) >= CHILDREN and new, timeout=60, what="every child to check its memory")
    found = {}
    for line in lines:
        _, index, pid, ppid, verdict, counter = line.split()
        found[int(index)] = (int(pid), int(ppid), verdict, int(counter))
    return found


def parent_of(pid: int) -> int:
    data = Path(f"/proc/{pid}/stat").read_text()
    return int(data[data.rindex(")") + 2:].split()[1])


def dump_and_end(root_pid: int, pids: list[int], popen=None) -> dict:
    dumped = ckpt_json("dump", root_pid, "--stop")
    assert dumped["processes"] == CHILDREN + 1 and dumped["stopped"]
    if popen is not None:
        popen.wait(timeout=10)  # our child: reaped here, or its PID stays taken
    # --stop returns once the tree is dead (reaping the orphans is this machine's init's job)
    assert not any(alive(pid) for pid in pids)
    return dumped


def check_restored(restored: dict, out: Path, pids: list[int], before: dict) -> dict:
    assert restored["pid"] == pids[0]
    assert sorted(int(p) for p in Path(f"/proc/{pids[0]}/task/{pids[0]}/children").read_text().split()) \
        == sorted(pids[1:])
    assert all(parent_of(pid) == pids[0] for pid in pids[1:])
    after = reports(out, pids[0])
    assert sorted(after) == list(range(CHILDREN))
    for index, (pid, ppid, verdict, counter) in after.items():
        assert (pid, ppid, verdict) == (pids[index + 1], pids[0], "ok"), (index, after[index])
        assert counter >= before[index][3]  # it counts on from where it was
    return after


def test_a_pool_of_many_processes_comes_back_whole_eagerly_and_lazily(procs, tmp_path):
    root, out, pids = start_pool(procs, tmp_path)
    before = reports(out, root.pid)
    assert all(verdict == "ok" for _, _, verdict, _ in before.values())

    first = dump_and_end(root.pid, pids, root)
    # A first dump that ends its tree stores each process's images while CRIU dumps the next
    # (ckpt/dump/early_ingest.py): at least its pages image and its core image each.
    assert first["images_stored_early"] >= 2 * (CHILDREN + 1), first
    # Each child's 2 MiB of random data stays where CRIU wrote it: its pages image became a
    # pack with every other page punched out (a sparse file; docs/design.md, "Write order"),
    # which the restores below read back.
    packs = [path.stat() for path in Path(os.environ["CKPT_STORE"]).glob("packs/*/*")]
    assert sum(st.st_blocks * 512 < st.st_size for st in packs) >= CHILDREN, len(packs)
    restored = ckpt_json("restore", first["id"], "--eager")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is None
    after = check_restored(restored, out, pids, before)

    # Again, from the restored tree (its parent is not this test): lazily this time.
    second = dump_and_end(pids[0], pids)
    assert second["images_stored_early"] == 0  # a next dump: its pages were streamed to ckpt instead
    wait_until(lambda: all(state(pid) is None for pid in pids), timeout=30, what="the tree's PIDs to be free")
    restored = ckpt_json("restore", second["id"], "--lazy")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is not None
    check_restored(restored, out, pids, after)
    assert ckpt("verify", "--all").returncode == 0
