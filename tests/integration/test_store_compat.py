"""A store written before dumps streamed their pages out of CRIU (issue 17) still verifies and
restores, and takes new checkpoints that dedup against what it holds: the store format did not
change. The store is tests/fixtures/stores/pre-stream-store.tar.gz, made by
tests/fixtures/make_compat_store.py (see there: how, with which commit) from a target,
tests/fixtures/compat_target.py, that reports a checksum of its memory when signalled.

The fixture's target was made on a CPU with AVX-512: glibc chose its AVX-512 memset when the
target started, and a copy restored on a CPU without it dies of SIGILL at its first report (a
tree keeps the code paths its libraries chose at start; neither CRIU, by default, nor ckpt's
host check compares instruction sets). The record's "cpu_flags" names what that code needs:
a host without them skips, as one that lacks the fixture's files does."""

import json
import os
import signal
import tarfile
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, alive, ckpt, ckpt_json, read_lines, wait_until

STORES = FIXTURES / "stores"


def cpu_flags() -> set[str]:
    """The instruction-set flags of this host's CPU (/proc/cpuinfo)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def restore(ref: str, output: Path, *flags: str) -> dict | None:
    """The restored root's JSON; None when its PID is taken (only without --new-pidns).
    A host that lacks what the checkpoint needs (another build of /usr/bin/python3 or libc,
    exit code 10) skips the test: the fixture is bound to the image it was made on."""
    done = ckpt("restore", ref, "--output", output, "--json", *flags, check=False)
    if done.returncode == 10:
        pytest.skip(f"this host cannot restore the fixture's checkpoints: {done.stderr.strip()}")
    if done.returncode == 7 and not flags:
        return None
    assert done.returncode == 0, f"ckpt restore {ref} failed ({done.returncode}):\n{done.stderr}"
    return json.loads(done.stdout)


def adopt(procs, restored: dict) -> int:
    """Ours to end: the restored root and, in a PID namespace of its own, the namespace's init."""
    if restored["pid_in_namespace"] is not None:
        status = Path(f"/proc/{restored['pid']}/status").read_text()
        procs.adopt(int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))))
    procs.adopt(restored["pid"])
    return restored["pid"]


def report(pid: int, output: Path) -> tuple[str, int]:
    """Asks the target for its memory's checksum: (checksum, its counter)."""
    before = len(read_lines(output))
    os.kill(pid, signal.SIGUSR1)

    def reported() -> list[str]:
        lines = [x for x in read_lines(output)[before:] if x.startswith("sum ")]
        if not lines and not alive(pid):
            raise AssertionError(f"PID {pid} died instead of reporting into {output} (a trap in the kernel log?)")
        return lines

    # Summing 8 MiB takes milliseconds: 30 s (as the other waits on restored trees) is for a
    # loaded machine; a target that died ends the wait at once.
    line = wait_until(reported, timeout=30, what=f"PID {pid} to report into {output}")[0]
    _, checksum, counter = line.split()
    return checksum, int(counter)


def assert_runs_as_checkpointed(pid: int, output: Path, expected: dict) -> None:
    """Its memory is the checkpoint's, and it goes on counting from where it stopped."""
    checksum, counter = report(pid, output)
    assert checksum == expected["sum"], f"the memory restored from {expected['id']} differs"
    assert counter >= expected["counter"]
    time.sleep(0.3)
    assert report(pid, output)[1] > counter, "the restored target does not run"


def end(procs, pid: int) -> None:
    procs.kill_tree(pid)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=10, what=f"PID {pid} to be gone")


def test_store_written_before_page_streaming_verifies_restores_and_takes_new_checkpoints(
        procs, tmp_path, isolated_env):
    record = json.loads((STORES / "pre-stream-store.json").read_text())
    older, newer = record["checkpoints"]
    missing = sorted(set(record["cpu_flags"]) - cpu_flags())
    if missing:
        pytest.skip(f"this host's CPU lacks {' '.join(missing)}, which the fixture's target uses (glibc's "
                    "AVX-512 memset, chosen when it started on the host that made it): it would die of SIGILL")
    isolated_env.mkdir(mode=0o700)
    with tarfile.open(STORES / "pre-stream-store.tar.gz") as tar:
        tar.extractall(isolated_env, filter="tar")

    assert ckpt_json("verify", "--all") == [{"id": older["id"], "files": 12, "problems": []},
                                            {"id": newer["id"], "files": 12, "problems": []}]
    assert [c["id"] for c in ckpt_json("list")] == [older["id"], newer["id"]]

    # The newer (deduplicated against the older) in a PID namespace: its PID need not be free.
    out = tmp_path / "newer.out"
    restored = restore(newer["id"], out, "--new-pidns")
    assert restored["pid_in_namespace"] == ckpt_json("show", newer["id"])["pid"]
    pid = adopt(procs, restored)
    assert_runs_as_checkpointed(pid, out, newer)
    end(procs, pid)

    # The older at its own PID, where that is free (the usual case): a tree in a PID namespace
    # of its own cannot be dumped (CRIU dumps a namespace only with its init), and it is.
    out = tmp_path / "older.out"
    restored = restore(older["id"], out)
    if restored is None:
        restored = restore(older["id"], out, "--new-pidns")
        pid = adopt(procs, restored)
        assert_runs_as_checkpointed(pid, out, older)
        pytest.skip(f"PID {ckpt_json('show', older['id'])['pid']} is taken here: the old store restored, but "
                    "a new dump of it into the store was not tried")
    pid = adopt(procs, restored)
    assert_runs_as_checkpointed(pid, out, older)

    # The code of today writes into the old store: its checkpoint dedups against the old packs
    # (the memory did not change: only what Python touched since is new), verifies with them,
    # and restores with the same memory.
    dumped = ckpt_json("dump", pid, "--name", "compat")
    manifest = json.loads((isolated_env / "checkpoints" / f"{dumped['id']}.json").read_text())
    assert manifest["stats"]["pages_new"] < older["pages"] // 4, manifest["stats"]
    end(procs, pid)
    verified = ckpt_json("verify", "--all")
    assert [(c["id"], c["problems"]) for c in verified] == [(c, []) for c in (older["id"], newer["id"], dumped["id"])]
    out = tmp_path / "redumped.out"
    restored = restore(dumped["id"], out, "--new-pidns")
    pid = adopt(procs, restored)
    assert_runs_as_checkpointed(pid, out, {**older, "id": dumped["id"]})
