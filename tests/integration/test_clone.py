"""`ckpt clone ID --copies 4` with real CRIU (docs/design.md, "Clones"): four copies of an agent
(tests/fixtures/clone_agent.py) run at once, each in PID and network namespaces of its own. The
counting server (on the host, bound to every address: a copy reaches it through its veth's host
end) sees call 1, made before the checkpoint, once in all (the original's), and call 2, made
after it through the journal, once per copy and once by the original; each copy's port answers
in its namespace; each copy's ckpt.checkpoint() returned restored=True and its own number.

Needs the restore of one copy (ckpt/restore/copies.py): skipped until that is in the tree."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ckpt.restore import copynet
from ckpt.system import procfs
from tests.helpers import ROOT, ckpt_json, wait_until

pytest.importorskip("ckpt.restore.copies", reason="the restore of copies (ckpt/restore/copies.py) is not here yet")

COPIES = 4
NAME = "cloned"


class Counter:
    """An HTTP server on 0.0.0.0 that counts POST /call/N by body (who called)."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []
        lock = threading.Lock()
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                with lock:
                    calls.append((int(self.path.rsplit("/", 1)[1]), body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"counted")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def counter():
    server = Counter()
    yield server
    server.close()


def test_four_copies_each_do_their_next_action_once(tmp_path, counter, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root (CRIU, namespaces)")
    monkeypatch.setenv("CKPT_COPIES_DIR", str(tmp_path / "copies"))
    monkeypatch.setenv("CKPT_NAME", NAME)
    (tmp_path / "server_port").write_text(str(counter.port))
    listen_port = free_port()
    (tmp_path / "listen_port").write_text(str(listen_port))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen([sys.executable, str(ROOT / "tests/fixtures/clone_agent.py"), str(tmp_path)],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "agent.err", "w"), env=env, cwd=tmp_path)
    cloned = None
    try:
        wait_until((tmp_path / "result-original.json").exists, timeout=120, what="the original's checkpoint")
        original = json.loads((tmp_path / "result-original.json").read_text())
        assert original["restored"] is False and original["copy"] is None and original["info"] is None
        cloned = ckpt_json("clone", original["id"], "--copies", str(COPIES), env=env)
        cloned["watcher_identity"] = (cloned["watcher"], procfs.start_ticks(cloned["watcher"]))
        assert cloned["network"] == "own" and listen_port in cloned["ports"]
        assert [c["index"] for c in cloned["copies"]] == [1, 2, 3, 4]
        for k in range(1, COPIES + 1):
            wait_until(lambda k=k: (tmp_path / f"result-copy-{k}.json").exists(), timeout=60, what=f"copy {k}")
            seen = json.loads((tmp_path / f"result-copy-{k}.json").read_text())
            assert (seen["id"], seen["restored"], seen["copy"]) == (original["id"], True, k)
            assert seen["info"]["clone"] == cloned["clone"] and seen["info"]["checkpoint"] == original["id"]
        wait_until(lambda: len([c for c in counter.calls if c[0] == 2]) >= COPIES + 1, timeout=30, what="call 2s")
        time.sleep(1.0)  # a duplicate would come now
        assert sorted(counter.calls) == sorted([(1, "original"), (2, "original")]
                                               + [(2, f"copy-{k}") for k in range(1, COPIES + 1)])
        for copy in cloned["copies"]:
            answer = subprocess.run(["nsenter", f"--net=/run/netns/{copy['netns']}", sys.executable, "-c",
                                     f"import socket; print(socket.create_connection(('127.0.0.1', {listen_port}), "
                                     "timeout=10).recv(64).decode().strip())"],
                                    capture_output=True, text=True, timeout=30)
            assert answer.stdout.strip() == f"copy-{copy['index']}", answer.stderr
        listed = ckpt_json("list", env=env)
        (row,) = [r for r in listed if r["id"] == original["id"]]
        assert sorted(c["index"] for c in row["running_copies"]) == [1, 2, 3, 4]
        end_copies(cloned)
        expect_cleaned_up(cloned, tmp_path / "copies")
    finally:
        if cloned is not None:
            end_copies(cloned)
            remove_leftovers(cloned, tmp_path / "copies")
        agent.kill()
        agent.wait()


def end_copies(cloned: dict) -> None:
    """Each copy's init killed: its PID namespace ends with it."""
    for copy in cloned["copies"]:
        try:
            os.kill(copy["init_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def expect_cleaned_up(cloned: dict, copies_dir: Path, timeout: float = 10.0) -> None:
    """The clone's watcher removes, within seconds of the copies' end, their network namespaces
    and records, identity files, the registry, and the nft table once no copy network is left."""
    netns = [c["netns"] for c in cloned["copies"] if c["netns"]]
    registry = Path(cloned["registry"])

    def clean() -> bool:
        return (not any(Path("/run/netns", n).exists() for n in netns) and not list(copies_dir.glob("net-*.json"))
                and not list(copies_dir.glob("pidns-*.json")) and not registry.exists())

    wait_until(clean, timeout=timeout, what="the watcher to clean up after the copies")
    others = [n for n in os.listdir("/run/netns") if n.startswith("ckpt-")] if os.path.isdir("/run/netns") else []
    if netns and not others:  # (another clone's copies on this machine keep the table)
        wait_until(lambda: f"ip {copynet.TABLE}" not in nft_tables(), timeout=timeout, what="the nft table to go")
    wait_until(lambda: not procfs.is_running(*cloned["watcher_identity"]), timeout=timeout, what="the watcher to end")


def nft_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=30).stdout


def remove_leftovers(cloned: dict, copies_dir: Path) -> None:
    """Whatever the watcher did not remove (the test failed before it could): networks by their
    records, identity files, the registry; the watcher itself, by its PID and start time."""
    if cloned.get("watcher_identity") and procfs.is_running(*cloned["watcher_identity"]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(cloned["watcher_identity"][0], signal.SIGKILL)
    for copy in cloned["copies"]:
        wait_until(lambda c=copy: not procfs.is_running(c["init_pid"], c["init_start"]), timeout=10,
                   what="a copy's init to end")
    copynet.remove_stale(copies_dir)
    for path in [*copies_dir.glob("pidns-*.json"), Path(cloned["registry"])]:
        path.unlink(missing_ok=True)


def test_copies_share_one_layout_of_the_images_and_keep_the_memory(tmp_path, procs, monkeypatch):
    """The first copy lays the images out and the others restore from links to its files
    (CRIU's auto_dedup off: it would punch holes the others then read as zeros): each copy's
    64 MiB of random data is the original's, byte for byte (dirtymem.py's checksum)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CRIU, namespaces)")
    copies_dir = tmp_path / "copies"
    monkeypatch.setenv("CKPT_COPIES_DIR", str(copies_dir))
    out = tmp_path / "mem.txt"
    original = procs.start("dirtymem.py", out, 64, "off", 1)
    wait_until(lambda: out.exists() and "ready" in out.read_text(), timeout=60, what="the data to be written")
    os.kill(original.pid, signal.SIGUSR1)
    wait_until(lambda: "sum" in out.read_text(), what="the original's checksum")
    (expected,) = [line.split()[1] for line in out.read_text().splitlines() if line.startswith("sum")]
    dumped = ckpt_json("dump", original.pid)
    procs.kill_tree(original.pid)
    cloned = None
    try:
        from tests.helpers import ckpt

        run = ckpt("clone", dumped["id"], "--copies", "3", "--net", "host", "--json")
        cloned = json.loads(run.stdout)
        cloned["watcher_identity"] = (cloned["watcher"], procfs.start_ticks(cloned["watcher"]))
        assert run.stderr.count("sharing the images of checkpoint") == 2, run.stderr
        for copy in cloned["copies"]:
            sums = len(out.read_text().splitlines())
            os.kill(copy["pid"], signal.SIGUSR1)
            wait_until(lambda n=sums: len(out.read_text().splitlines()) > n, what=f"copy {copy['index']}'s checksum")
        found = [line.split()[1] for line in out.read_text().splitlines() if line.startswith("sum")][1:]
        assert found == [expected] * 3
        end_copies(cloned)
        expect_cleaned_up(cloned, copies_dir)
    finally:
        if cloned is not None:
            end_copies(cloned)
            remove_leftovers(cloned, copies_dir)
