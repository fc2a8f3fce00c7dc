"""Round trips with real processes and real CRIU: each checks state after the original is gone
and the restored tree is running."""

import json
import os
import subprocess
import sys
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import (FIXTURES, ROOT, alive, ckpt, ckpt_json, dumped_file_reader, echo_server, read_lines,
                           state, tree_pids, wait_until)


def ints(path: Path) -> list[int]:
    return [int(line.split()[0]) for line in read_lines(path) if line.split()[0].isdigit()]


def test_counter_resumes_at_the_next_value_after_stop_and_restore(procs, tmp_path):
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: len(ints(out)) >= 10, what="counter to count")
    dumped = ckpt_json("dump", target.pid, "--stop", "--name", "counter")
    target.wait(timeout=10)  # --stop ended it
    assert dumped["stopped"] is True and dumped["pid"] == target.pid
    assert dumped["processes"] == 1 and dumped["bytes_stored"] > 0 and dumped["freeze_ms"] > 0
    last = ints(out)[-1]
    time.sleep(0.3)
    assert ints(out)[-1] == last, "the target kept running after --stop"

    restored = ckpt_json("restore", "counter")
    procs.adopt(restored["pid"])
    assert restored["pid"] == target.pid and restored["id"] == dumped["id"]
    wait_until(lambda: len(ints(out)) >= last + 5, what="restored counter to go on")
    values = ints(out)
    assert values[last] == last + 1, "the restored counter did not continue from its checkpoint"
    assert values == list(range(1, len(values) + 1))


def nft_tables() -> set[str]:
    return set(subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout.split("\n"))


def test_a_tree_without_tcp_connections_is_dumped_without_a_network_lock(procs, tmp_path):
    """The nftables lock keeps TCP connections quiet; without any it only cost the freeze time
    (0.1-0.2 s here) and, with --stop, left a table behind until a restore."""
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: len(ints(out)) >= 5, what="counter to count")
    tables = nft_tables()
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    assert ckpt_json("show", dumped["id"])["criu"]["options"]["network_lock"] == "skip"
    assert not {t for t in nft_tables() - tables if "CRIU" in t}, "the dump left a network lock table"
    last = ints(out)[-1]
    procs.adopt(ckpt_json("restore", dumped["id"])["pid"])
    wait_until(lambda: len(ints(out)) >= last + 3, what="restored counter to go on")
    assert ints(out)[last] == last + 1


def test_checkpoint_restores_again_and_again(procs, tmp_path):
    """restore, kill, restore again: and dump the restored tree with --stop, restore at once."""
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: len(ints(out)) >= 5, what="counter to count")
    checkpoint = ckpt("dump", target.pid, "--stop").stdout.strip()
    target.wait(timeout=10)
    for _ in range(2):
        pid = int(ckpt("restore", checkpoint).stdout)
        procs.adopt(pid)
        n = len(ints(out))
        wait_until(lambda: len(ints(out)) > n + 3, what="restored counter")
        os.kill(pid, signal.SIGKILL)  # not our child: init reaps it, late
    pid = int(ckpt("restore", checkpoint).stdout)
    procs.adopt(pid)
    second = ckpt("dump", pid, "--stop").stdout.strip()
    pid = int(ckpt("restore", second).stdout)  # immediately: PIDs must be waited for
    procs.adopt(pid)
    n = len(ints(out))
    wait_until(lambda: len(ints(out)) > n + 3, what="counter restored from the second checkpoint")


def test_large_memory_checksum_survives(procs, tmp_path):
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 256)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem to fill its memory")
    original_sum = read_lines(out)[0].split()[0]
    dumped = ckpt_json("dump", target.pid)
    assert dumped["bytes_total"] >= 256 << 20
    assert alive(target.pid), "a dump without --stop must leave the target running"
    procs.kill_tree(target.pid)
    out.unlink()

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_until(lambda: read_lines(out), what="restored bigmem to report")
    restored_sum, counter = read_lines(out)[0].split()
    assert restored_sum == original_sum
    assert int(counter) > 0


