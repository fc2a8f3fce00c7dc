"""The dump use case (ckpt/commands/dump.py, DumpSession) against a fake CRIU
(tests/commands/fakes_dump.py) and a store in a temporary directory: its phases, its abort from
each of them, --stop's commit while the tree is frozen, the clock of its figures. Fast: the
target is a real process (the pre-flight reads /proc) that nothing freezes. Real CRIU dumps are
in tests/integration (test_sessions.py, test_roundtrip.py, ...)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from ckpt.commands.dump import DumpRequest, DumpSession
from ckpt.errors import CriuFailed, SessionAborted, StoreBusy, UsageError
from ckpt.store import Store, ids
from ckpt.store.verify import verify
from tests.commands.fakes_dump import PAGE, FakeCriu, alive, end, pages, start_target
from tests.helpers import env_settings


@pytest.fixture
def store(tmp_path, settings) -> Store:
    return Store.open(tmp_path / "store", create=True, settings=settings)


@pytest.fixture
def target():
    process = start_target()
    yield process
    end(process)


@pytest.fixture
def settings():
    # The page stream needs a CRIU that streams: this fake writes a pages image.
    return replace(env_settings(), page_stream=False)


def session(store: Store, pid: int, criu: FakeCriu, settings, **request) -> DumpSession:
    return DumpSession(store.root, DumpRequest(pid=pid, dirty_tracking=False, **request), store=store,
                       criu=lambda _settings: criu, settings=settings)


def assert_nothing_left(store: Store, staged: list[Path]) -> None:
    """No staging behind, and every lock free: the store's exclusive lock is taken at once."""
    assert [path for path in staged if path.exists()] == []
    with store.lock(exclusive=True, timeout=0):
        pass


def test_the_phases_in_a_row_commit_the_pages_criu_dumped(store, target, settings, tmp_path):
    criu = FakeCriu(memory=pages(8))
    with session(store, target.pid, criu, settings, name="web") as dump:
        dump.prepare()
        staged = [dump.staging.root]
        dump.capture()
        manifest = dump.commit()
        result = dump.finish()
    assert store.checkpoint_ids() == [manifest.id] and result.manifest.id == manifest.id
    assert manifest.name == "web" and manifest.pid == target.pid and manifest.stats["pages"] == 8
    assert criu.notified == ["pre-dump", "post-dump"]
    assert alive(target.pid), "a dump without --stop leaves the tree running"
    assert verify(store.objects, manifest) == []
    out = tmp_path / "pages-1.img"
    entry = next(e for e in manifest.files if e.name == "pages-1.img")
    store.blocks.write_image(entry.name, store.objects.load_page_list(entry), out, check_ids=True)
    assert out.read_bytes() == criu.memory
    assert_nothing_left(store, staged)


@pytest.mark.parametrize("last", ["nothing", "prepare", "capture"])
def test_an_abort_after_any_phase_commits_nothing_and_leaves_nothing_behind(store, target, settings, last):
    criu = FakeCriu()
    dump = session(store, target.pid, criu, settings)
    staged: list[Path] = []
    if last in ("prepare", "capture"):
        dump.prepare()
        staged.append(dump.staging.root)
        assert staged[0].exists()
    if last == "capture":
        dump.capture()
    dump.abort()
    dump.abort()  # idempotent
    assert store.checkpoint_ids() == []
    assert_nothing_left(store, staged)
    assert alive(target.pid)
    # The target's own lock is free too: the next dump of it goes through.
    with session(store, target.pid, FakeCriu(), settings) as again:
        again.prepare()
        again.capture()
        again.commit()
        again.finish()
    assert len(store.checkpoint_ids()) == 1


@pytest.mark.parametrize("capture", ["capture", "capture_frozen"])
def test_a_criu_failure_during_capture_aborts_the_dump(store, target, settings, capture):
    """capture_frozen() raises CRIU's failure too when it comes before the hold."""
    criu = FakeCriu(fail_dump=True)
    with pytest.raises(CriuFailed), session(store, target.pid, criu, settings) as dump:
        dump.prepare()
        staged = [dump.staging.root]
        getattr(dump, capture)()
    assert criu.notified == ["pre-dump"]
    assert store.checkpoint_ids() == []
    assert_nothing_left(store, staged)


