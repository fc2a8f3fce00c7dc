"""Group checkpoints across hosts (docs/design.md, "Groups: the protocol"): the member agent
(`ckpt _member`, ckpt/commands/member_agent.py) and its coordinator's end, RemoteMember
(ckpt/commands/group_remote.py), under the group coordinator (ckpt/commands/group.py), with
real CRIU, a real sshd per test host, and a real S3 server. The test hosts are network
namespaces on this kernel (tests/netns.py).

- End of file on the agent's stdin is abort: a held dump is let go at once, nothing committed;
  a phase that runs is cut short.
- Two trees, one on each host, exchanging a numbered TCP stream both ways, checkpointed as a
  group through ssh and restored as one: the streams go on with no number lost or repeated.
- A member's ssh killed while its tree is held, and the coordinator killed while both are held:
  both trees run on, unfrozen, no lock table left in either host, nothing committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.store import ids
from tests.helpers import FIXTURES, ROOT, Processes, ckpt, ckpt_json, read_lines, tree_pids, wait_until
from tests.netns import NetHost, OneHost, TwoHosts

pytestmark = pytest.mark.integration

PASSWORD = "group-tests-password"
PORT = 7411
FROZEN = ("t", "T")  # CRIU holds a dumped tree ptrace-stopped


def status_state(pid: int) -> str | None:
    """The one-letter State of /proc/PID/status (None: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


def received(log: Path) -> list[int]:
    """The numbers one end of stream_between_hosts.py got, in order (a last line being written is left out)."""
    lines = read_lines(log)
    return [int(line.split()[1]) for line in lines[:-1] if line.startswith("got ")]


def ends_of_stream(log: Path) -> list[str]:
    return [line for line in read_lines(log) if line.startswith(("EOF", "ERROR"))]


# ---- (a) the agent over a local pipe ---------------------------------------------------------

class Agent:
    """`ckpt _member` on a pipe, as ssh would start it on the member's host."""

    def __init__(self, host: NetHost | None, tmp_path: Path):
        self.stderr = open(tmp_path / "agent.stderr", "wb")
        command = [sys.executable, "-m", "ckpt", "_member"]
        self.process = subprocess.Popen(host.command(*command) if host else command, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, cwd=ROOT, start_new_session=True)

    def send(self, **request) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()

    def ask(self, **request) -> dict:
        self.send(**request)
        assert self.process.stdout is not None
        answer = json.loads(self.process.stdout.readline())
        assert answer["ok"], answer
        return answer

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.stderr.close()


@pytest.fixture
def host(tmp_path):
    """A network namespace of the test's own: its nftables tables are this test's alone."""
    with OneHost(tmp_path) as made:
        yield made


def test_end_of_file_lets_a_held_dump_go_at_once(procs, tmp_path, isolated_env, host):
    """The channel is gone while the tree is held: the agent lets it go at once (CRIU thaws it
    and lifts its network lock), commits nothing and ends."""
    server_log, out = tmp_path / "server.txt", tmp_path / "client.txt"
    procs.start_program(host.command(sys.executable, FIXTURES / "echo_server.py", server_log), "echo")
    port = wait_until(lambda: read_lines(server_log), what="the echo server's port")[0].split()[1]
    # an established connection: CRIU holds it behind its nftables lock
    client = procs.start_program(host.command(sys.executable, FIXTURES / "tcp_client.py", port, out), "client")
    wait_until(lambda: len(read_lines(out)) >= 3, what="the client's echoes")
    ckpt("init")  # a member writes into an existing store only
    agent = Agent(host, tmp_path)
    try:
        agent.ask(op="hello", version=1, store=str(isolated_env))
        group = {"id": ids.new_id(), "name": "pipe"}
        agent.ask(op="prepare", kind="dump", request={"pid": client.pid, "group": group}, hold_limit=60)
        agent.ask(op="capture")
        assert status_state(client.pid) in FROZEN and host.criu_tables(), "not held frozen behind a network lock"
        held_at = len(read_lines(out))
        closed = time.monotonic()
        agent.process.stdin.close()
        wait_until(lambda: status_state(client.pid) in ("S", "R"), timeout=5, what="the tree to be thawed")
        let_go = time.monotonic() - closed
        assert agent.process.wait(10) == 1
    finally:
        agent.end()
    wait_until(lambda: len(read_lines(out)) > held_at + 3, what="the client to go on")
    assert let_go < 3.0, f"the held tree was let go {let_go:.1f} s after end of file"
    assert host.criu_tables() == []
    assert ckpt_json("list") == [] and not list((isolated_env / "checkpoints").glob("*.json"))
    assert "the coordinator is gone" in (tmp_path / "agent.stderr").read_text()


def test_end_of_file_cuts_a_phase_short(procs, tmp_path, isolated_env):
    """End of file while prepare waits (here for another dump of the same PID, up to the 60 s
    lock timeout hello passed): the agent does not wait on, it aborts at once and ends."""
    from ckpt.dump.target_lock import dumping

    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: read_lines(out), what="the counter")
    ckpt("init")
    with dumping(target.pid, timeout=5):
        agent = Agent(None, tmp_path)
        try:
            agent.ask(op="hello", version=1, store=str(isolated_env), settings={"lock_timeout": 60})
            agent.send(op="prepare", kind="dump", request={"pid": target.pid}, hold_limit=60)
            wait_until(lambda: "waiting for another dump" in (tmp_path / "agent.stderr").read_text(),
                       what="the agent to wait for the dump lock")
            closed = time.monotonic()
            agent.process.stdin.close()
            assert agent.process.wait(10) == 1 and time.monotonic() - closed < 3.0
            assert agent.process.stdout.read() == b"", "a phase cut short has nothing to answer"
        finally:
            agent.end()
    assert "while a phase ran" in (tmp_path / "agent.stderr").read_text()
    assert ckpt_json("dump", target.pid)["pid"] == target.pid  # nothing left held: the next dump works


