"""`ckpt copy` between two stores, and --copy-to of schedules: only what the destination lacks
is sent, every copied checkpoint restores from the destination with its memory, a copy is
idempotent, and a copy that cannot be made stays pending until a later run makes it. (kill -9
in the middle of a copy: tests/integration/test_kill_phases.py, phases copy.*.)

The target is dirtymem.py: MIB of random data; SIGUSR2 rewrites DIRTY of its pages, SIGUSR1
makes it write the checksum of its memory."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.helpers import env_settings, ckpt, ckpt_json, read_lines, state, wait_until
from tests.jsonshape import assert_shape

MIB = 16
DIRTY = 64
PAGE = 4096


class Dirty:
    def __init__(self, procs, tmp_path: Path):
        self.procs = procs
        self.out = tmp_path / "mem.txt"
        self.popen = procs.start("dirtymem.py", self.out, MIB, "off", DIRTY)
        self.pid = self.popen.pid
        wait_until(lambda: "ready" in read_lines(self.out), timeout=30, what="dirtymem to fill its memory")

    def _lines(self, word: str) -> list[str]:
        return [line for line in read_lines(self.out) if line.startswith(word)]

    def checksum(self) -> str:
        before = len(self._lines("sum "))
        os.kill(self.pid, signal.SIGUSR1)
        wait_until(lambda: len(self._lines("sum ")) > before, timeout=10, what="dirtymem to report")
        return self._lines("sum ")[before].split()[1]

    def dirty(self) -> None:
        before = len(self._lines("dirtied"))
        os.kill(self.pid, signal.SIGUSR2)
        wait_until(lambda: len(self._lines("dirtied")) > before, timeout=10, what="dirtymem to rewrite pages")

    def end(self) -> None:
        self.procs.kill_tree(self.pid)
        if self.popen is not None:
            self.popen.wait(timeout=10)
            self.popen = None
        wait_until(lambda: state(self.pid) is None, timeout=10, what=f"PID {self.pid} to be free")


def store_bytes(root: Path) -> int:
    """Every byte of the store's blobs (what a copy writes into it)."""
    return sum(p.stat().st_size for sub in ("objects", "packs", "index", "checkpoints")
               for p in (root / sub).rglob("*") if p.is_file())


def take(target: Dirty, count: int) -> dict[str, str]:
    """count checkpoints of the changing target: ID -> its memory's checksum at the dump."""
    taken = {}
    for _ in range(count):
        checksum = target.checksum()
        taken[ckpt_json("dump", target.pid)["id"]] = checksum
        target.dirty()
    return taken


@pytest.mark.parametrize("seed", ["shared", "own"])
def test_copy_sends_only_changed_pages_and_every_copy_restores(seed, procs, tmp_path, isolated_env):
    dest = tmp_path / "B"
    if seed == "own":
        # A destination that already has a seed of its own (it held pages before): page ids of
        # the two stores differ, so the copy hashes pages anew for it.
        from ckpt.store import Store

        assert Store.open(dest, create=True, settings=env_settings()).blocks.seed
    target = Dirty(procs, tmp_path)
    taken = take(target, 10)
    before = store_bytes(dest) if dest.exists() else 0
    report = ckpt_json("copy", "--all", "--to", dest)
    assert report["same_seed"] == (seed == "shared")
    assert [c["id"] for c in report["checkpoints"]] == sorted(taken)
    assert [c["status"] for c in report["checkpoints"]] == ["copied"] * 10
    # What the copy says it sent is what the destination grew by.
    assert report["bytes_sent"] == store_bytes(dest) - before
    first, *later = report["checkpoints"]
    assert first["pages_sent"] >= MIB * 256 and first["bytes_sent"] >= MIB << 20  # random data: no compression
    for c in later:
        # The rewritten pages, and what the interpreter changed meanwhile (its heap, the stack).
        assert DIRTY <= c["pages_sent"] <= DIRTY + 400, c
        assert c["bytes_sent"] < (DIRTY + 400) * PAGE + (256 << 10), c
        # Pages read from the source: those sent; with its own seed, those whose ids were not
        # learnt from the checkpoint copied before, which are the same few.
        assert c["pages_read"] <= c["pages_sent"] + 16, c
    # Idempotent: a second copy sends nothing and writes nothing.
    size = store_bytes(dest)
    again = ckpt_json("copy", "--all", "--to", dest)
    assert again["bytes_sent"] == 0 and again["copied"] == 0 and again["present"] == 10
    assert store_bytes(dest) == size
    # Every copied checkpoint verifies and restores from the destination with its memory.
    assert ckpt("verify", "--all", "--store", dest).returncode == 0
    target.end()
    for checkpoint_id, checksum in sorted(taken.items()):
        assert ckpt_json("restore", checkpoint_id, "--store", dest)["pid"] == target.pid
        procs.adopt(target.pid)
        assert target.checksum() == checksum, checkpoint_id
        target.end()


