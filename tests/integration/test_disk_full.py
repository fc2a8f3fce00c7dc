"""A store on a full disk: every command says so (exit 1, with the way out), a failed dump
leaves nothing behind, and `rm` and `prune`, the way out, work and free space."""

import os
import signal
import subprocess

import pytest

from tests.helpers import alive, ckpt, ckpt_json, read_lines, wait_until

MIB = 1 << 20


@pytest.fixture
def full_store(tmp_path, monkeypatch):
    """A store on a 100 MiB tmpfs of its own (unmounted at teardown), and a function that
    fills what is left of it."""
    point = tmp_path / "mnt"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m,mode=0700", "tmpfs", str(point)], check=True)
    monkeypatch.setenv("CKPT_STORE", str(point / "store"))
    fills = []

    def fill() -> None:
        path = point / f"fill{len(fills)}"
        fills.append(path)
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M"], capture_output=True)
        assert free(point) == 0

    yield point / "store", fill
    subprocess.run(["umount", "-l", str(point)], check=False)


def free(path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def files_under(store, *subdirs) -> set:
    return {str(p.relative_to(store)) for sub in subdirs for p in (store / sub).rglob("*") if not p.is_dir()}


def assert_disk_full(proc) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and "no space left" in error[0] and "ckpt rm" in error[0], proc.stderr


def test_a_full_store_fails_dumps_cleanly_and_rm_and_prune_free_space(procs, tmp_path, full_store):
    store, fill = full_store
    out, other_out = tmp_path / "sums.txt", tmp_path / "other.txt"
    target = procs.start("bigmem.py", out, 12)
    other = procs.start("bigmem.py", other_out, 12)
    wait_until(lambda: read_lines(out) and read_lines(other_out), timeout=60, what="bigmem")
    memory = read_lines(out)[0].split()[0]
    ckpt_json("dump", target.pid)
    other_checkpoint = ckpt_json("dump", other.pid)
    leftover = store / "packs" / "ab" / ("ab" * 16)  # what a dump killed midway leaves
    leftover.parent.mkdir(mode=0o700, exist_ok=True)
    leftover.write_bytes(os.urandom(8 * MIB))
    fill()

    before = files_under(store, "packs", "tmp", "index", "objects", "checkpoints")
    for staging in ("disk", "ram"):  # ram: CRIU succeeds, the pack is what does not fit
        assert_disk_full(ckpt("dump", target.pid, check=False, env={"CKPT_STAGING": staging}))
        assert files_under(store, "packs", "tmp", "index", "objects", "checkpoints") == before, \
            f"a failed dump (staging: {staging}) left files behind"
        assert alive(target.pid)
    for command in (["list"], ["verify", "--all"], ["forget", "--keep-last", "5"]):
        proc = ckpt(*command, check=False)
        assert proc.returncode == 0, (command, proc.stderr)

    full = free(store)
    proc = ckpt("prune", check=False)
    assert proc.returncode == 0, proc.stderr
    assert not leftover.exists() and free(store) >= full + 7 * MIB, "prune freed nothing"
    fill()
    full = free(store)
    proc = ckpt("rm", other_checkpoint["id"], check=False)
    assert proc.returncode == 0, proc.stderr
    assert free(store) >= full + 10 * MIB, "rm freed nothing"

    for path in store.parent.glob("fill*"):  # space freed: the next dump works and restores
        path.unlink()
    again = ckpt_json("dump", target.pid, env={"CKPT_STAGING": "ram"})
    assert ckpt("verify", again["id"], check=False).returncode == 0
    procs.kill_tree(target.pid)
    restored = ckpt_json("restore", again["id"])
    procs.adopt(restored["pid"])
    lines = len(read_lines(out))
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: len(read_lines(out)) > lines, timeout=30, what="the restored bigmem's checksum")
    assert read_lines(out)[-1].split()[0] == memory