def test_stop_commits_the_checkpoint_before_criu_ends_the_tree(store, target, settings):
    seen_at_post_dump: list[list[str]] = []
    criu = FakeCriu(target=target, at_post_dump=lambda: seen_at_post_dump.append(store.checkpoint_ids()))
    with session(store, target.pid, criu, settings, stop=True) as dump:
        dump.prepare()
        dump.capture()
        assert dump.manifest is not None, "--stop commits in capture, while the tree is frozen"
        assert dump.commit() is dump.manifest  # nothing committed twice
        result = dump.finish()
    assert seen_at_post_dump == [[result.manifest.id]]
    assert not alive(target.pid)
    assert result.to_json()["stopped"] is True


def test_a_checkpoint_id_given_twice_is_refused_before_anything_is_staged(store, target, settings):
    chosen = ids.new_id()
    with session(store, target.pid, FakeCriu(), settings, checkpoint_id=chosen) as first:
        first.prepare()
        first.capture()
        first.commit()
        first.finish()
    criu = FakeCriu()
    with pytest.raises(UsageError, match="exists already"), \
            session(store, target.pid, criu, settings, checkpoint_id=chosen) as second:
        second.prepare()
    assert second.staging is None and criu.notified == []
    assert store.checkpoint_ids() == [chosen]
    assert_nothing_left(store, [])


def test_the_freeze_of_a_stop_dump_is_timed_by_the_sessions_clock(store, target, settings):
    ticks = iter(range(100, 200))  # one second per reading
    criu = FakeCriu(target=target)
    with session(store, target.pid, criu, settings, stop=True) as dump:
        dump.clock = lambda: float(next(ticks))
        dump.prepare()
        dump.capture()
        result = dump.finish()
    # pre-dump and post-dump are two readings in a row: one second frozen, as the fake CRIU
    # writes no stats-dump image to say otherwise.
    assert result.manifest.stats["freeze_ms"] == 1000.0


def test_a_store_lock_held_elsewhere_refuses_the_dump_before_anything_is_staged(store, target, settings):
    """The session waits for the store lock as long as its settings say (here: not at all)."""
    criu = FakeCriu()
    with store.lock(exclusive=True), pytest.raises(StoreBusy), \
            session(store, target.pid, criu, replace(settings, lock_timeout=0.0)) as dump:
        dump.prepare()
    assert dump.staging is None and criu.notified == []
    assert store.checkpoint_ids() == []


def test_a_next_dump_streams_its_pages_and_keeps_only_those_that_changed(store, target, settings, tmp_path):
    """With an earlier checkpoint of the target, CRIU streams the pages (ckpt/dump/pagestream.py):
    the one page changed since is the one page stored."""
    streaming = replace(settings, page_stream=True)
    first = pages(8)
    for memory in (first, first[:5 * PAGE] + pages(1, 100) + first[6 * PAGE:]):
        criu = FakeCriu(memory=memory)
        with session(store, target.pid, criu, streaming) as dump:
            dump.prepare()
            dump.capture()
            manifest = dump.commit()
            dump.finish()
    assert criu.streamed, "the second dump had an earlier checkpoint to compare with"
    assert (manifest.stats["pages"], manifest.stats["pages_new"]) == (8, 1)
    out = tmp_path / "pages-1.img"
    entry = next(e for e in manifest.files if e.name == "pages-1.img")
    store.blocks.write_image(entry.name, store.objects.load_page_list(entry), out, check_ids=True)
    assert out.read_bytes() == criu.memory


# ---- a coordinator's hold: capture_frozen(), then release() or abort() ----------------------

