"""ckpt/commands/clone.py: N copies restored all at once or none (fake copy sessions: the
restore of one copy is ckpt/restore/copies.py's, tested with real CRIU in
tests/integration/test_clone.py), the clone's registry and the running copies it lists."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckpt.commands import clone as clone_module
from ckpt.commands.clone import CloneRequest, check_request, clone, read_registries, running_copies
from ckpt.errors import CloneFailed, CriuFailed, UsageError
from ckpt.reporting import NullReporter
from ckpt.system import procfs
from tests.helpers import env_settings, wait_until


@pytest.fixture
def settings(tmp_path):
    return replace(env_settings(), lock_timeout=5.0)


@pytest.fixture
def copies_dir(tmp_path, monkeypatch):
    directory = tmp_path / "copies"
    monkeypatch.setattr(clone_module, "copies_dir", lambda _settings: directory)
    return directory


@pytest.fixture
def inits():
    """Stand-ins for the copies' inits: real processes, ended after the test."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


@dataclass
class FakeCopy:
    """A copy's restore: each phase logged; `fail` names the phase that raises."""

    placement: SimpleNamespace
    inits: list
    log: list
    fail: str | None = None
    images: Path | None = None  # the images it was given to share

    def prepare(self) -> None:
        self._phase("prepare")

    def prepared_images(self) -> Path:
        return self.images or Path(f"/staged-by-copy-{self.placement.index}")

    def restore(self) -> int:
        self._phase("restore")
        self.process = subprocess.Popen(["sleep", "300"], start_new_session=True)
        self.inits.append(self.process)
        return self.process.pid

    def finish(self):
        self._phase("finish")
        pid = self.process.pid
        info = SimpleNamespace(index=self.placement.index, init_pid=pid, pid=pid, pid_in_namespace=2,
                               pidns_inode=4026530000 + self.placement.index,
                               netns=f"ckpt-{self.placement.clone_id}-{self.placement.index}",
                               address=f"10.214.0.{4 * self.placement.index + 2}")
        return SimpleNamespace(copy=info, to_json=lambda: {"pid": pid})

    def abort(self) -> None:
        self.log.append(("abort", self.placement.index))
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def _phase(self, name: str) -> None:
        self.log.append((name, self.placement.index))
        if self.fail == name:
            raise CriuFailed(f"CRIU failed to {name} copy {self.placement.index}", hint="see its log")


def factory(inits, log, failing: dict[int, str] | None = None, given: dict | None = None):
    """given: filled with the images each copy was made to share (by its number)."""
    def make(placement, request, checkpoint, reporter, images):
        assert request.copies == placement.count
        if given is not None:
            given[placement.index] = images
        return FakeCopy(placement, inits, log, (failing or {}).get(placement.index), images)
    return make


@pytest.mark.parametrize("copies,network,message", [
    (0, "auto", "--copies must be 1 to 64, not 0"), (65, "auto", "--copies must be 1 to 64, not 65"),
    (True, "auto", "--copies must be 1 to 64"), (2, "bridge", "--net must be one of auto, own, host"),
])
def test_bad_requests_are_refused_before_anything(copies, network, message):
    with pytest.raises(UsageError, match=message):
        check_request(CloneRequest("agent", copies, network))


