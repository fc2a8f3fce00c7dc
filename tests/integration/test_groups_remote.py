"""Group checkpoints across hosts (docs/design.md, "Groups: the protocol"): the member agent
(`ckpt _member`, ckpt/commands/member_agent.py) and its coordinator's end, RemoteMember
(ckpt/commands/group_remote.py), with real CRIU, a real sshd per test host, and a real S3
server. The test hosts are network namespaces on this kernel (tests/netns.py).

- End of file on the agent's stdin is abort: a held dump is let go at once, nothing committed.
- Two trees, one on each host, exchanging a numbered TCP stream both ways, checkpointed as a
  group through ssh and restored as one: the streams go on with no number lost or repeated.
- A member's ssh killed while its tree is held, and the coordinator killed while both are held:
  both trees run on, unfrozen, no CRIU lock table left in either host, nothing committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

import pytest

from ckpt.commands.dump import DumpRequest
from ckpt.commands.group_remote import RemoteLink, RemoteMember
from ckpt.commands.restore import RestoreRequest
from ckpt.errors import MemberLost
from ckpt.store import ids
from tests.helpers import FIXTURES, ROOT, Processes, ckpt, ckpt_json, env_settings, read_lines, wait_until
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


def commit_group(hosts: TwoHosts, url: str, group: dict, members: list[dict]) -> None:
    """The coordinator's commit point (the group manifest), written from host A."""
    script = ("import json, sys\n"
              "from datetime import datetime, timezone\n"
              "from ckpt.settings import Settings\n"
              "from ckpt.store import Store\n"
              "from ckpt.store.groups import GroupManifest, GroupMember\n"
              "group, members = json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
              "s = Store.open(sys.argv[1], settings=Settings.from_environment())\n"
              "s.groups.commit(GroupManifest(group['id'], datetime.now(timezone.utc).isoformat(),\n"
              "                [GroupMember(**m) for m in members], group['name']))\n")
    environment = {**os.environ, **hosts.s3_environment(), "CKPT_CACHE": str(hosts.a.workdir / "cache"),
                   "CKPT_PASSWORD": PASSWORD, "PYTHONPATH": str(ROOT)}
    subprocess.run(hosts.a.command(sys.executable, "-c", script, url, json.dumps(group), json.dumps(members)),
                   capture_output=True, text=True, env=environment, timeout=60, cwd=ROOT, check=True)


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


def link(hosts: TwoHosts, url: str, via: NetHost | None) -> RemoteLink:
    settings = replace(env_settings(), ssh=hosts.ssh(via), remote_ckpt=hosts.remote_ckpt())
    return RemoteLink.of(settings, url, password=PASSWORD, timeout=60, hold_limit=60)


def drive(members: list[RemoteMember], phases: tuple[str, ...]) -> dict[str, list]:
    """What the coordinator does (until ckpt/commands/group.py drives them): each phase on
    every member at once, the next only once every member has answered; any failure aborts all."""
    results: dict[str, list] = {}
    with ThreadPoolExecutor(len(members)) as pool:
        try:
            for phase in phases:
                futures = [pool.submit(getattr(member, phase)) for member in members]
                wait(futures, timeout=120)
                results[phase] = [future.result() for future in futures]
        except BaseException:
            for member in members:
                member.abort()
            raise
    return results


def test_a_group_across_two_hosts_goes_on_with_no_number_lost_or_repeated(hosts, store, procs, tmp_path):
    """Dumped with --stop: each tree is ended once the group is committed, with CRIU's lock on
    its connections left in place (so neither host answers the other's packets with a reset)
    until the group restore has every member back, held, and lets them run."""
    streams = StreamPair(hosts, procs, tmp_path)
    group = {"id": ids.new_id(), "name": "pair"}
    remote = link(hosts, store, via=hosts.a)
    # The coordinator names each member's checkpoint: with --stop the group manifest, which
    # names them, is committed inside the hold, before any tree is ended.
    checkpoints = {h: ids.new_id() for h in streams.pids}
    dumps = [RemoteMember(h, DumpRequest(pid=streams.pids[h], name="pair", stop=True, group=group,
                                         checkpoint_id=checkpoints[h]), remote) for h in ("host-a", "host-b")]
    held = drive(dumps, ("prepare", "capture"))["capture"]
    members = [{"checkpoint": checkpoints[m.host], "pid": streams.pids[m.host], "host": m.host,
                "hostname": m.hostname, "frozen_at": h.frozen_at, "dumped_at": h.held_at}
               for m, h in zip(dumps, held, strict=True)]
    commit_group(hosts, store, group, members)
    drive(dumps, ("release", "commit"))
    for popen in (streams.a, streams.b):
        popen.wait(10)  # ended by the dump
    assert store_contents(hosts, store) == {"checkpoints": sorted(checkpoints.values()), "groups": [group["id"]]}
    at_dump = streams.counts()

    restore = RestoreRequest(ref="", lazy=False)
    restores = [RemoteMember(m["host"], replace(restore, ref=m["checkpoint"]), remote) for m in members]
    released = drive(restores, ("prepare", "capture", "release", "commit"))["release"]
    for answer in released:
        procs.adopt(answer.pid)
    assert sorted(answer.pid for answer in released) == sorted(streams.pids.values())
    streams.wait_for_more(20, at_dump, timeout=20)
    streams.check_unbroken()
    assert hosts.a.criu_tables() == [] and hosts.b.criu_tables() == []


