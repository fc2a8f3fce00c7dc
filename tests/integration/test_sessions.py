"""The dump and the restore as sessions with phases (DumpSession in ckpt/commands/dump.py,
RestoreSession in ckpt/commands/restore.py), as a group checkpoint or a migration drives them:
a dump aborted after each phase leaves the target running on, unfrozen, counting, no
checkpoint visible, nothing staged, every lock free (the next dump works); a restore aborted
after each phase leaves nothing running and nothing staged. Real CRIU, a real target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt.commands.dump import DumpRequest, DumpSession
from ckpt.store import Store
from ckpt.store.verify import verify
from tests.helpers import env_settings, ckpt_json, read_lines, state, wait_until

pytestmark = pytest.mark.integration


def counted(out: Path) -> int:
    lines = read_lines(out)
    return int(lines[-1]) if lines else 0


def stopped_counter(procs, out: Path):
    """A counter checkpointed with --stop (ended by it): (its process, the dump's JSON, its count then)."""
    target = procs.start("counter.py", out)
    wait_until(lambda: counted(out) >= 3, what="the counter")
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)  # --stop ended it
    return target, dumped, counted(out)


def staged(store_dir: Path) -> list[str]:
    tmp = store_dir / "tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []


@pytest.mark.parametrize("stop", [False, True], ids=["running", "stop"])
def test_a_session_aborted_after_any_phase_leaves_the_target_running_and_nothing_behind(procs, tmp_path,
                                                                                         isolated_env, stop):
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: counted(out) >= 3, what="the counter")
    phases = ["prepare"] if stop else ["prepare", "capture"]  # --stop commits while frozen, in capture
    for last in phases:
        session = DumpSession(isolated_env, DumpRequest(pid=target.pid, name="s", stop=stop), settings=env_settings())
        session.prepare()
        assert staged(isolated_env), "prepare staged nothing"
        if last == "capture":
            session.capture()
        session.abort()
        session.abort()  # idempotent
        before = counted(out)
        wait_until(lambda before=before: counted(out) > before + 2, what=f"the count to go on after {last}")
        assert state(target.pid) not in ("T", "t", None)
        assert ckpt_json("list") == [], f"a checkpoint is visible after aborting at {last}"
        assert staged(isolated_env) == [], f"staging left after aborting at {last}"

    # the locks are free
    with DumpSession(isolated_env, DumpRequest(pid=target.pid, name="s"), settings=env_settings()) as session:
        session.prepare()
        session.capture()
        manifest = session.commit()
        session.abort()  # after the commit: the checkpoint stays, the rest is cleaned up
    assert [c["id"] for c in ckpt_json("list")] == [manifest.id]
    assert staged(isolated_env) == []
    assert verify(Store.open(isolated_env, settings=env_settings()).objects, manifest) == []


def test_an_exception_inside_the_session_aborts_it(procs, tmp_path, isolated_env):
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: counted(out) >= 3, what="the counter")
    with pytest.raises(KeyboardInterrupt):
        with DumpSession(isolated_env, DumpRequest(pid=target.pid), settings=env_settings()) as session:
            session.prepare()
            session.capture()
            raise KeyboardInterrupt  # Ctrl-C between capture and commit
    assert ckpt_json("list") == [] and staged(isolated_env) == []
    assert ckpt_json("dump", target.pid)["pid"] == target.pid


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_restore_session_aborted_after_any_phase_leaves_nothing_running(procs, tmp_path, isolated_env, lazy):
    """The destination side of a move: aborted after prepare, nothing runs and nothing is left
    (page server, staged images); aborted after restore, the restored tree is ended; run
    through, the tree counts on from its checkpoint."""
    from ckpt.commands.restore import RestoreRequest, RestoreSession
    from tests.helpers import alive

    out = tmp_path / "count.txt"
    target, dumped, at_dump = stopped_counter(procs, out)
    request = RestoreRequest(ref=dumped["id"], lazy=lazy or None)

    session = RestoreSession(isolated_env, request, settings=env_settings())
    session.prepare()
    session.abort()
    assert staged(isolated_env) == [] and not alive(target.pid)

    with pytest.raises(KeyboardInterrupt):
        with RestoreSession(isolated_env, request, settings=env_settings()) as session:
            session.prepare()
            pid = session.restore()
            assert pid == target.pid and alive(pid)
            raise KeyboardInterrupt  # the coordinator gives the restore up
    wait_until(lambda: state(target.pid) in (None, "Z"), what="the aborted restore's tree to be ended")
    # (a lazy restore's page server owns the images once the tree runs: it removes them as it ends)
    wait_until(lambda: staged(isolated_env) == [], timeout=30, what="the staged images to go")

    with RestoreSession(isolated_env, request, settings=env_settings()) as session:
        session.prepare()
        session.restore()
        result = session.finish()
    procs.adopt(result.pid)
    wait_until(lambda: counted(out) > at_dump + 3, what="the restored counter")
    values = [int(line) for line in read_lines(out)]
    assert values[:values.index(at_dump) + 1] == list(range(1, at_dump + 1))
    # (the aborted restore's tree ran for a moment, from the same checkpoint, before it was ended)
    last_run = values[len(values) - 1 - values[::-1].index(at_dump + 1):]
    assert last_run[:3] == [at_dump + 1, at_dump + 2, at_dump + 3], "the restored counter did not go on"