# ---- across two hosts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hosts")
    processes = Processes(workdir)
    try:
        with TwoHosts(workdir, processes) as made:
            yield made
    finally:
        processes.cleanup()


@pytest.fixture
def store(hosts):
    url = hosts.store_url
    hosts.ckpt(hosts.a, "init", url, env={"CKPT_PASSWORD": PASSWORD})
    return url


def store_contents(hosts: TwoHosts, url: str) -> dict:
    """The store's checkpoint and group IDs, read from host A (the only place it is reachable)."""
    script = ("import json, sys\n"
              "from ckpt.settings import Settings\n"
              "from ckpt.store import Store\n"
              "s = Store.open(sys.argv[1], settings=Settings.from_environment())\n"
              "print(json.dumps({'checkpoints': s.checkpoint_ids(), 'groups': s.groups.ids()}))\n")
    environment = {**os.environ, **hosts.s3_environment(), "CKPT_CACHE": str(hosts.a.workdir / "cache"),
                   "CKPT_PASSWORD": PASSWORD, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(hosts.a.command(sys.executable, "-c", script, url), capture_output=True, text=True,
                          env=environment, timeout=60, cwd=ROOT, check=True)
    return json.loads(done.stdout)


class StreamPair:
    """stream_between_hosts.py listening on host B and connected from host A: a numbered stream both ways."""

    def __init__(self, hosts: TwoHosts, procs: Processes, workdir: Path):
        self.logs = {"host-a": workdir / "a.log", "host-b": workdir / "b.log"}
        peer = str(FIXTURES / "stream_between_hosts.py")
        b, a = hosts.b, hosts.a
        self.b = procs.start_program(b.command(sys.executable, peer, "listen", b.address, PORT, self.logs["host-b"]),
                                     "peer-b")
        wait_until(lambda: read_lines(self.logs["host-b"]), what="the listener")
        self.a = procs.start_program(a.command(sys.executable, peer, "connect", b.address, PORT, self.logs["host-a"]),
                                     "peer-a")
        self.pids = {"host-a": self.a.pid, "host-b": self.b.pid}
        self.wait_for_more(10)

    def counts(self) -> dict[str, int]:
        return {host: len(received(log)) for host, log in self.logs.items()}

    def wait_for_more(self, more: int, than: dict[str, int] | None = None, timeout: float = 10.0) -> None:
        base = than or {host: 0 for host in self.logs}
        wait_until(lambda: all(self.counts()[h] >= base[h] + more for h in self.logs), timeout=timeout,
                   what=f"{more} more numbers each way")

    def check_unbroken(self) -> None:
        for host, log in self.logs.items():
            got = received(log)
            assert got == list(range(1, len(got) + 1)), f"{host}: a number lost or repeated"
            assert ends_of_stream(log) == [], f"{host}: {ends_of_stream(log)}"


class Coordinator:
    """The coordinator: `ckpt dump --group` and `ckpt restore GROUP`, run in host A."""

    def __init__(self, hosts: TwoHosts, store: str, procs: Processes, workdir: Path):
        self.hosts, self.store, self.procs, self.workdir = hosts, store, procs, workdir
        self.pause_file = workdir / "paused"
        self.environment = {"CKPT_SSH": hosts.ssh(), "CKPT_REMOTE_CKPT": hosts.remote_ckpt(),
                            "CKPT_PASSWORD": PASSWORD, "CKPT_CACHE": str(hosts.a.workdir / "cache"),
                            "PYTHONPATH": str(ROOT), **hosts.s3_environment()}

    def command(self, action: str, argument: str) -> list[str]:
        """`ckpt dump --group` (argument: {"members", "name", "stop"} as JSON) or `ckpt restore
        GROUP`, as a user runs them in host A."""
        if action == "restore":
            args = ["restore", argument]
        else:
            asked = json.loads(argument)
            args = ["dump", "--group", asked["name"], *(["--stop"] if asked["stop"] else []), *asked["members"]]
        return self.hosts.a.command(sys.executable, "-m", "ckpt", *args, "--json", "--timeout", "60",
                                    "--store", self.store)

    def run(self, action: str, argument: str) -> dict:
        done = subprocess.run(self.command(action, argument), capture_output=True, text=True, timeout=180,
                              env={**os.environ, **self.environment}, cwd=ROOT)
        assert done.returncode == 0, f"the group {action} failed ({done.returncode}): {done.stderr}"
        return json.loads(done.stdout)

    def start_paused(self, action: str, argument: str, at: str, monkeypatch) -> subprocess.Popen:
        """Started, and returned once it pauses at phase `at` (ckpt/phases.py)."""
        for name, value in {**self.environment, "CKPT_TEST_PAUSE_AT": at,
                            "CKPT_TEST_PAUSE_FILE": str(self.pause_file)}.items():
            monkeypatch.setenv(name, value)
        process = self.procs.start_program(self.command(action, argument), "coordinator")
        wait_until(lambda: self.pause_file.exists() or process.poll() is not None, timeout=60,
                   what=f"the coordinator at {at}")
        assert process.poll() is None, (self.workdir / "coordinator.2.stdio").read_text()
        return process

    def ssh_to(self, coordinator: subprocess.Popen, alias: str) -> int:
        """The PID of the coordinator's ssh to that host."""
        found = []
        for pid in tree_pids(coordinator.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode()).name == "ssh" and alias.encode() in argv:
                found.append(pid)
        assert len(found) == 1, found
        return found[0]


def table_kinds(host: NetHost) -> list[str]:
    """nftables tables of CRIU's or of a group restore's lock left in host's namespace."""
    return [t for t in host.nft_tables() if "CRIU" in t or "ckpt-group" in t]


@pytest.mark.parametrize("stop, members", [(False, ("host-a", "host-b")), (True, ("", "host-b"))],
                         ids=["snapshot-both-remote", "stop-one-local"])
def test_a_group_across_two_hosts_goes_on_with_no_number_lost_or_repeated(hosts, store, procs, tmp_path, stop,
                                                                          members):
    """Two trees, on host A and on host B, streaming numbers to each other over the veth:
    a group dump (through ssh to each member's host, or one of them the coordinator's own),
    both ended (killed after a snapshot, or by --stop), a group restore: the streams go on with
    no number lost or repeated. A snapshot's restore holds off the trees' packets with the
    group restore's own lock on each host, since its dump left none."""
    streams = StreamPair(hosts, procs, tmp_path)
    coordinator = Coordinator(hosts, store, procs, tmp_path)
    names = [f"{host}:{streams.pids[h]}" if host else str(streams.pids[h])
             for host, h in zip(members, ("host-a", "host-b"), strict=True)]
    group = coordinator.run("dump", json.dumps({"members": names, "name": "pair", "stop": stop}))
    assert store_contents(hosts, store)["groups"] == [group["id"]]
    if stop:
        for popen in (streams.a, streams.b):
            popen.wait(10)  # ended by the dump, their connections' lock left in place
    else:
        streams.wait_for_more(5, streams.counts())  # both ran on after the group dump
        for pid in streams.pids.values():  # stopped first: neither sees the other end go
            os.kill(pid, signal.SIGSTOP)
        for pid in streams.pids.values():
            procs.kill_tree(pid)
    before_restore = streams.counts()

    restored = coordinator.run("restore", group["id"])
    pids = [member["pid"] for member in restored["members"]]
    for pid in pids:
        procs.adopt(pid)
    assert sorted(pids) == sorted(streams.pids.values())
    streams.wait_for_more(20, before_restore, timeout=20)
    streams.check_unbroken()
    assert table_kinds(hosts.a) == [] and table_kinds(hosts.b) == []


def test_a_members_ssh_killed_while_held_lets_every_tree_go(hosts, store, procs, tmp_path, monkeypatch):
    """host-b's ssh killed while both members are held: host-b's agent reads end of file and
    lets its tree go at once; the coordinator finds host-b lost when it releases, and aborts
    host-a's member (exit code 11, naming host-b)."""
    streams = StreamPair(hosts, procs, tmp_path)
    coordinator = Coordinator(hosts, store, procs, tmp_path)
    names = [f"host-a:{streams.pids['host-a']}", f"host-b:{streams.pids['host-b']}"]
    process = coordinator.start_paused("dump", json.dumps({"members": names, "name": "lost", "stop": False}),
                                       "group.held", monkeypatch)
    assert all(status_state(pid) in FROZEN for pid in streams.pids.values())
    assert hosts.a.criu_tables() and hosts.b.criu_tables()
    os.kill(coordinator.ssh_to(process, "host-b"), signal.SIGKILL)
    wait_until(lambda: status_state(streams.pids["host-b"]) in ("S", "R"), timeout=10,
               what="host-b's tree to be let go by its agent")
    assert status_state(streams.pids["host-a"]) in FROZEN, "host-a's tree let go before the coordinator knew"
    coordinator.pause_file.unlink()  # the coordinator goes on: releases, and finds host-b lost
    assert process.wait(60) == 11
    assert "host-b" in (tmp_path / "coordinator.2.stdio").read_text()
    check_let_go(hosts, store, streams)


def test_the_coordinator_killed_while_both_are_held_lets_every_tree_go(hosts, store, procs, tmp_path, monkeypatch):
    streams = StreamPair(hosts, procs, tmp_path)
    coordinator = Coordinator(hosts, store, procs, tmp_path)
    names = [f"host-a:{streams.pids['host-a']}", f"host-b:{streams.pids['host-b']}"]
    process = coordinator.start_paused("dump", json.dumps({"members": names, "name": "killed", "stop": False}),
                                       "group.held", monkeypatch)
    assert all(status_state(pid) in FROZEN for pid in streams.pids.values())
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    wait_until(lambda: all(status_state(pid) in ("S", "R") for pid in streams.pids.values()), timeout=10,
               what="both trees let go")
    check_let_go(hosts, store, streams)


def check_let_go(hosts: TwoHosts, store: str, streams: StreamPair) -> None:
    """Both trees run on (their streams unbroken), no lock table left, nothing in the store."""
    now = streams.counts()
    streams.wait_for_more(5, now)
    streams.check_unbroken()
    assert table_kinds(hosts.a) == [] and table_kinds(hosts.b) == []
    assert store_contents(hosts, store) == {"checkpoints": [], "groups": []}
