"""ckpt/restore/copywatch.py: the watcher of a clone tears each copy down once its init ends
(its identity file, its registry row, the registry with the last), and ends with the last copy.
Stand-in inits are real processes started (and ended) here; networks are tested with real
namespaces in tests/integration/test_copies.py."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from ckpt.restore import copywatch
from ckpt.store import ids
from ckpt.system import procfs
from tests.helpers import wait_until


@pytest.fixture
def inits():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def identity(directory, inode, init):
    record = {"format": 2, "clone": "x", "copy": 1, "checkpoint": "y", "init": [init[0], init[1]]}
    (directory / f"pidns-{inode}.json").write_text(json.dumps(record))


def test_each_copy_is_torn_down_as_its_init_ends(tmp_path, inits):
    clone_id = ids.new_id()
    rows = []
    for index in (1, 2):
        process = subprocess.Popen(["sleep", "60"], start_new_session=True)
        inits.append(process)
        start = procfs.start_ticks(process.pid)
        rows.append({"index": index, "init_pid": process.pid, "init_start": start})
        identity(tmp_path, 4026530000 + index, (process.pid, start))
    identity(tmp_path, 4026539999, (inits[0].pid, rows[0]["init_start"] + 1))  # left by a copy that ended
    registry = copywatch.registry_path(tmp_path, clone_id)
    registry.write_text(json.dumps({"format": 1, "clone": clone_id, "copies": rows}))
    watcher = threading.Thread(target=copywatch.watch, args=(tmp_path, clone_id, 0.2), daemon=True)
    watcher.start()
    inits[0].kill()
    inits[0].wait()
    # The registry row goes last in a tear-down: once it has, every other step has run.
    wait_until(lambda: [c["index"] for c in json.loads(registry.read_text())["copies"]] == [2], timeout=5,
               what="copy 1's registry row gone")
    assert not (tmp_path / "pidns-4026530001.json").exists()
    assert not (tmp_path / "pidns-4026539999.json").exists()
    assert (tmp_path / "pidns-4026530002.json").exists()
    inits[1].kill()
    inits[1].wait()
    watcher.join(5)
    assert not watcher.is_alive() and not registry.exists()
    assert not list(tmp_path.glob("pidns-*.json"))


def test_a_watcher_of_copies_already_gone_ends_at_once(tmp_path):
    clone_id = ids.new_id()
    ended = subprocess.Popen(["true"])
    ended.wait()
    registry = copywatch.registry_path(tmp_path, clone_id)
    registry.write_text(json.dumps({"copies": [{"index": 1, "init_pid": ended.pid, "init_start": 1}]}))
    copywatch.watch(tmp_path, clone_id, 0.2)
    assert not registry.exists()