def test_copy_of_some_checkpoints_and_bad_requests(procs, tmp_path, isolated_env):
    target = Dirty(procs, tmp_path)
    taken = sorted(take(target, 3))
    dest = tmp_path / "B"
    one = ckpt_json("copy", taken[1], "--to", dest)
    assert [(c["id"], c["status"]) for c in one["checkpoints"]] == [(taken[1], "copied")]
    assert [c["id"] for c in ckpt_json("list", "--store", dest)] == [taken[1]]
    rest = ckpt_json("copy", "--all", "--to", dest)
    assert [c["status"] for c in rest["checkpoints"]] == ["copied", "present", "copied"]
    for args, code in ((["copy", "--all"], 2), (["copy", "--to", dest], 2),
                       (["copy", "--all", "--to", isolated_env], 2), (["copy", "nosuch", "--to", dest], 3),
                       (["copy", "latest", "--all", "--to", dest], 2)):
        proc = ckpt(*args, check=False)
        assert proc.returncode == code, (args, proc.stderr)
        assert proc.stderr.startswith("Error: ") and "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.fixture
def cron_dir(tmp_path, monkeypatch):
    path = tmp_path / "cron.d"
    monkeypatch.setenv("CKPT_CRON_DIR", str(path))
    return path


def test_schedule_copy_to_stays_pending_until_a_run_can_copy(procs, tmp_path, cron_dir, isolated_env):
    target = Dirty(procs, tmp_path)
    dest = tmp_path / "offsite"
    dest.mkdir(mode=0o700)
    blocker = dest / "not-a-store"  # a directory that is not a store and not empty is refused
    blocker.write_text("x")
    ckpt("schedule", "add", "agent", "--pid", target.pid, "--every", "5m", "--copy-to", dest)
    assert ckpt_json("schedule", "list")[0]["copy_to"] == str(dest)
    first = ckpt_json("schedule", "run", "agent")  # the dump succeeds, its copy does not
    assert first["outcome"] == "ok" and "not a ckpt store" in first["copy_error"]
    assert [(c["id"], c["status"]) for c in first["copies"]] == [(first["id"], "failed")]
    pending = isolated_env / "copy-pending" / f"{first['id']}.json"
    assert json.loads(pending.read_text())["to"] == str(dest)
    assert ckpt_json("schedule", "list")[0]["last"]["copy_error"] == first["copy_error"]
    blocker.unlink()  # the destination can be written again
    target.dirty()
    second = ckpt_json("schedule", "run", "agent")
    assert "copy_error" not in second
    assert [(c["id"], c["status"]) for c in second["copies"]] == [(first["id"], "copied"), (second["id"], "copied")]
    assert not list((isolated_env / "copy-pending").iterdir())
    assert [c["id"] for c in ckpt_json("list", "--store", dest)] == [first["id"], second["id"]]
    assert ckpt("verify", "--all", "--store", dest).returncode == 0
    # A checkpoint removed before its copy could be made: its record is dropped.
    (dest / "store.json").write_text('{"format": 99}')  # refused: a newer ckpt's
    target.dirty()
    third = ckpt_json("schedule", "run", "agent")
    assert third["copies"][0]["status"] == "failed"
    ckpt("rm", third["id"])
    assert ckpt_json("copy", "--pending")["pending"] == [{"id": third["id"], "to": str(dest), "status": "gone",
                                                          "bytes_sent": 0, "error": None}]
    assert not list((isolated_env / "copy-pending").iterdir())


