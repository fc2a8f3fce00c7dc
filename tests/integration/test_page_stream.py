"""Dumps whose pages CRIU streams to ckpt (ckpt/dump/pagestream.py), with the real CRIU: the
store gets exactly what the pages-image path gives it, restores bring the memory back, shared
memory and several processes included, and only changed pages are kept while frozen."""

from __future__ import annotations

import os
import signal

from tests.helpers import alive, ckpt, ckpt_json, read_lines, state, wait_until

MIB = 16


def sums(out) -> dict[int, str]:
    """The newest checksum each process reported."""
    found: dict[int, str] = {}
    for line in read_lines(out):
        if line.startswith("sum "):
            _, pid, digest, _ = line.split()
            found[int(pid)] = digest
    return found


def report(out, pids: list[int]) -> dict[int, str]:
    before = len([line for line in read_lines(out) if line.startswith("sum ")])
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: len([line for line in read_lines(out) if line.startswith("sum ")]) >= before + len(pids),
               what="the tree to report its checksums")
    return sums(out)


def start_tree(procs, tmp_path):
    out = tmp_path / "tree.txt"
    root = procs.start("shared_mem_tree.py", out, MIB)
    line = wait_until(lambda: [x for x in read_lines(out) if x.startswith("ready ")], timeout=30, what="the tree")[0]
    _, parent, child = line.split()
    wait_until(lambda: any(x.startswith("child ") for x in read_lines(out)), what="the child")
    assert int(parent) == root.pid
    return root, out, [root.pid, int(child)]


def stop(pids: list[int]) -> None:
    """SIGSTOP, and wait until each is stopped (the signal takes effect asynchronously). Each
    is kept on one CPU: CRIU's parasite runs in the process, and the kernel writes the CPU it
    ran on into the process's rseq area (a page of libc's thread data differed between two
    dumps of a stopped process, 1 and 0 at offsets 1184 and 1188, through either path). Then
    one dump, after which the CPU written is that one CPU."""
    for pid in pids:
        os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
        os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: all(state(pid) == "T" for pid in pids), what="the tree to stop")
    ckpt_json("dump", pids[0], env={"CKPT_PAGE_STREAM": "0"})


def pages_images(checkpoint_id: str) -> dict[str, str]:
    """Each pagemap and pages image of a checkpoint, by name, with the digest naming its
    contents (for a pages image: its page list)."""
    files = ckpt_json("show", checkpoint_id)["files"]
    return {f["name"]: f["hash"] for f in files if f["name"].startswith(("pagemap-", "pages-"))}


def test_a_streamed_dump_stores_what_the_pages_image_path_stores(procs, tmp_path):
    root, out, pids = start_tree(procs, tmp_path)
    stop(pids)  # nothing changes between the two dumps
    through_image = ckpt_json("dump", root.pid, env={"CKPT_PAGE_STREAM": "0"})
    streamed = ckpt_json("dump", root.pid)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)

    images = pages_images(streamed["id"])
    assert any(name.startswith("pagemap-shmem-") for name in images), images  # shared memory streamed too
    assert len([name for name in images if name.startswith("pages-")]) == 3  # two processes, one mapping
    assert images == pages_images(through_image["id"])
    assert streamed["pages"] == through_image["pages"] >= 3 * MIB * 256
    assert streamed["pages_new"] == 0  # every page was stored by the first dump
    dump_log = (tmp_path / "store" / "logs" / streamed["id"] / "dump.log").read_text()
    assert "Dumping pages" in dump_log and "TCP_NODELAY" in dump_log  # CRIU did talk to a page server


def test_a_streamed_tree_restores_with_its_memory_and_only_changes_are_kept(procs, tmp_path):
    root, out, pids = start_tree(procs, tmp_path)
    first = ckpt_json("dump", root.pid)
    os.kill(root.pid, signal.SIGUSR2)
    wait_until(lambda: any(x.startswith("dirtied ") for x in read_lines(out)), what="the parent to rewrite pages")
    expected = report(out, pids)
    second = ckpt_json("dump", root.pid, "--stop")
    # Each process's private pages and the shared ones: 1 page in 97 rewritten of each.
    changed = 2 * -(-MIB * 256 // 97)
    assert first["pages_new"] >= 3 * MIB * 256
    assert changed <= second["pages_new"] < changed + 600, second  # plus the interpreters' own pages
    root.wait(timeout=10)  # our child: reaped here, or its PID stays taken
    wait_until(lambda: not any(alive(pid) for pid in pids), what="the tree to end")

    restored = ckpt_json("restore", second["id"], "--eager")
    assert restored["pid"] == root.pid
    procs.adopt(root.pid)
    assert report(out, pids) == expected
    # And it runs on: the shared mapping is still shared (the parent's change shows in the child).
    os.kill(root.pid, signal.SIGUSR2)
    wait_until(lambda: len([x for x in read_lines(out) if x.startswith("dirtied ")]) == 2, what="a second rewrite")
    after = report(out, pids)
    assert after[pids[0]] != expected[pids[0]] and after[pids[1]] != expected[pids[1]]
    assert ckpt("verify", "--all").returncode == 0


def test_a_dump_through_the_pages_image_after_streamed_ones_dedups_against_them(procs, tmp_path):
    root, out, pids = start_tree(procs, tmp_path)
    ckpt_json("dump", root.pid)
    stop(pids)
    streamed = ckpt_json("dump", root.pid)
    through_image = ckpt_json("dump", root.pid, env={"CKPT_PAGE_STREAM": "0"})
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    assert through_image["pages_new"] == 0
    assert pages_images(through_image["id"]) == pages_images(streamed["id"])