def test_a_members_ssh_killed_while_held_lets_every_tree_go(hosts, store, procs, tmp_path):
    streams = StreamPair(hosts, procs, tmp_path)
    group = {"id": ids.new_id(), "name": "lost"}
    members = [RemoteMember(h, DumpRequest(pid=streams.pids[h], group=group), link(hosts, store, via=hosts.a))
               for h in ("host-a", "host-b")]
    drive(members, ("prepare", "capture"))
    assert all(status_state(pid) in FROZEN for pid in streams.pids.values())
    assert hosts.a.criu_tables() and hosts.b.criu_tables()
    os.kill(members[1].process.pid, signal.SIGKILL)  # host-b's ssh client
    # host-b's agent reads end of file and lets its tree go, before the coordinator knows
    wait_until(lambda: status_state(streams.pids["host-b"]) in ("S", "R"), timeout=10,
               what="host-b's tree to be let go")
    with pytest.raises(MemberLost, match="host-b"):
        drive(members, ("release",))
    check_let_go(hosts, store, streams)


def test_the_coordinator_killed_while_both_are_held_lets_every_tree_go(hosts, store, procs, tmp_path, monkeypatch):
    streams = StreamPair(hosts, procs, tmp_path)
    for name, value in {"CKPT_SSH": hosts.ssh(), "CKPT_REMOTE_CKPT": hosts.remote_ckpt(), "CKPT_PASSWORD": PASSWORD,
                        "CKPT_CACHE": str(hosts.a.workdir / "cache"), "PYTHONPATH": str(ROOT),
                        **hosts.s3_environment()}.items():
        monkeypatch.setenv(name, value)  # the coordinator's, in host A
    coordinator = procs.start_program(hosts.a.command(sys.executable, "-c", COORDINATOR, store, json.dumps(
        [f"host-a:{streams.pids['host-a']}", f"host-b:{streams.pids['host-b']}"])), "coordinator")
    wait_until(lambda: all(status_state(pid) in FROZEN for pid in streams.pids.values()), timeout=30,
               what="both trees held")
    os.kill(coordinator.pid, signal.SIGKILL)
    coordinator.wait(10)
    wait_until(lambda: all(status_state(pid) in ("S", "R") for pid in streams.pids.values()), timeout=10,
               what="both trees let go")
    check_let_go(hosts, store, streams)


def check_let_go(hosts: TwoHosts, store: str, streams: StreamPair) -> None:
    """Both trees run on (their streams unbroken), no lock table left, nothing in the store."""
    now = streams.counts()
    streams.wait_for_more(5, now)
    streams.check_unbroken()
    assert hosts.a.criu_tables() == [] and hosts.b.criu_tables() == []
    assert store_contents(hosts, store) == {"checkpoints": [], "groups": []}


# A coordinator in host A that holds both members and waits to be killed (until `ckpt dump
# --group` exists: ckpt/commands/group.py).
COORDINATOR = """
import json, sys, time
from ckpt.commands.dump import DumpRequest
from ckpt.commands.group_remote import RemoteLink, RemoteMember, split_member
from ckpt.settings import Settings
from ckpt.store import ids
from ckpt.store import Store
from ckpt.store.password import PasswordSource
settings = Settings.from_environment()
store = Store.open(sys.argv[1], settings=settings)
link = RemoteLink.for_store(store, settings, PasswordSource.from_settings(settings), hold_limit=60)
group = {"id": ids.new_id(), "name": "killed"}
specs = map(split_member, json.loads(sys.argv[2]))
members = [RemoteMember(host, DumpRequest(pid=pid, group=group), link) for host, pid in specs]
for phase in ("prepare", "capture"):
    for m in members:
        getattr(m, phase)()
time.sleep(120)
"""