def test_a_held_dump_keeps_the_tree_frozen_until_released_or_aborted(procs, tmp_path, isolated_env):
    """What a group checkpoint does with each member: capture_frozen() returns with the tree
    frozen and dumped by real CRIU; the count does not move until release(); an abort instead
    thaws it with nothing committed."""
    import time

    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: counted(out) >= 3, what="the counter")
    with DumpSession(isolated_env, DumpRequest(pid=target.pid, name="held"), settings=env_settings()) as session:
        session.prepare()
        session.capture_frozen()
        frozen_at = counted(out)
        time.sleep(1.0)  # the counter writes every 0.1 s when it runs
        assert counted(out) == frozen_at and state(target.pid) in ("t", "T"), "the tree ran while held"
        session.release()
        manifest = session.commit()
        session.finish()
    wait_until(lambda: counted(out) > frozen_at + 2, what="the count to go on after release")
    assert [c["id"] for c in ckpt_json("list")] == [manifest.id]

    session = DumpSession(isolated_env, DumpRequest(pid=target.pid, name="held"), settings=env_settings())
    session.prepare()
    session.capture_frozen()
    held_at = counted(out)
    session.abort()
    wait_until(lambda: counted(out) > held_at + 2, what="the count to go on after the abort")
    assert [c["id"] for c in ckpt_json("list")] == [manifest.id] and staged(isolated_env) == []


def test_a_held_restore_runs_nothing_until_released_or_aborted(procs, tmp_path, isolated_env):
    """What a group restore does with each member: restore_held() returns with every process
    restored by real CRIU and none running (the count stands at the checkpoint's); an abort
    ends them; release() lets the tree count on from its checkpoint."""
    import time

    from ckpt.commands.restore import RestoreRequest, RestoreSession

    out = tmp_path / "count.txt"
    target, dumped, at_dump = stopped_counter(procs, out)
    request = RestoreRequest(ref=dumped["id"], lazy=False)

    session = RestoreSession(isolated_env, request, settings=env_settings())
    session.prepare()
    session.restore_held()
    time.sleep(0.5)  # the counter writes every 0.05 s once it runs
    assert counted(out) == at_dump, "the held tree ran"
    session.abort()
    wait_until(lambda: state(target.pid) in (None, "Z"), what="the aborted restore's tree to be ended")
    assert counted(out) == at_dump and staged(isolated_env) == []

    with RestoreSession(isolated_env, request, settings=env_settings()) as session:
        session.prepare()
        session.restore_held()
        time.sleep(0.5)
        assert counted(out) == at_dump, "the held tree ran"
        session.release()
        result = session.finish()
    procs.adopt(result.pid)
    wait_until(lambda: counted(out) > at_dump + 3, what="the released counter")
    assert [int(line) for line in read_lines(out)][at_dump - 1:at_dump + 3] == list(range(at_dump, at_dump + 4))