def test_multithreaded_process(procs, tmp_path):
    out = tmp_path / "threads.txt"
    target = procs.start("threads.py", out, 8)
    wait_until(lambda: len(read_lines(out)) >= 3, what="threads to count")
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    assert ckpt_json("show", dumped["id"])["processes"][0]["threads"].__len__() == 9
    before = [int(x) for x in read_lines(out)[-1].split()]
    n = len(read_lines(out))

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    wait_until(lambda: len(read_lines(out)) >= n + 5, what="restored threads")
    assert len(list(Path(f"/proc/{restored['pid']}/task").iterdir())) == 9
    first_after = [int(x) for x in read_lines(out)[n].split()]
    last = [int(x) for x in read_lines(out)[-1].split()]
    for k in range(8):
        # Each thread goes on from its checkpointed count (not from zero) and keeps counting.
        assert before[k] <= first_after[k] <= before[k] + 50
        assert last[k] > first_after[k]


def test_parent_and_child_with_pipe_and_socketpair(procs, tmp_path):
    out = tmp_path / "pipe.txt"
    target = procs.start("pipe_tree.py", out)
    wait_until(lambda: len(read_lines(out)) >= 10, what="pipe traffic")
    child = int(read_lines(out)[0].split()[1])
    dumped = ckpt_json("dump", target.pid, "--stop")
    assert dumped["processes"] == 2
    target.wait(timeout=10)
    n = len(ints(out))

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    wait_until(lambda: len(ints(out)) >= n + 10, what="restored pipe traffic")
    assert ints(out) == list(range(1, len(ints(out)) + 1)), "numbers lost or repeated across the restore"
    assert alive(child) and int(Path(f"/proc/{child}/stat").read_text().split(")")[1].split()[1]) == target.pid


def test_open_file_offset_is_preserved(procs, tmp_path):
    data, out, dumped = dumped_file_reader(procs, tmp_path, lines=100000, records=10)
    n = len(read_lines(out))
    last_line, last_offset = read_lines(out)[-1].split()
    shown = ckpt_json("show", dumped["id"])["processes"][0]["fds"]
    assert any(fd.get("path") == str(data) and fd["offset"] == int(last_offset) for fd in shown)

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    wait_until(lambda: len(read_lines(out)) >= n + 5, what="restored reader")
    line, offset = read_lines(out)[n].split()
    assert int(line[4:]) == int(last_line[4:]) + 1
    assert int(offset) == int(last_offset) + len("line00000\n")


def talking_pair(procs, tmp_path, lines: int):
    """An echo server and a client with one connection, `lines` exchanged: (server, client, log, out)."""
    log = tmp_path / "server.txt"
    server = procs.start("echo_server.py", log)
    port = int(wait_until(lambda: read_lines(log), what="server port")[0].split()[1])
    out = tmp_path / "client.txt"
    client = procs.start("tcp_client.py", port, out)
    wait_until(lambda: len(read_lines(out)) >= lines, what="client traffic")
    return server, client, log, out


def test_established_tcp_connection_keeps_talking(procs, tmp_path):
    server, client, log, out = talking_pair(procs, tmp_path, 10)
    dumped = ckpt_json("dump", client.pid, "--stop")
    client.wait(timeout=10)
    options = ckpt_json("show", dumped["id"])["criu"]["options"]
    assert options["tcp_established"] is True and options["network_lock"] == "nftables"
    n = len(read_lines(out))
    local_port = read_lines(out)[-1].split()[1]

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    wait_until(lambda: len(read_lines(out)) >= n + 10, what="client traffic after restore")
    lines = read_lines(out)
    assert "EOF" not in lines
    assert [int(x.split()[0]) for x in lines] == list(range(1, len(lines) + 1))
    assert {x.split()[1] for x in lines} == {local_port}, "the client opened a new connection"
    assert [x for x in read_lines(log) if x.startswith("accept")] == [f"accept {local_port}"]
    assert alive(server.pid)


def test_tcp_close_restores_connections_closed_and_the_program_sees_it(procs, tmp_path):
    """For a restore where the connection cannot live on (another machine, peers long gone):
    the program must see its connection fail, not hang on it."""
    server, client, log, out = talking_pair(procs, tmp_path, 5)
    dumped = ckpt_json("dump", client.pid, "--stop")
    client.wait(timeout=10)
    n = len(read_lines(out))
    restored = ckpt_json("restore", dumped["id"], "--tcp-close")
    procs.adopt(restored["pid"])
    # The client's next exchange fails: it reads end of file or its write fails (EPIPE), says so and exits.
    wait_until(lambda: not alive(restored["pid"]), timeout=15, what="the client to see its connection closed")
    assert all(line.split()[0].isdigit() for line in read_lines(out)[:n])
    assert read_lines(out)[n:] in (["EOF"], ["ERROR EPIPE"]), read_lines(out)[n:]


