"""Incremental storage with real processes: ten checkpoints of a changing process, forget most,
prune, and every remaining checkpoint restores with its own state (kill -9 during prune:
test_kill_phases.py)."""

import json
import os
import signal
import time

from tests.helpers import env_settings, ckpt, ckpt_json, read_lines, wait_until


def test_ten_checkpoints_forget_prune_and_restore_each(procs, tmp_path, isolated_env):
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 32)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem")
    dumps = []
    for _ in range(10):
        dumps.append(ckpt_json("dump", target.pid, "--name", "mem"))
        time.sleep(0.2)
    first, later = dumps[0], dumps[1:]
    assert first["bytes_stored"] >= 32 << 20
    for d in later:
        # 32 MiB of unchanged random data is not stored again.
        assert d["bytes_stored"] < 4 << 20, d
        assert d["bytes_dedup"] >= 32 << 20
    forgotten = ckpt_json("forget", "--name", "mem", "--keep-last", "3")
    assert [r["id"] for r in forgotten["remove"]] == [d["id"] for d in dumps[:7]]
    before = sum(f.stat().st_size for f in isolated_env.rglob("*") if f.is_file())
    pruned = ckpt_json("prune")
    after = sum(f.stat().st_size for f in isolated_env.rglob("*") if f.is_file())
    assert pruned["bytes_freed"] > 0 and after < before
    assert [c["id"] for c in ckpt_json("list")] == [d["id"] for d in dumps[7:]]
    assert all(not r["problems"] for r in ckpt_json("verify", "--all"))

    procs.kill_tree(target.pid)
    out.unlink()
    original = None
    for d in dumps[7:]:
        restored = ckpt_json("restore", d["id"])
        procs.adopt(restored["pid"])
        os.kill(restored["pid"], signal.SIGUSR1)
        line = wait_until(lambda: read_lines(out), what="checksum")[0]
        checksum, counter = line.split()
        original = original or checksum
        assert checksum == original  # the 32 MiB survived dedup, forget and prune
        procs.kill_tree(restored["pid"])
        out.unlink()
        wait_until(lambda: not os.path.exists(f"/proc/{restored['pid']}"), what="PID free")


