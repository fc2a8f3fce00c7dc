"""Each TCP connection of a restored tree is decided on its own (ckpt/restore/tcppeers.py): one
whose peer on this host no longer holds it comes back closed, and the program sees an error;
one whose peer still holds it keeps talking."""

import sys

from tests.helpers import FIXTURES, alive, ckpt, ckpt_json, read_lines, wait_until
from tests.jsonshape import assert_shape


def server(procs, tmp_path, label: str, *flags: str):
    log = tmp_path / f"{label}.txt"
    started = procs.start("echo_server.py", log, *flags)
    port = int(wait_until(lambda: read_lines(log), what=f"server {label}'s port")[0].split()[1])
    return started, port, log


def numbered(lines: list[str]) -> list[int]:
    return [int(x.split()[0]) for x in lines if x.split()[0].isdigit()]


def test_a_connection_whose_local_peer_saw_it_end_comes_back_closed_and_the_program_reconnects(procs, tmp_path):
    """Issue 24, 3: dumped, then killed (the server notes 'closed' and keeps its socket, in
    CLOSE-WAIT), restored: before, the connection came back established and the client hung
    on it without an error while `ckpt check` said all was well."""
    _, port, log = server(procs, tmp_path, "server", "--keep-closed")
    out = tmp_path / "client.txt"
    client = procs.start("tcp_client.py", port, out, "--reconnect")
    wait_until(lambda: len(read_lines(out)) >= 5, what="client traffic")
    dumped = ckpt_json("dump", client.pid)
    local_port = read_lines(out)[-1].split()[1]
    procs.kill_tree(client.pid)
    wait_until(lambda: f"closed {local_port}" in read_lines(log), what="the server to see the client go")

    checked = ckpt_json("check", dumped["id"])
    assert_shape(checked, "check")
    connections = [c["tcp_connection"] for c in checked["checks"] if "tcp_connection" in c]
    assert connections == [{"local": f"127.0.0.1:{local_port}", "remote": f"127.0.0.1:{port}",
                            "state": "ESTABLISHED", "restored": "closed",
                            "why": "its peer on this host is in CLOSE-WAIT: it has seen the connection end"}]
    shown = ckpt("check", dumped["id"], check=False).stdout
    assert f"TCP connection 127.0.0.1:{local_port} -> 127.0.0.1:{port} (ESTABLISHED) would come back closed" in shown

    n = len(read_lines(out))
    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    assert_shape(restored, "restore")
    assert restored["tcp_connections"] == "closed" and restored["connections"] == connections
    # Its next exchange fails (a write: EPIPE; a read: end of file), it says so and reconnects.
    wait_until(lambda: any(x.startswith(("ERROR", "EOF")) for x in read_lines(out)[n:]), timeout=10,
               what="the restored client to see its connection fail")
    after = read_lines(out)[n:]
    failed = next(i for i, x in enumerate(after) if x.startswith(("ERROR", "EOF")))
    assert after[failed] in ("ERROR EPIPE", "EOF"), after
    wait_until(lambda: len(read_lines(out)) >= n + failed + 5, what="the client to talk on a new connection")
    assert {x.split()[1] for x in read_lines(out)[n + failed + 1:]} != {local_port}
    assert alive(restored["pid"])


def test_each_connection_is_decided_alone_the_live_one_keeps_talking(procs, tmp_path):
    """Two clients in one tree, each with a connection to its own server; dumped with --stop
    (the servers' ends stay established); then one server dies. Restored: its client's
    connection comes back closed (CRIU has no per-connection option: ckpt rewrites that
    socket's entry in the staged images), the other established, and its bytes flow both ways
    on, without loss or repetition."""
    _, live_port, live_log = server(procs, tmp_path, "live")
    dead, dead_port, _ = server(procs, tmp_path, "dead")
    live_out, dead_out = tmp_path / "live-client.txt", tmp_path / "dead-client.txt"
    client = str(FIXTURES / "tcp_client.py")
    tree = procs.start_program(["sh", "-c", f'"$0" {client} {live_port} {live_out} & '
                                f'"$0" {client} {dead_port} {dead_out} & wait', sys.executable], "two-clients")
    wait_until(lambda: len(read_lines(live_out)) >= 5 and len(read_lines(dead_out)) >= 5, what="both clients")
    dumped = ckpt_json("dump", tree.pid, "--stop")
    tree.wait(timeout=10)
    procs.kill_tree(dead.pid)
    live_port_local = read_lines(live_out)[-1].split()[1]
    n_live, n_dead = len(read_lines(live_out)), len(read_lines(dead_out))

    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    assert restored["tcp_connections"] == "mixed"
    how = {c["remote"]: (c["restored"], c["why"]) for c in restored["connections"]}
    assert how[f"127.0.0.1:{live_port}"] == ("established", "its peer on this host holds it (ESTABLISHED)")
    assert how[f"127.0.0.1:{dead_port}"][0] == "closed", how
    wait_until(lambda: read_lines(dead_out)[n_dead:], what="the client of the dead server to see it fail")
    assert read_lines(dead_out)[n_dead:] in (["ERROR EPIPE"], ["EOF"]), read_lines(dead_out)[n_dead:]
    wait_until(lambda: len(read_lines(live_out)) >= n_live + 10, what="the live connection to go on")
    lines = read_lines(live_out)
    assert numbered(lines) == list(range(1, len(lines) + 1)), "lost or repeated lines"
    assert {x.split()[1] for x in lines} == {live_port_local}, "the live client had to reconnect"
    assert [x for x in read_lines(live_log) if x.startswith("accept")] == [f"accept {live_port_local}"]