def test_listening_server_accepts_new_connections(procs, tmp_path):
    server, port, log = echo_server(procs, tmp_path)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"before\n")
        assert s.makefile().readline() == "before\n"
    dumped = ckpt_json("dump", server.pid)
    procs.kill_tree(server.pid)

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    for word in ("after1", "after2"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(word.encode() + b"\n")
            assert s.makefile().readline() == word + "\n"
    assert len([x for x in read_lines(log) if x.startswith("accept")]) == 3
    assert state(restored["pid"]) in ("S", "R")
    assert tree_pids(restored["pid"]) == [server.pid]


def test_restore_into_new_pid_namespace_while_original_runs(procs, tmp_path):
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: len(ints(out)) >= 5, what="counter")
    dumped = ckpt_json("dump", target.pid)
    refused = ckpt("restore", dumped["id"], check=False)
    assert refused.returncode == 7 and "--new-pidns" in refused.stderr

    restored = ckpt_json("restore", dumped["id"], "--new-pidns")
    status = Path(f"/proc/{restored['pid']}/status").read_text()
    init = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    procs.adopt(init)
    procs.adopt(restored["pid"])
    nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
    assert [int(x) for x in nspid] == [restored["pid"], target.pid] == [restored["pid"],
                                                                       restored["pid_in_namespace"]]
    procs.kill_tree(target.pid)  # only the restored copy writes now
    n = len(ints(out))
    wait_until(lambda: len(ints(out)) >= n + 3, what="restored copy to count")
    after = ints(out)[n:]
    # It goes on from the checkpoint (taken after 5 counts), not from 1, one step at a time.
    assert after == list(range(after[0], after[0] + len(after))) and 5 < after[0] <= max(ints(out)[:n]) + 1
    # CRIU cannot dump it again (nor its init): the error says why and what to do, and it runs on.
    for pid in (restored["pid"], init):
        refused = ckpt("dump", pid, check=False)
        assert refused.returncode == 5 and "restore it without --new-pidns" in refused.stderr, refused.stderr
    n = len(ints(out))
    wait_until(lambda: len(ints(out)) >= n + 2, what="restored copy to count on")


def test_shell_pipeline_in_an_outside_session(procs, tmp_path):
    """A `sh -c '... | cat >> file'` job in a session led by a process outside the tree
    (as a job of an interactive shell is): --shell-job is detected."""
    out = tmp_path / "pipe.txt"
    pidfile = tmp_path / "job.pid"
    script = f"i=0; while :; do i=$((i+1)); echo $i; sleep 0.05; done | cat >> {out}"
    # The leader is a session of its own, so the test does not depend on the session pytest runs in
    # (under a CI runner that session may be led from outside the PID namespace: see test_errors).
    leader = subprocess.Popen(["sh", "-c", f'sh -c "$0" & echo $! > {pidfile}; wait; exec sleep 600', script],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    procs.popens.append(leader)
    procs.pids.add(leader.pid)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="job PID")
    job = int(pidfile.read_text())
    procs.pids.add(job)
    wait_until(lambda: len(ints(out)) >= 5, what="pipeline")
    dumped = ckpt("dump", job, "--stop", "--json")
    assert "detected: --shell-job" in dumped.stderr
    assert json.loads(dumped.stdout)["processes"] >= 3
    wait_until(lambda: not alive(job), what="the dumped job to end")
    n = len(ints(out))
    restored = ckpt_json("restore", "latest")
    procs.adopt(restored["pid"])
    wait_until(lambda: len(ints(out)) >= n + 5, what="restored pipeline")
    assert ints(out) == list(range(1, len(ints(out)) + 1))


def test_server_with_a_live_client_connection_keeps_serving_it(procs, tmp_path):
    """The server side of an established connection: the client outside the tree never notices."""
    server, client, _, out = talking_pair(procs, tmp_path, 5)
    dumped = ckpt_json("dump", server.pid, "--stop")
    server.wait(timeout=10)
    n = len(read_lines(out))
    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    wait_until(lambda: len(read_lines(out)) >= n + 10, timeout=30, what="client traffic through the restored server")
    lines = read_lines(out)
    assert "EOF" not in lines and alive(client.pid)
    assert [int(x.split()[0]) for x in lines] == list(range(1, len(lines) + 1))
    assert len({x.split()[1] for x in lines}) == 1, "the client had to reconnect"