def test_diff_names_changed_pages_and_file_offsets(procs, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("".join(f"line{i:05d}\n" for i in range(10000)))
    target = procs.start("file_reader.py", data, tmp_path / "read.txt")
    wait_until(lambda: read_lines(tmp_path / "read.txt"), what="reader")
    a = ckpt_json("dump", target.pid)["id"]
    time.sleep(0.5)
    b = ckpt_json("dump", target.pid)["id"]
    result = ckpt_json("diff", a, b)
    (proc,) = result["per_process"]
    assert proc["pid"] == target.pid and proc["pages"]["changed"] > 0
    (change,) = [c for c in proc["files"]["changed"] if c["to"].get("path") == str(data)]
    assert change["to"]["offset"] > change["from"]["offset"]
    text = ckpt("diff", a, b).stdout
    assert "pages:" in text and str(data) in text


def test_damage_found_by_verify_is_not_reused_and_heals(procs, tmp_path, isolated_env):
    """A damaged segment must not spread to the next checkpoint of the same memory, and the
    fresh copy that next dump stores makes the damaged checkpoint restorable again."""
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 16)
    original = wait_until(lambda: read_lines(out), timeout=60, what="bigmem")[0].split()[0]
    first = ckpt_json("dump", target.pid)
    # The random data does not compress: its pages stay in CRIU's pages image, which became
    # the largest pack (the interpreter's pages, compressed, are in the dump's own pack).
    pack = max((isolated_env / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
    with open(pack, "r+b") as f:  # flip one byte in the middle of the 16 MiB of random data
        f.seek(pack.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    refused = ckpt("restore", first["id"], check=False)
    assert refused.returncode == 6 and "damaged" in refused.stderr, refused.stderr
    assert list((isolated_env / "damaged").iterdir()), "the damage found must be recorded"

    second = ckpt_json("dump", target.pid)
    assert second["pages_new"] >= 1, "the pages of the damaged segment must be stored again"
    assert second["bytes_stored"] < 4 << 20, "only the damaged segment, not all 16 MiB"
    assert all(not r["problems"] for r in ckpt_json("verify", "--all")), "both checkpoints are whole again"
    ckpt("prune")  # the damaged segment is dead now: no index names it, nor any record
    assert not list((isolated_env / "damaged").iterdir())
    assert all(not r["problems"] for r in ckpt_json("verify", "--all"))

    procs.kill_tree(target.pid)
    for checkpoint in (first, second):
        out.unlink()
        restored = ckpt_json("restore", checkpoint["id"])
        procs.adopt(restored["pid"])
        os.kill(restored["pid"], signal.SIGUSR1)
        assert wait_until(lambda: read_lines(out), what="checksum")[0].split()[0] == original
        procs.kill_tree(restored["pid"])
        wait_until(lambda: not os.path.exists(f"/proc/{restored['pid']}"), what="PID free")


def test_a_next_dump_looks_up_only_the_pages_its_target_changed(procs, tmp_path, isolated_env, monkeypatch):
    """Real CRIU pagemaps: the second dump matches the pages by address to the first one and
    searches the store's index only for the others; its checkpoint restores whole."""
    from ckpt.commands.dump import DumpRequest, dump
    from ckpt.store.blocks.index import BlockIndex

    searched = []
    real_held = BlockIndex.held
    monkeypatch.setattr(BlockIndex, "held", lambda self, ids: searched.append(len(ids) // 16)
                        or real_held(self, ids))
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 32)
    original = wait_until(lambda: read_lines(out), timeout=60, what="bigmem")[0].split()[0]
    dump(isolated_env, DumpRequest(pid=target.pid, dirty_tracking=False), settings=env_settings())
    assert searched[-1] > 8192, "a first dump searches every page"
    time.sleep(0.3)  # the target's counter moves: a few of its pages change
    second = dump(isolated_env, DumpRequest(pid=target.pid, dirty_tracking=False), settings=env_settings()).manifest
    assert second.stats["pages"] > 8192
    assert searched[-1] < second.stats["pages"] // 20, (searched, second.stats["pages"])
    counter_then = int(read_lines(out)[-1].split()[1])

    procs.kill_tree(target.pid)
    out.unlink()
    restored = ckpt_json("restore", second.id)
    procs.adopt(restored["pid"])
    os.kill(restored["pid"], signal.SIGUSR1)
    checksum, counter = wait_until(lambda: read_lines(out), what="checksum")[0].split()
    assert checksum == original and int(counter) >= counter_then
    procs.kill_tree(restored["pid"])


def test_many_dumps_keep_few_index_files_and_every_checkpoint_restores(procs, tmp_path, isolated_env):
    """Each dump that stores new pages adds an index file; past MERGE_ABOVE a dump merges the
    smallest ones (a lookup costs per file). Every checkpoint still verifies and restores."""
    from ckpt.store.blocks.blockstore import MERGE_ABOVE

    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 8)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem")
    original = read_lines(out)[0].split()[0]
    dumped = [ckpt("dump", target.pid, "--json") for _ in range(MERGE_ABOVE + 4)]
    assert any("merged 16 index files into one" in d.stderr for d in dumped)
    index_files = [p for p in (isolated_env / "index").iterdir() if not p.name.startswith(".")]
    assert len(index_files) <= MERGE_ABOVE
    assert all(not r["problems"] for r in ckpt_json("verify", "--all"))
    procs.kill_tree(target.pid)
    out.unlink()
    for checkpoint in (json.loads(dumped[0].stdout)["id"], json.loads(dumped[-1].stdout)["id"]):
        restored = ckpt_json("restore", checkpoint)
        procs.adopt(restored["pid"])
        os.kill(restored["pid"], signal.SIGUSR1)
        line = wait_until(lambda: read_lines(out), what="checksum")[0]
        assert line.split()[0] == original, "the 8 MiB did not come back whole"
        procs.kill_tree(restored["pid"])
        out.unlink()
        wait_until(lambda: not os.path.exists(f"/proc/{restored['pid']}"), what="PID free")
