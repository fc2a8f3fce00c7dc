"""A full restore of a pool of workers forked from one parent (ckpt/restore/treeshare.py): the
pages the workers inherited are laid out once, in the root's pages image, and CRIU reads them
from there for every worker (the parent images directory: without it, those pages would be
missing and the restore would fail); each process's memory comes back as it was, and every
process counts on. (How many of them CRIU gives back shared, copy-on-write, is CRIU's own
choice, the same as from whole pages images: measured, it shares the interpreter's pages of
such a pool but copies a 24 MiB mapping each child inherited untouched, restored by raw CRIU
too.)"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import ckpt_json, read_lines, wait_until
from tests.integration.test_uffd_fill import sums_of

CHILDREN = 3
OWN_MIB = 6  # 18 MiB of the workers' own in all: worth copying in (FILL_MIN_BYTES)
INHERITED_MIB = 24
REWRITTEN = 512  # every fourth of a child's first 512 inherited pages: its own bytes


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def restored_pool(procs, root: int, popen=None, env: dict | None = None) -> tuple[int, dict]:
    dumped = ckpt_json("dump", root, "--stop")
    if popen is not None:
        popen.wait(timeout=10)  # our child: reaped here, or its PID stays taken
    restored = ckpt_json("restore", dumped["id"], "--eager", env=env)
    procs.adopt(restored["pid"])
    return restored["pid"], restored


def check(restored: dict, root: int, out: Path, original: dict, filled: bool) -> None:
    assert restored["lazy"] is None, restored
    # Every worker's inherited pages (but those it rewrote), left out of its own pages image.
    assert restored["shared_pages"] >= CHILDREN * ((INHERITED_MIB << 8) - REWRITTEN // 4), restored
    if filled:
        # Each worker's own pages (its data, the pages it rewrote, the interpreter's it
        # dirtied) copied in through userfaultfd; none of those it shares with the root.
        assert restored["filled"]["pages"] >= CHILDREN * ((OWN_MIB << 8) + REWRITTEN // 4), restored
        assert restored["filled"]["pages"] < restored["shared_pages"], restored
    else:
        assert restored["filled"] is None, restored
    assert sums_of(root, out, CHILDREN + 1) == original, "a process's memory is not what was dumped"
    assert len(children_of(root)) == CHILDREN


def test_a_pools_inherited_memory_is_laid_out_once_and_comes_back_shared(procs, tmp_path, isolated_env):
    out = tmp_path / "sums.txt"
    target = procs.start("forked_mem.py", out, CHILDREN, OWN_MIB, INHERITED_MIB, REWRITTEN)
    wait_until(lambda: len(read_lines(out)) == CHILDREN + 1, timeout=60, what="every process to fill its memory")
    original = sums_of(target.pid, out, CHILDREN + 1)
    counters = {line.split()[0]: int(line.split()[2]) for line in read_lines(out)[-(CHILDREN + 1):]}

    root, restored = restored_pool(procs, target.pid, target)
    check(restored, root, out, original, filled=True)
    later = {line.split()[0]: int(line.split()[2]) for line in read_lines(out)[-(CHILDREN + 1):]}
    assert all(later[index] >= counters[index] for index in counters), "a process did not count on"
    assert not any((isolated_env / "tmp").iterdir()), "the restore left staged images"

    # The same with every process's own pages through its pages image (no userfaultfd fill).
    root, restored = restored_pool(procs, root, env={"CKPT_UFFD_FILL": "0"})
    check(restored, root, out, original, filled=False)