def test_process_on_a_terminal_restores_onto_the_terminal_of_the_restore(procs, tmp_path):
    """A process whose stdio is a terminal: restored from a terminal it takes that one over;
    from no terminal ckpt says so before CRIU runs."""
    out = tmp_path / "count.txt"
    counter = f"{sys.executable} {FIXTURES / 'counter.py'} {out} 0.05"
    session = subprocess.Popen(["script", "-q", "-c", counter, "/dev/null"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.popens.append(session)
    procs.pids.add(session.pid)
    wait_until(lambda: len(ints(out)) >= 5, what="counter on a terminal")
    target = [p for p in tree_pids(session.pid) if p != session.pid][0]
    assert os.readlink(f"/proc/{target}/fd/0").startswith("/dev/pts/")
    dumped = ckpt("dump", target, "--stop", "--json")
    assert "detected: --shell-job" in dumped.stderr
    wait_until(lambda: state(target) is None, what="the target to end")
    last = ints(out)[-1]
    refused = ckpt("restore", "latest", check=False)
    assert refused.returncode == 2 and "attached to a terminal" in refused.stderr
    restore = f"{sys.executable} -m ckpt restore latest; sleep 1"
    subprocess.run(["script", "-q", "-c", restore, "/dev/null"], cwd=ROOT, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    procs.pids.add(target)
    values = ints(out)
    assert len(values) > last + 3 and values[last] == last + 1, "the restored counter did not go on"


@pytest.mark.parametrize("channel", ["pipe", "socket"])
def test_output_to_a_program_outside_the_tree_goes_to_a_file_after_restore(procs, tmp_path, channel):
    """`agent | tee log`, or a service whose stdout is a UNIX socket to journald (or to a Node.js
    parent), the agent dumped alone. CRIU would restore a pipe that nobody reads (the agent dies
    of SIGPIPE at its next write) and refuses to dump half of a stream socket."""
    if channel == "pipe":
        read_end, write_end = os.pipe()
    else:
        reader_sock, writer_sock = socket.socketpair()
        read_end, write_end = reader_sock.detach(), writer_sock.detach()
    seen = tmp_path / "seen-by-cat.txt"
    with open(seen, "wb") as sink:
        reader = subprocess.Popen(["cat"], stdin=read_end, stdout=sink, start_new_session=True)
    procs.adopt(reader.pid)
    writer = subprocess.Popen([sys.executable, "-u", "-c", (
        "import itertools, time\n"
        "for i in itertools.count(1):\n"
        "    print(i, flush=True); time.sleep(0.05)\n")],
        stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.adopt(writer.pid)
    os.close(read_end)
    os.close(write_end)
    wait_until(lambda: len(ints(seen)) >= 5, what="cat to see the writer's lines")

    dumped = ckpt("dump", writer.pid, "--stop", "--json")
    described = {"pipe": f"writes (fd 1) into a pipe that cat (PID {reader.pid}) reads",
                 "socket": f"UNIX stream socket (fd 1) connected to cat (PID {reader.pid})"}[channel]
    assert described in dumped.stderr, dumped.stderr
    (recorded,) = json.loads(dumped.stdout)[f"external_{channel}s"]
    assert (recorded["pid"], recorded["fd"]) == (writer.pid, 1) and recorded["peer"] == f"cat (PID {reader.pid})"
    writer.wait(timeout=10)
    # cat may still be copying what the writer put into the pipe before it was frozen.
    settled = []
    wait_until(lambda: settled.append(ints(seen)) or (len(settled) > 1 and settled[-1] == settled[-2]),
               interval=0.2, what="cat to drain the pipe")
    last = settled[-1][-1]
    checkpoint = json.loads(dumped.stdout)["id"]
    shown = {"pipe": f"fd 1 writes into a pipe to cat (PID {reader.pid})",
             "socket": f"fd 1 is a UNIX stream socket connected to cat (PID {reader.pid})"}[channel]
    assert shown in ckpt("show", checkpoint).stdout

    output = tmp_path / "after-restore.txt"
    output.write_text("kept\n")  # --output appends: what the file held stays
    restored = ckpt_json("restore", checkpoint, "--output", output)
    procs.adopt(restored["pid"])
    assert restored["output"] == str(output)
    wait_until(lambda: len(ints(output)) >= 10, what="the restored writer's lines in the output file")
    assert read_lines(output)[0] == "kept"
    assert ints(output)[:10] == list(range(last + 1, last + 11)), "it goes on from where it stopped"
    assert alive(restored["pid"]) and state(restored["pid"]) != "Z"
    procs.kill_tree(restored["pid"])
    wait_until(lambda: not alive(restored["pid"]), what="the restored writer to end")

    # By default the output goes to a file in the checkpoint's log directory.
    restored = ckpt_json("restore", checkpoint)
    procs.adopt(restored["pid"])
    assert Path(restored["output"]).parent.name == checkpoint  # logs/<id>/output-<time>.log
    wait_until(lambda: len(ints(Path(restored["output"]))) >= 3, what="lines in the default output file")


def test_datagrams_to_a_socket_outside_the_tree_flow_again_after_restore(procs, tmp_path):
    """A program logging to syslog's /dev/log: a UNIX datagram socket connected outside the tree.
    CRIU refuses to dump it without --ext-unix-sk; ckpt detects it, and the restored program
    sends to the same path again, its numbers going on. With nothing there any more, a
    restore says what is missing before CRIU runs."""
    path = tmp_path / "log.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    try:
        sender = procs.start("datagram_sender.py", path)
        assert [int(receiver.recv(64)) for _ in range(5)] == [1, 2, 3, 4, 5]
        dumped = ckpt("dump", sender.pid, "--stop", "--json")
        (recorded,) = json.loads(dumped.stdout)["external_datagram_sockets"]
        assert recorded["peer_path"] == str(path) and recorded["pid"] == sender.pid
        assert "detected: --ext-unix-sk" in dumped.stderr
        assert f"sends datagrams (fd {recorded['fd']}) to {path}" in dumped.stderr, dumped.stderr
        sender.wait(timeout=10)
        sent = _drain(receiver)  # what it sent before it was frozen
        restored = ckpt_json("restore", json.loads(dumped.stdout)["id"])
        procs.adopt(restored["pid"])
        after = [int(receiver.recv(64)) for _ in range(5)]
        assert after == list(range(sent[-1] + 1, sent[-1] + 6)), "the restored sender's numbers did not go on"
        again = ckpt_json("dump", restored["pid"], "--stop")
        wait_until(lambda: state(restored["pid"]) is None, what="the restored sender to end")
    finally:
        receiver.close()
    path.unlink()
    refused = ckpt("restore", again["id"], check=False)
    assert refused.returncode == 10, refused.stderr
    assert f"sent datagrams to {path}, which does not exist here" in refused.stderr
    assert "Traceback" not in refused.stderr


def _drain(sock: socket.socket) -> list[int]:
    sock.setblocking(False)
    got = []
    try:
        while True:
            got.append(int(sock.recv(64)))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(10)
    return got


def test_a_deleted_temporary_file_larger_than_crius_limit_comes_back(procs, tmp_path):
    """A Python program holding a 6 MiB tempfile.TemporaryFile (a deleted file): CRIU refuses
    deleted files over 1 MiB unless told; ckpt tells it, and the restored program reads the
    same content at the same offset."""
    out = tmp_path / "holder.txt"
    holder = procs.start("temp_file_holder.py", out, 6)
    wait_until(lambda: len(read_lines(out)) >= 3, what="the holder's first lines")
    dumped = ckpt("dump", holder.pid, "--stop")
    assert "holds a deleted file" in dumped.stderr and "6.0 MiB" in dumped.stderr, dumped.stderr
    holder.wait(timeout=10)
    before = [line.split() for line in read_lines(out)]
    restored = ckpt_json("restore", dumped.stdout.strip())
    procs.adopt(restored["pid"])
    wait_until(lambda: len(read_lines(out)) >= len(before) + 3, what="the restored holder's lines")
    after = [line.split() for line in read_lines(out)][len(before):]
    assert [int(n) for n, _, _ in after[:3]] == [len(before) + 1, len(before) + 2, len(before) + 3]
    assert {(digest, at) for _, digest, at in before + after} == {(before[0][1], "12345")}, \
        "the file's content or offset changed"
