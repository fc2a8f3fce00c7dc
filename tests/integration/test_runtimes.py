"""Programs nobody here wrote, as a new user would try them: a Node.js server with a client
holding a keep-alive connection, a JVM with many threads. Skipped where the runtime is absent."""

import http.client
import shutil
import time

import pytest

from tests.helpers import FIXTURES, alive, ckpt_json, read_lines, wait_until


def _threads(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


@pytest.mark.skipif(not shutil.which("node"), reason="Node.js is not installed")
def test_node_server_keeps_its_state_and_its_keep_alive_client(procs, tmp_path):
    port_file = tmp_path / "port"
    server = procs.start_program(["node", FIXTURES / "node_server.js", port_file], "node")
    port = int(wait_until(lambda: read_lines(port_file), timeout=30, what="node to listen")[0])
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def get() -> int:
        client.request("GET", "/")
        response = client.getresponse()
        assert response.status == 200
        return int(response.read())

    served = [get() for _ in range(5)]
    local_port = client.sock.getsockname()[1]
    dumped = ckpt_json("dump", server.pid, "--stop")
    server.wait(timeout=10)
    assert dumped["processes"] == 1
    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    # The same connection (same local port, never reopened) and the count goes on.
    served += [get() for _ in range(5)]
    assert client.sock.getsockname()[1] == local_port
    assert served == list(range(1, 11))
    # And it still accepts new clients.
    other = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    other.request("GET", "/")
    assert int(other.getresponse().read()) == 11
    client.close()
    other.close()


@pytest.mark.skipif(not shutil.which("java"), reason="no Java runtime is installed")
def test_jvm_with_many_threads_carries_on_counting(procs, tmp_path):
    out = tmp_path / "sums.txt"
    # The single-file source launcher compiles in memory: no build step, no class files.
    jvm = procs.start_program(["java", "-Xmx64m", FIXTURES / "JavaThreads.java", out], "java")
    wait_until(lambda: len(read_lines(out)) >= 5, timeout=120, what="the JVM to count")
    threads = _threads(jvm.pid)
    assert threads > 32
    dumped = ckpt_json("dump", jvm.pid, "--stop")
    jvm.wait(timeout=30)
    last_sum = int(read_lines(out)[-1].split()[0])
    lines_before = len(read_lines(out))
    time.sleep(0.5)
    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    assert alive(restored["pid"]) and _threads(restored["pid"]) > 32
    wait_until(lambda: len(read_lines(out)) >= lines_before + 10, timeout=30, what="the restored JVM to count")
    after = [line.split() for line in read_lines(out)[lines_before:]]
    # It goes on from where it stopped (no restart from zero), with every worker alive.
    assert all(int(s) >= last_sum for s, _ in after) and int(after[-1][0]) > last_sum
    assert all(int(alive_workers) == 32 for _, alive_workers in after)
