"""Damage in the store does not spread into new checkpoints (docs/design.md, "Damage and
healing"): after `verify --all` has seen a damaged pack, the next dump of the same, still
running, process restores whole, and every checkpoint after it verifies."""

import os
import signal

import pytest

from tests.helpers import ckpt, ckpt_json, read_lines, wait_until

SIZE_MIB = 24


def checksum_of(procs, pid: int, out) -> str:
    before = len(read_lines(out))
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: len(read_lines(out)) > before, timeout=30, what="bigmem's checksum")
    return read_lines(out)[-1].split()[0]


@pytest.mark.parametrize("damage", ["truncate", "two-flips"])
def test_a_dump_after_verify_found_damage_restores_whole(procs, tmp_path, isolated_env, damage):
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, SIZE_MIB)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem")
    memory = read_lines(out)[0].split()[0]
    ckpt_json("dump", target.pid)
    pack = max((isolated_env / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
    size = pack.stat().st_size
    if damage == "truncate":
        os.truncate(pack, size // 2)
    else:
        with open(pack, "r+b") as f:  # two 8-byte spans, in two different segments
            for at in (size // 4, size * 3 // 4):
                f.seek(at)
                span = f.read(8)
                f.seek(at)
                f.write(bytes(b ^ 0xFF for b in span))
    assert ckpt("verify", "--all", check=False).returncode == 6
    assert len(list((isolated_env / "damaged").iterdir())) >= 2, "every damaged segment is recorded"

    second = ckpt_json("dump", target.pid)  # the same process, still running
    assert second["bytes_stored"] >= 2 << 20, "the pages of every damaged segment are stored again"
    assert ckpt("verify", second["id"], check=False).returncode == 0
    procs.kill_tree(target.pid)
    restored = ckpt_json("restore", second["id"])
    procs.adopt(restored["pid"])
    assert checksum_of(procs, restored["pid"], out) == memory, "the restored memory is not what was dumped"

    third = ckpt_json("dump", restored["pid"])
    for later in (second, third):
        proc = ckpt("verify", later["id"], check=False)
        assert proc.returncode == 0, proc.stderr