def test_every_copy_runs_and_the_registry_lists_them(store, checkpoints, settings, copies_dir, inits):
    made = checkpoints.make("agent")
    log: list = []
    given: dict = {}
    result = clone(store.root, CloneRequest("agent", 4), NullReporter(), settings=settings, store=store,
                   new_session=factory(inits, log, given=given))
    assert result.network == "host" and result.ports == []  # no listening socket in the images
    assert [c.index for c in result.copies] == [1, 2, 3, 4]
    # The first copy lays the images out; the others share them.
    assert given == {1: None, 2: Path("/staged-by-copy-1"), 3: Path("/staged-by-copy-1"),
                         4: Path("/staged-by-copy-1")}
    assert log[0] == ("prepare", 1)
    assert {phase for phase, _ in log} == {"prepare", "restore", "finish"}
    # Every copy is prepared before any is restored.
    assert max(i for i, (p, _) in enumerate(log) if p == "prepare") < min(i for i, (p, _) in enumerate(log)
                                                                         if p == "restore")
    registry = copies_dir / f"clone-{result.clone}.json"
    assert result.registry == registry and stat.S_IMODE(os.stat(registry).st_mode) == 0o600
    record = json.loads(registry.read_text())
    assert record["format"] == 1 and record["clone"] == result.clone and record["checkpoint"] == made.id
    assert record["name"] == "agent" and len(record["copies"]) == 4
    first = record["copies"][0]
    assert first["init_start"] == procfs.start_ticks(first["init_pid"])
    assert set(first) >= {"index", "pid", "init_pid", "pid_in_namespace", "netns", "address"}
    assert [c["index"] for c in running_copies(copies_dir)[made.id]] == [1, 2, 3, 4]
    (second,) = [p for p in inits if p.pid == result.copies[1].init_pid]  # threads start them in any order
    second.kill()
    second.wait()
    assert [c["index"] for c in running_copies(copies_dir, made.id)[made.id]] == [1, 3, 4]
    json.dumps(result.to_json())
    # The clone's watcher (a detached process) drops the row of the copy that ended.
    watcher = (result.watcher, procfs.start_ticks(result.watcher))
    assert procfs.is_running(*watcher)
    wait_until(lambda: [c["index"] for c in json.loads(registry.read_text())["copies"]] == [1, 3, 4],
               timeout=10, what="the watcher to drop copy 2's row")
    for process in inits:
        process.kill()
        process.wait()
    wait_until(lambda: not registry.exists(), timeout=10, what="the watcher to remove the registry")
    wait_until(lambda: not procfs.is_running(*watcher), timeout=10, what="the watcher to end")  # (a zombie: ours)


def test_one_copy_failing_ends_every_other(store, checkpoints, settings, copies_dir, inits):
    checkpoints.make("agent")
    log: list = []
    with pytest.raises(CloneFailed, match="copy 3 failed to be restored: CRIU failed to restore copy 3") as raised:
        clone(store.root, CloneRequest("agent", 4), NullReporter(), settings=settings, store=store,
              new_session=factory(inits, log, {3: "restore"}))
    assert raised.value.exit_code == CriuFailed.exit_code
    assert "every copy was ended" in (raised.value.hint or "")
    assert sorted(i for phase, i in log if phase == "abort") == [1, 2, 3, 4]
    assert all(process.poll() is not None for process in inits)  # none runs on
    assert read_registries(copies_dir) == []


def test_a_copy_failing_to_prepare_starts_none(store, checkpoints, settings, copies_dir, inits):
    checkpoints.make("agent")
    log: list = []
    with pytest.raises(CloneFailed, match="copy 2 failed to be prepared"):
        clone(store.root, CloneRequest("agent", 3), NullReporter(), settings=settings, store=store,
              new_session=factory(inits, log, {2: "prepare"}))
    assert not [phase for phase, _ in log if phase == "restore"] and inits == []


def test_auto_network_is_own_for_a_listening_tree(store, checkpoints, settings, copies_dir, inits, monkeypatch):
    checkpoints.make("agent")
    monkeypatch.setattr(clone_module, "listening_ports", lambda _store, _manifest: [8080])
    seen: list = []

    def make(placement, request, checkpoint, reporter, images):
        seen.append(placement.network)
        return FakeCopy(placement, inits, [])

    result = clone(store.root, CloneRequest("agent", 2), NullReporter(), settings=settings, store=store,
                   new_session=make)
    assert result.network == "own" and seen == ["own", "own"] and result.ports == [8080]
    host = clone(store.root, CloneRequest("agent", 1, network="host"), NullReporter(), settings=settings,
                 store=store, new_session=make)
    assert host.network == "host"


def test_registries_that_are_not_ours_are_skipped(tmp_path):
    (tmp_path / "clone-20261130-231500-000-abcdef.json").write_text("{not json")
    (tmp_path / "clone-x.json").write_text("{}")
    (tmp_path / "pidns-5.json").write_text("{}")
    assert read_registries(tmp_path) == [] and running_copies(tmp_path / "absent") == {}
