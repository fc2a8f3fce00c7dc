"""Full restores whose memory ckpt copies into the tree through userfaultfd, before it runs
(ckpt/restore/uffdfill.py): every page comes back, in every process of the tree, nothing is
left running or staged, and a damaged segment stops the restore before any process runs."""

import os
import signal
from pathlib import Path

from tests.helpers import alive, ckpt, ckpt_json, read_lines, tree_pids, wait_until


def sums_of(pid: int, out, processes: int) -> dict[str, str]:
    """Asks every process of the tree for its checksum: {index: checksum}."""
    before = len(read_lines(out))
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: len(read_lines(out)) >= before + processes, timeout=60, what="every process's checksum")
    return {line.split()[0]: line.split()[1] for line in read_lines(out)[before:]}


def started_tree(procs, tmp_path, children: int, mib: int):
    out = tmp_path / "sums.txt"
    target = procs.start("forked_mem.py", out, children, mib)
    wait_until(lambda: len(read_lines(out)) == children + 1, timeout=60, what="every process to fill its memory")
    return target, out, sums_of(target.pid, out, children + 1)


def test_an_eager_restore_copies_every_page_of_every_process_in(procs, tmp_path, isolated_env):
    target, out, original = started_tree(procs, tmp_path, children=3, mib=32)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)

    restored = ckpt_json("restore", dumped["id"], "--eager")
    procs.adopt(restored["pid"])
    assert restored["lazy"] is None
    filled = restored["filled"]
    assert filled is not None and filled["bytes"] >= 4 * (32 << 20), restored
    assert sums_of(restored["pid"], out, 4) == original, "a process's memory is not what was dumped"
    counters = [int(line.split()[2]) for line in read_lines(out)[-4:]]
    assert all(c > 0 for c in counters)
    assert not any((isolated_env / "tmp").iterdir()), "the restore left staged images"
    # Nothing of the filler is left: no socket, and no process of ckpt's beside the tree.
    assert not list((isolated_env / "logs" / dumped["id"]).glob("fill-*/lazy-pages.socket"))


def test_the_pages_image_path_gives_the_same_memory(procs, tmp_path, isolated_env):
    target, out, original = started_tree(procs, tmp_path, children=1, mib=32)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    restored = ckpt_json("restore", dumped["id"], "--eager", env={"CKPT_UFFD_FILL": "0"})
    procs.adopt(restored["pid"])
    assert restored["filled"] is None and restored["lazy"] is None
    assert sums_of(restored["pid"], out, 2) == original


def test_a_damaged_segment_stops_the_restore_before_any_process_runs(procs, tmp_path, isolated_env):
    target, out, _ = started_tree(procs, tmp_path, children=1, mib=32)
    tree = [target.pid, *map(int, open(f"/proc/{target.pid}/task/{target.pid}/children").read().split())]
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    pack = max((isolated_env / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
    with open(pack, "r+b") as f:  # in the middle of the pack: memory restored lazily, so filled in
        f.seek(pack.stat().st_size // 2)
        span = f.read(8)
        f.seek(pack.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in span))
    lines = len(read_lines(out))

    proc = ckpt("restore", dumped["id"], "--eager", check=False)
    assert proc.returncode == 6, proc.stderr  # a damaged checkpoint
    assert "damaged" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # No process of the tree ran: none wrote, and the PIDs are free again.
    wait_until(lambda: not any(alive(pid) for pid in tree), timeout=10, what="the tree's PIDs to be free")
    assert len(read_lines(out)) == lines
    assert not any((isolated_env / "tmp").iterdir()), "the failed restore left staged images"


def test_pages_of_two_mappings_side_by_side_come_back(procs, tmp_path):
    """CRIU dumps the pages of adjacent mappings as one run; one UFFDIO_COPY cannot cross from
    one mapping into the next (a JVM's heap crashed on the zeros left there)."""
    out = tmp_path / "sums.txt"
    target = procs.start("split_mapping.py", out, 32)
    wait_until(lambda: read_lines(out), timeout=60, what="the target to fill its memory")
    original = read_lines(out)[0].split()[0]
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    restored = ckpt_json("restore", dumped["id"], "--eager")
    procs.adopt(restored["pid"])
    assert restored["filled"] is not None and restored["filled"]["bytes"] >= 32 << 20, restored
    before = len(read_lines(out))
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: len(read_lines(out)) > before, timeout=30, what="the restored target's checksum")
    assert read_lines(out)[-1].split()[0] == original


def test_children_sharing_their_parents_memory_get_it_back_shared(procs, tmp_path):
    """A pool of workers forked from one parent holds mostly the parent's pages: CRIU gives them
    back shared (copy-on-write), read from the root's pages image; only each worker's own pages
    are copied in (copied in one by one, each worker would hold a private copy of the rest)."""
    # Their own pages (5 MiB each) are worth copying in: more than FILL_MIN_BYTES in all.
    target, out, original = started_tree(procs, tmp_path, children=4, mib=5)
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    restored = ckpt_json("restore", dumped["id"], "--eager", env={"CKPT_LAZY_MIN_MIB": "1024"})
    procs.adopt(restored["pid"])
    assert restored["lazy"] is None and restored["shared_pages"], restored
    assert restored["filled"] is not None and restored["filled"]["pages"] >= 4 * 5 * 256, restored
    assert sums_of(restored["pid"], out, 5) == original
    rss = pss = 0
    for pid in tree_pids(restored["pid"]):
        rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        rss += int(rollup["Rss"].split()[0])
        pss += int(rollup["Pss"].split()[0])
    # Private copies: Pss as large as Rss. Shared, the interpreter's pages (several MiB) count
    # once in all, not once per process.
    assert rss - pss > 4 * 2048, (pss, rss)
