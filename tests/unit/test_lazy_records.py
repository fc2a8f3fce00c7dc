"""Records of running page servers (CKPT_LAZY_DIR): which count as live (a dump of their tree
waits for them) and which are stale (removed)."""

import json
import os

from ckpt.restore import lazy
from ckpt.system import procfs


def write(directory, name, record):
    (directory / f"{name}.json").write_text(json.dumps(record))


def test_a_record_names_its_server_by_pid_and_start_time(tmp_path):
    me = os.getpid()
    here = lazy._pid_namespace()
    write(tmp_path, "live", {"server_pid": me, "server_start": procfs.start_ticks(me), "pidns": here, "pids": [1]})
    # Its PID taken by another process since: the start time differs.
    write(tmp_path, "reused", {"server_pid": me, "server_start": procfs.start_ticks(me) - 1, "pidns": here,
                               "pids": [2]})
    # An older ckpt's record, no start time, whose PID is a kernel thread's now (kthreadd, PID 2).
    write(tmp_path, "kernel", {"server_pid": 2, "pids": [3]})
    # A server in a PID namespace of its own: its PIDs are not this namespace's; left alone.
    write(tmp_path, "elsewhere", {"server_pid": 10, "server_start": 1, "pidns": here + 1, "pids": [4]})
    live = lazy._live_records(tmp_path)
    assert [r["pids"] for r in live] == [[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.json", "live.json"]


def _pipe_answer(fd: int) -> bytes:
    import select

    assert select.select([fd], [], [], 10)[0], "the server's lock said nothing"
    return os.read(fd, 512)


def test_the_page_servers_lock_is_held_once_it_says_so_and_keeps_a_prune_out(tmp_path):
    import pytest

    from ckpt.errors import StoreBusy
    from ckpt.store import Store
    from tests.helpers import env_settings

    store = Store.open(tmp_path / "store", create=True, settings=env_settings())
    read_end, write_end = os.pipe()
    published = []
    held = lazy._ServerLock(store, write_end, lambda: published.append(True))  # taken in a thread
    try:
        assert _pipe_answer(read_end) == b"L" and published == [True], "its record first, then L"
        with pytest.raises(StoreBusy):  # a prune's lock now waits for the server
            with store.lock(exclusive=True, timeout=0.2):
                pass
    finally:
        held.release()
        os.close(read_end)
    with store.lock(exclusive=True, timeout=0.2):  # let go once the server is done
        pass


def test_a_page_server_that_cannot_lock_the_store_fails_the_restore_before_its_lock_goes(tmp_path, monkeypatch):
    import pytest

    from ckpt.errors import CriuFailed
    from ckpt.store import Store
    from tests.helpers import env_settings

    monkeypatch.setattr(lazy, "READY_TIMEOUT_S", 0.3)
    store = Store.open(tmp_path / "store", create=True, settings=env_settings())
    read_end, write_end = os.pipe()
    with store.lock(exclusive=True, timeout=1):  # a prune holds the store
        published: list[bool] = []
        held = lazy._ServerLock(store, write_end, lambda: published.append(True))
        server = lazy.PageServer(pid=0, group=0, watcher_pid=0, work_dir=tmp_path, log_path=tmp_path / "log",
                                 records=tmp_path, locked=read_end)
        with pytest.raises(CriuFailed, match="could not lock the store: .*locked"):
            server.wait_locked()
        held.release()
    assert server.locked == -1 and published == [], "no record of a server without its lock"
    server.wait_locked()  # said once: returns at once
