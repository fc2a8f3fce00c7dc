"""The restore use case (ckpt/commands/restore.py, RestoreSession) against a fake CRIU
(tests/commands/fakes_dump.py) and a store in a temporary directory: the images CRIU is given,
the abort from each phase (after restore it ends the restored tree), a CRIU failure. The
checkpoint is dumped by the dump use case with the same fake. Real CRIU restores are in
tests/integration (test_sessions.py, test_roundtrip.py, test_lazy.py, ...)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from ckpt.commands.dump import DumpRequest, DumpSession
from ckpt.commands.restore import RestoreRequest, RestoreSession
from ckpt.errors import CheckpointNotFound, CriuFailed, SessionAborted
from ckpt.store import Manifest, Store
from tests.commands.fakes_dump import FakeCriu, alive, end, pages, start_target
from tests.helpers import env_settings


@pytest.fixture
def store(tmp_path, settings) -> Store:
    return Store.open(tmp_path / "store", create=True, settings=settings)


@pytest.fixture
def settings():
    return replace(env_settings(), page_stream=False)


@pytest.fixture
def checkpoint(store, settings) -> Manifest:
    """A checkpoint of a process that has ended since (its PID is free for the restore)."""
    target = start_target()
    try:
        with DumpSession(store.root, DumpRequest(pid=target.pid, dirty_tracking=False), store=store,
                         criu=lambda _settings: FakeCriu(memory=pages(16, 3)), settings=settings) as dump:
            dump.prepare()
            dump.capture()
            dump.commit()
            return dump.finish().manifest
    finally:
        end(target)


@pytest.fixture
def restored():
    """The stand-ins the fake CRIU starts, ended after the test whatever it left."""
    processes: list = []
    yield processes
    for process in processes:
        end(process)


def session(store: Store, ref: str, criu: FakeCriu, settings, **request) -> RestoreSession:
    return RestoreSession(store.root, RestoreRequest(ref=ref, lazy=False, **request), store=store,
                          criu=lambda _settings: criu, settings=settings)


def assert_nothing_left(store: Store, staged: list[Path]) -> None:
    assert [path for path in staged if path.exists()] == []
    with store.lock(exclusive=True, timeout=0):  # the shared lock is released
        pass


def test_criu_gets_every_image_rebuilt_and_the_tree_runs_on_after_finish(store, checkpoint, settings, restored):
    criu = FakeCriu()
    restored_list = criu.restored
    with session(store, checkpoint.id, criu, settings) as restore:
        restore.prepare()
        staged = [restore.images_dir]
        pid = restore.restore()
        result = restore.finish()
    restored.extend(restored_list)
    assert result.pid == pid and result.manifest.id == checkpoint.id and result.lazy is None
    assert criu.restored_images["pages-1.img"] == pages(16, 3)
    assert {"pstree.img", f"pagemap-{checkpoint.pid}.img"} <= set(criu.restored_images)
    assert criu.notified == ["post-restore"]
    assert alive(pid), "a finished restore leaves the tree to the user"
    restore.abort()  # after finish: nothing to undo, the tree stays
    assert alive(pid)
    assert_nothing_left(store, staged)


@pytest.mark.parametrize("last", ["nothing", "prepare", "restore"])
def test_an_abort_after_any_phase_leaves_nothing_running_and_nothing_staged(store, checkpoint, settings, restored,
                                                                           last):
    criu = FakeCriu()
    restore = session(store, checkpoint.id, criu, settings)
    staged: list[Path] = []
    if last in ("prepare", "restore"):
        restore.prepare()
        staged.append(restore.images_dir)
        assert staged[0].is_dir()
    if last == "restore":
        restore.restore()
    restore.abort()
    restore.abort()  # idempotent
    restored.extend(criu.restored)
    assert [p.pid for p in criu.restored if alive(p.pid)] == [], "an aborted restore ends the restored tree"
    assert len(criu.restored) == (1 if last == "restore" else 0)
    assert_nothing_left(store, staged)
    assert store.checkpoint_ids() == [checkpoint.id]


def test_a_criu_failure_leaves_nothing_staged_and_the_lock_free(store, checkpoint, settings, restored):
    criu = FakeCriu(fail_restore=True)
    with pytest.raises(CriuFailed), session(store, checkpoint.id, criu, settings) as restore:
        restore.prepare()
        staged = [restore.images_dir]
        restore.restore()
    restored.extend(criu.restored)
    assert restore.pid is None
    assert_nothing_left(store, staged)


def test_an_unknown_checkpoint_is_refused_before_anything_is_laid_out(store, checkpoint, settings):
    criu = FakeCriu()
    with pytest.raises(CheckpointNotFound), session(store, "no-such-checkpoint", criu, settings) as restore:
        restore.prepare()
    assert restore.images_dir is None and criu.restored == []
    assert_nothing_left(store, [])


def test_the_duration_is_read_from_the_sessions_clock(store, checkpoint, settings, restored):
    ticks = iter([10.0, 12.5])
    criu = FakeCriu()
    restore = RestoreSession(store.root, RestoreRequest(ref=checkpoint.id, lazy=False), store=store,
                             criu=lambda _settings: criu, clock=lambda: next(ticks), settings=settings)
    with restore:
        restore.prepare()
        restore.restore()
        result = restore.finish()
    restored.extend(criu.restored)
    assert result.duration_ms == 2500.0


# ---- a coordinator's hold: restore_held(), then release() or abort() ------------------------

def test_a_held_restore_runs_the_tree_only_once_released(store, checkpoint, settings, restored):
    criu = FakeCriu()
    with session(store, checkpoint.id, criu, settings) as restore:
        restore.prepare()
        restore.restore_held()
        restored.extend(criu.restored)
        assert criu.notified == ["post-restore"] and not criu.resumed and restore.pid is None
        restore.release()
        assert criu.resumed and restore.pid == criu.restored[0].pid
        result = restore.finish()
    assert alive(result.pid)


@pytest.mark.parametrize("how", ["abort", "past the limit"])
def test_a_held_restore_given_up_ends_what_criu_restored(store, checkpoint, settings, restored, how):
    criu = FakeCriu()
    restore = session(store, checkpoint.id, criu, settings)
    restore.prepare()
    staged = [restore.images_dir]
    restore.restore_held(hold_limit=0.2 if how == "past the limit" else 300)
    restored.extend(criu.restored)
    if how == "abort":
        restore.abort()
    else:
        time.sleep(0.5)  # the coordinator stalls past the limit
        with pytest.raises(SessionAborted, match="held before it ran for 0.2 s"):
            restore.release()
        restore.abort()
    assert not criu.resumed and [p.pid for p in criu.restored if alive(p.pid)] == []
    assert restore.pid is None
    assert_nothing_left(store, staged)