def test_a_coordinator_holds_the_tree_frozen_until_it_releases_it(store, target, settings):
    """capture_frozen() returns while CRIU sits in its post-dump notification (the tree frozen,
    its memory dumped); only release() lets CRIU go on; the commit comes after, as capture's."""
    criu = FakeCriu()
    with session(store, target.pid, criu, settings, name="member") as dump:
        dump.prepare()
        dump.capture_frozen()
        assert criu.notified == ["pre-dump", "post-dump"] and not criu.finished, "CRIU was let go before release"
        assert store.checkpoint_ids() == []
        dump.release()
        assert criu.finished
        manifest = dump.commit()
        dump.finish()
    assert store.checkpoint_ids() == [manifest.id] and alive(target.pid)


def test_an_abort_while_the_tree_is_held_refuses_criu_and_commits_nothing(store, target, settings):
    criu = FakeCriu()
    dump = session(store, target.pid, criu, settings)
    dump.prepare()
    staged = [dump.staging.root]
    dump.capture_frozen()
    dump.abort()  # from another member's failure, say
    assert not criu.finished, "the post-dump notification was answered as a success"
    assert store.checkpoint_ids() == [] and alive(target.pid)
    assert_nothing_left(store, staged)


def test_a_hold_past_its_limit_ends_as_an_abort(store, target, settings):
    criu = FakeCriu()
    with session(store, target.pid, criu, settings) as dump:
        dump.prepare()
        dump.capture_frozen(hold_limit=0.2)
        time.sleep(0.5)  # the coordinator stalls past the limit
        with pytest.raises(SessionAborted, match="held frozen for 0.2 s without being released"):
            dump.release()  # too late: the notification was refused
    assert not criu.finished and store.checkpoint_ids() == [] and alive(target.pid)


def test_a_held_stop_dump_commits_first_and_ends_the_tree_only_once_released(store, target, settings):
    criu = FakeCriu(target=target)
    with session(store, target.pid, criu, settings, stop=True) as dump:
        dump.prepare()
        dump.capture_frozen()
        assert dump.manifest is not None and store.checkpoint_ids() == [dump.manifest.id]
        assert alive(target.pid), "the tree was ended before the coordinator released it"
        dump.release()
        dump.finish()
    assert not alive(target.pid)



def test_a_coordinator_interrupted_before_the_hold_leaves_criu_nothing_to_go_on_with(store, target, settings):
    """Ctrl-C (or another member's failure) while CRIU is still dumping: the interrupted
    capture_frozen() waits for CRIU's thread and refuses its post-dump notification, so the
    abort after it never removes the staging under a running CRIU, and nothing is committed."""
    import signal
    import threading

    criu = FakeCriu(stop_for=0.5)
    with pytest.raises(KeyboardInterrupt), session(store, target.pid, criu, settings, stop=True) as dump:
        dump.prepare()
        staged = [dump.staging.root]
        signal.signal(signal.SIGALRM, signal.default_int_handler)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            dump.capture_frozen()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert [t.name for t in threading.enumerate() if t.name == "ckpt-criu"] == []
    assert not criu.finished and store.checkpoint_ids() == [] and alive(target.pid)
    assert_nothing_left(store, staged)


def test_an_abort_from_another_thread_while_criu_works_refuses_the_late_notification(store, target, settings):
    """A group coordinator aborts a member from its own thread (a phase timeout, Ctrl-C) while
    that member's CRIU is still on its way to post-dump: with --stop the late notification
    is refused, so nothing is committed and CRIU thaws the tree instead of ending it."""
    import threading

    criu = FakeCriu(target=target, stop_for=0.5)
    dump = session(store, target.pid, criu, settings, stop=True)
    dump.prepare()
    failed: list[BaseException] = []

    def capture() -> None:
        try:
            dump.capture_frozen()
        except BaseException as exc:  # noqa: BLE001 (what the capture thread ended with)
            failed.append(exc)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    time.sleep(0.2)  # CRIU dumps, not yet at post-dump
    dump.abort()
    thread.join(5)
    assert not thread.is_alive(), "the capture did not end with the abort"
    assert store.checkpoint_ids() == []
    assert alive(target.pid)