def test_copy_to_s3_and_back(procs, tmp_path, isolated_env, s3_url, s3_server):
    """Local -> S3 (a Store built on S3Backend: `--store s3://` is not wired in yet) and back
    into a new local store, from which the copies restore. Bytes reported = bytes in the bucket."""
    from ckpt.commands.copy import copy
    from ckpt.store import Store
    from ckpt.store.backends.s3 import S3Backend

    target = Dirty(procs, tmp_path)
    taken = take(target, 3)
    source = Store.open(isolated_env, settings=env_settings())
    remote = Store(tmp_path / "s3-local", S3Backend.from_url(s3_url))
    first = copy(source, remote, source.checkpoint_ids()).to_json()
    assert first["same_seed"] and [c["status"] for c in first["checkpoints"]] == ["copied"] * 3
    checksum = target.checksum()
    fourth = ckpt_json("dump", target.pid)["id"]
    taken[fourth] = checksum
    second = copy(source, remote, source.checkpoint_ids()).to_json()
    assert [c["status"] for c in second["checkpoints"]] == ["present"] * 3 + ["copied"]
    assert second["checkpoints"][-1]["pages_sent"] <= DIRTY + 400
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    in_bucket = sum(o["Size"] for o in listed if o["Key"].split("/")[1] in ("objects", "packs", "index", "checkpoints"))
    assert in_bucket == first["bytes_sent"] + second["bytes_sent"]
    back = Store.open(tmp_path / "C", create=True, settings=env_settings())
    returned = copy(remote, back, remote.checkpoint_ids()).to_json()
    assert [c["status"] for c in returned["checkpoints"]] == ["copied"] * 4
    assert ckpt("verify", "--all", "--store", back.root).returncode == 0
    target.end()
    for checkpoint_id in (sorted(taken)[0], fourth):
        assert ckpt_json("restore", checkpoint_id, "--store", back.root)["pid"] == target.pid
        procs.adopt(target.pid)
        assert target.checksum() == taken[checkpoint_id]
        target.end()


def test_run_copies_each_checkpoint_it_takes(procs, tmp_path, isolated_env):
    """`ckpt run --copy-to`: each checkpoint is copied right after it is taken; retention
    (--keep-last) applies to the source only."""
    import subprocess
    import sys

    from tests.helpers import FIXTURES, ROOT

    dest = tmp_path / "offsite"
    events_file = tmp_path / "events.jsonl"
    with open(events_file, "wb") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "run", "--every", "1s", "--name", "counter", "--keep-last", "1",
             "--copy-to", dest, "--output", tmp_path / "run.out", "--json", "--",
             sys.executable, FIXTURES / "counter.py", tmp_path / "count.txt", "0.05"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)

    def events() -> list[dict]:
        return [json.loads(line) for line in read_lines(events_file)]

    copied = wait_until(lambda: [e for e in events() if e["event"] == "copied"][2:], timeout=120,
                        what="three checkpoints copied")
    supervisor.send_signal(signal.SIGTERM)
    supervisor.wait(timeout=30)
    taken = [e["id"] for e in events() if e["event"] == "checkpoint"]
    sent = [e["id"] for e in events() if e["event"] == "copied"]
    assert sent == taken and {e["to"] for e in copied} == {str(dest)}
    for event in copied:
        assert_shape(event, "run: copied")
    assert [c["id"] for c in ckpt_json("list", "--store", dest)] == taken  # all of them, retention or not
    assert len(ckpt_json("list")) == 1
    assert not list((isolated_env / "copy-pending").iterdir())
