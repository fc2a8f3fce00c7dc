"""Copies of a clone (docs/design.md, "Clones"; ckpt/restore/copies.py, copynet.py): one
checkpoint restored N times at once by RestoreSessions with RestoreRequest.copy, each copy in a
PID namespace of its own whose init is ckpt's reaper, optionally in a network namespace of its
own; a copy dumped again (from its init) and that checkpoint restored. Real CRIU, real
processes; every process, namespace and nft table made here is removed, even on failure."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from ckpt.commands.restore import RestoreRequest, RestoreResult, RestoreSession
from ckpt.restore import copynet, copywatch
from ckpt.restore.copies import CopyPlacement
from ckpt.store import ids
from ckpt.system import procfs
from tests.helpers import alive, ckpt_json, env_settings, read_lines, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def copies_dir(tmp_path, monkeypatch):
    path = tmp_path / "copies"
    monkeypatch.setenv("CKPT_COPIES_DIR", str(path))
    yield path
    # The namespaces of every copy this test made, whatever happened to the copies.
    for record in path.glob("net-*.json"):
        data = json.loads(record.read_text())
        copynet.tear_down(path, copynet.CopyNetwork(data["netns"], data["host_veth"], data["slot"]))


@pytest.fixture
def copies(procs):
    """The results of the copies this test restored: their inits are killed at teardown (that
    ends each copy's whole PID namespace), before the copies' namespaces go."""
    made: list[RestoreResult] = []
    yield made
    for result in made:
        if result.copy is not None:
            try:
                os.kill(result.copy.init_pid, 9)
            except ProcessLookupError:
                pass
    for result in made:
        if result.copy is not None:
            wait_until(lambda r=result: not alive(r.copy.init_pid), timeout=10, what="a copy's init to end")


def counts(path: Path) -> dict[int, list[int]]:
    """{PID namespace inode: the values counted there, in order}."""
    found: dict[int, list[int]] = {}
    for line in read_lines(path):
        value, namespace = line.split()
        found.setdefault(int(namespace), []).append(int(value))
    return found


def own_pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def restore_copies(checkpoint: str, count: int, network: str, made: list[RestoreResult]) -> list[RestoreResult]:
    """`count` copies of checkpoint restored at once, one RestoreSession per thread."""
    clone = ids.new_id()
    results: dict[int, RestoreResult] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            request = RestoreRequest(checkpoint, copy=CopyPlacement(clone, index, count, network))
            with RestoreSession(env_settings().store, request, settings=env_settings()) as session:
                session.prepare()
                session.restore()
                results[index] = session.finish()
                made.append(results[index])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(1, count + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert sorted(results) == list(range(1, count + 1))
    return [results[k] for k in sorted(results)]


def test_three_copies_count_on_from_the_checkpoint_beside_the_original(procs, tmp_path, copies_dir, copies):
    out = tmp_path / "count.txt"
    original = procs.start("ns_counter.py", out)
    wait_until(lambda: len(counts(out).get(own_pidns(), [])) >= 5, what="the counter")
    before = counts(out)[own_pidns()][-1]
    dumped = ckpt_json("dump", original.pid)
    after = counts(out)[own_pidns()][-1]

    results = restore_copies(dumped["id"], 3, "host", copies)
    namespaces = {r.copy.pidns_inode for r in results if r.copy}
    assert len(namespaces) == 3 and own_pidns() not in namespaces
    for k, result in enumerate(results, start=1):
        info = result.copy
        assert info is not None and info.index == k and info.netns is None and info.address is None
        # The original's PID again, inside the copy's namespace; the copy's init is its parent.
        assert result.pid_in_namespace == info.pid_in_namespace == original.pid
        assert Path(f"/proc/{info.pid}/stat").read_text().split()[3] == str(info.init_pid)
        assert Path(f"/proc/{info.init_pid}/comm").read_text().strip() == "ckpt-init"
        identity = json.loads((copies_dir / f"pidns-{info.pidns_inode}.json").read_text())
        assert {k2: identity[k2] for k2 in ("format", "copy", "copies", "checkpoint")} == \
            {"format": 2, "copy": k, "copies": 3, "checkpoint": dumped["id"]}
        # Its init, by host PID and start time: the file is true only while that init runs.
        assert identity["init"] == [info.init_pid, procfs.start_ticks(info.init_pid)]
        # Readable by a copy running as another user; the directory too.
        assert oct((copies_dir / f"pidns-{info.pidns_inode}.json").stat().st_mode & 0o777) == "0o644"
        assert oct(copies_dir.stat().st_mode & 0o777) == "0o755"
    wait_until(lambda: all(len(counts(out).get(n, [])) >= 5 for n in namespaces), what="every copy to count")
    for namespace in namespaces:
        values = counts(out)[namespace]
        # From the checkpoint's value on, one step at a time: not from 1, not the original's later ones.
        assert values == list(range(values[0], values[0] + len(values))), values
        assert before < values[0] <= after + 1, (before, values[0], after)
    assert alive(original.pid)
    n = len(counts(out)[own_pidns()])
    wait_until(lambda: len(counts(out)[own_pidns()]) >= n + 3, what="the original to count on")


def in_netns(netns: str, code: str) -> str:
    """Python run inside the network namespace `netns` (nsenter): its output."""
    proc = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "/usr/bin/python3", "-c", code],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def exchange(host: str, port: int, word: str) -> str:
    return ("import socket\n"
            f"s = socket.create_connection(({host!r}, {port}), timeout=5)\n"
            f"s.sendall(b{word!r} + b'\\n')\n"
            "print(s.makefile().readline().strip())\n")


def test_a_copy_with_its_own_network_listens_there_and_reaches_the_host(procs, tmp_path, copies_dir, copies):
    log = tmp_path / "server.txt"
    server = procs.start("echo_server.py", log)
    port = int(wait_until(lambda: read_lines(log), what="the echo server's port")[0].split()[1])
    dumped = ckpt_json("dump", server.pid)

    (result,) = restore_copies(dumped["id"], 1, "own", copies)
    info = result.copy
    assert info is not None and info.netns and info.address and info.address.startswith("10.214.")
    assert os.stat(f"/proc/{info.pid}/ns/net").st_ino == os.stat(f"/run/netns/{info.netns}").st_ino
    # The copy listens at its port inside its namespace, while the original still has it here.
    assert in_netns(info.netns, exchange("127.0.0.1", port, "copy")).strip() == "copy"
    assert [x for x in read_lines(log) if x.startswith("accept")], "the copy logged no connection"
    # The original (same port, the host's loopback) is not the copy: both answer, each in its namespace.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"original\n")
        assert s.makefile().readline() == "original\n"
    # Out of the namespace: a server of the test's on the host, at the host end's address.
    host_end = json.loads((copies_dir / f"net-{info.netns}.json").read_text())
    network = copynet.CopyNetwork(info.netns, host_end["host_veth"], host_end["slot"])
    listener = socket.create_server((network.host_address, 0))
    try:
        threading.Thread(target=_echo_once, args=(listener,), daemon=True).start()
        answer = in_netns(info.netns, exchange(network.host_address, listener.getsockname()[1], "out"))
        assert answer.strip() == "out"
    finally:
        listener.close()
    assert "ip ckpt-copies" in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def _echo_once(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.sendall(conn.makefile().readline().encode())


def test_a_copy_dumped_from_its_root_restores_and_counts_on(procs, tmp_path, copies_dir, copies):
    out = tmp_path / "count.txt"
    original = procs.start("ns_counter.py", out)
    wait_until(lambda: len(counts(out).get(own_pidns(), [])) >= 3, what="the counter")
    dumped = ckpt_json("dump", original.pid)
    procs.kill_tree(original.pid)
    (result,) = restore_copies(dumped["id"], 1, "own", copies)
    info = result.copy
    assert info is not None
    wait_until(lambda: len(counts(out).get(info.pidns_inode, [])) >= 3, what="the copy to count")

    from tests.helpers import ckpt
    again = ckpt("dump", info.pid, "--json")
    assert f"dumping the whole namespace from its init, PID {info.init_pid}" in again.stderr, again.stderr
    second = json.loads(again.stdout)
    assert second["pid"] == info.init_pid
    os.kill(info.init_pid, 9)  # the copy ends: its namespace with it
    wait_until(lambda: not alive(info.pid), what="the copy to end")
    last = counts(out)[info.pidns_inode][-1]
    ended = len(read_lines(out))

    restored = ckpt_json("restore", second["id"])
    copy = restored["copy"]
    copies.append(_as_result(copy))
    assert copy["netns"] and copy["netns"] != info.netns  # (the PID namespace inode may be reused: the old one is gone)
    assert restored["pid"] == copy["pid"] and copy["pid_in_namespace"] == original.pid
    assert Path(f"/proc/{copy['init_pid']}/comm").read_text().strip() == "ckpt-init"
    assert os.stat(f"/proc/{copy['pid']}/ns/net").st_ino == os.stat(f"/run/netns/{copy['netns']}").st_ino
    later = tmp_path / "later.txt"  # the lines written since: the kernel may give the new namespace the old inode

    def restored_counts() -> list[int]:
        later.write_text("".join(f"{line}\n" for line in read_lines(out)[ended:]))
        return counts(later).get(copy["pidns_inode"], [])

    wait_until(lambda: len(restored_counts()) >= 3, what="the restored copy to count")
    values = restored_counts()
    assert values == list(range(values[0], values[0] + len(values))) and values[0] <= last + 1, (values, last)
    assert values[0] > 3


def _as_result(copy: dict):
    """Enough of a RestoreResult for the copies fixture to end it."""
    from types import SimpleNamespace

    return SimpleNamespace(copy=SimpleNamespace(init_pid=copy["init_pid"]))


def test_the_watcher_removes_what_each_copy_leaves_once_it_ends(procs, tmp_path, copies_dir, copies):
    """ckpt/restore/copywatch.py with real copies (what `ckpt clone` starts): once a copy's init
    is killed, its network namespace, veth, record and identity file go within seconds; the nft
    table and the registry with the last copy."""
    log = tmp_path / "server.txt"
    server = procs.start("echo_server.py", log)
    wait_until(lambda: read_lines(log), what="the echo server's port")
    dumped = ckpt_json("dump", server.pid)
    results = restore_copies(dumped["id"], 2, "own", copies)
    clone_id = ids.new_id()
    registry = copywatch.registry_path(copies_dir, clone_id)
    registry.write_text(json.dumps({"format": 1, "clone": clone_id, "copies": [
        {"index": r.copy.index, "init_pid": r.copy.init_pid, "init_start": procfs.start_ticks(r.copy.init_pid)}
        for r in results if r.copy]}))
    watcher = copywatch.start(copies_dir, clone_id)
    watcher_identity = (watcher, procfs.start_ticks(watcher))
    try:
        first, second = (r.copy for r in results)
        assert first is not None and second is not None and first.netns and second.netns
        os.kill(first.init_pid, 9)
        wait_until(lambda: not Path("/run/netns", first.netns).exists()
                   and not (copies_dir / f"net-{first.netns}.json").exists()
                   and not (copies_dir / f"pidns-{first.pidns_inode}.json").exists(),
                   timeout=10, what="copy 1's network and identity to go")
        assert Path("/run/netns", second.netns).exists() and (copies_dir / f"pidns-{second.pidns_inode}.json").exists()
        assert [c["index"] for c in json.loads(registry.read_text())["copies"]] == [2]
        os.kill(second.init_pid, 9)
        wait_until(lambda: not Path("/run/netns", second.netns).exists() and not registry.exists()
                   and not list(copies_dir.glob("pidns-*.json")), timeout=10, what="copy 2's network and identity")
        if not [n for n in os.listdir("/run/netns") if n.startswith("ckpt-")]:
            tables = lambda: subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout  # noqa: E731
            wait_until(lambda: f"ip {copynet.TABLE}" not in tables(), timeout=10, what="the nft table to go")
        wait_until(lambda: not procfs.is_running(*watcher_identity), timeout=10, what="the watcher to end")
    finally:
        if procfs.is_running(*watcher_identity):
            os.kill(watcher, 9)
