"""`ckpt migrate` between two test hosts (tests/netns.py): A shares this kernel's PIDs, B has
PIDs of its own (as another machine would: the tree gets its PIDs back there while its frozen
original still holds them in A). The store is a directory both reach (the hosts share the
filesystem). The real CLI runs in A, reaches B with ssh, and every promise is checked on real
processes: the count goes on in B without a gap or a repeat, the memory is intact, the source is
gone; and after every failure, and a kill -9 of ckpt at every phase, exactly one copy runs and
counts on."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.phases import PAUSE_AT, PAUSE_FILE, PHASES
from tests.helpers import FIXTURES, ROOT, read_lines, wait_until
from tests.netns import hosts_with_own_pids, NetHost, Started, TwoHosts, run

pytestmark = pytest.mark.integration

MIGRATE_PHASES = [name for name in PHASES if name.startswith("migrate.")]
# Before the decision the source runs on; from it on the tree runs in B.
SOURCE_RUNS_AFTER = {"migrate.precopy", "migrate.frozen", "migrate.restored-held"}


@pytest.fixture
def hosts(tmp_path):
    with hosts_with_own_pids(tmp_path) as made:
        yield made


@pytest.fixture
def store(hosts, tmp_path):
    path = tmp_path / "store"
    hosts.ckpt(hosts.a, "init", path)
    return path


def migrate_env(hosts: TwoHosts, **more: str) -> dict:
    return {"CKPT_SSH": hosts.ssh(), "CKPT_REMOTE_CKPT": hosts.remote_ckpt(), **more}


def start_worker(hosts: TwoHosts, out: Path, size_mib: int) -> Started:
    worker = hosts.start_in(hosts.a, [sys.executable, FIXTURES / "rewriting_counter.py", out, size_mib], "worker")
    wait_until(lambda: len(counts(out)) >= 3, timeout=60, what="the worker counting")
    return worker


def counts(out: Path) -> list[int]:
    return [int(line.split()[1]) for line in read_lines(out) if line.startswith("count ")]


def assert_counts_on(out: Path, what: str, at_least: int = 5) -> None:
    """The count goes on, each number once, none skipped, whichever host writes it."""
    before = len(counts(out))
    wait_until(lambda: len(counts(out)) >= before + at_least, timeout=30, what=f"the count going on ({what})")
    seen = counts(out)
    assert seen == list(range(1, len(seen) + 1)), f"a number lost or repeated ({what}): {_gap(seen)}"


def _gap(seen: list[int]) -> str:
    for i, n in enumerate(seen, start=1):
        if n != i:
            return f"line {i} says {n}: ... {seen[max(0, i - 4):i + 3]}"
    return "none"


def assert_memory_intact(hosts: TwoHosts, host: NetHost, pid: int, out: Path) -> None:
    host_pid = host.host_pid(pid)
    assert host_pid is not None
    os.kill(host_pid, signal.SIGUSR1)
    verdict = wait_until(lambda: [line for line in read_lines(out) if line.startswith("verify")], timeout=60,
                         what="the worker checking its memory")
    assert verdict[-1].startswith("verify ok"), verdict


def test_a_running_worker_moves_to_b_and_counts_on(hosts, store, tmp_path):
    out = tmp_path / "count.txt"
    worker = start_worker(hosts, out, 1024)
    done = hosts.ckpt(hosts.a, "migrate", worker.pid, "--to", hosts.b.alias, "--store", store, "--json",
                      env=migrate_env(hosts), timeout=300)
    result = json.loads(done.stdout)

    assert result["destination"] == {"host": hosts.b.alias, "pid": worker.pid}
    wait_until(lambda: not hosts.is_running(hosts.a, worker.pid), what="the source gone")
    assert hosts.is_running(hosts.b, worker.pid), "not running in B"
    assert_counts_on(out, "after the move")
    assert_memory_intact(hosts, hosts.b, worker.pid, out)
    rounds = result["rounds"]
    assert rounds and rounds[0]["new_pages"] >= 262144 * 0.9, rounds  # the first round sent (nearly) everything
    assert result["final"]["new_pages"] < rounds[0]["new_pages"] / 4, result["final"]  # the last only what changed
    assert 0 < result["downtime_ms"] < result["duration_ms"]
    assert result["lazy"] is True  # 1 GiB: lazy by default
    listed = json.loads(hosts.ckpt(hosts.a, "list", "--store", store, "--json").stdout)
    assert [c["id"] for c in listed] == [result["checkpoint"]], "the pre-copy rounds' checkpoints stayed"
    assert not list((store / "migrations").glob("*.json")), "the decision stayed"


def test_the_destination_refuses_and_the_source_runs_on(hosts, store, tmp_path):
    """B's copy of the tree's PID is taken: the restore there fails, the frozen source thaws."""
    out = tmp_path / "count.txt"
    worker = start_worker(hosts, out, 16)
    squatter = take_pid_in(hosts, hosts.b, worker.pid)
    done = hosts.ckpt(hosts.a, "migrate", worker.pid, "--to", hosts.b.alias, "--store", store, "--rounds", "1",
                      env=migrate_env(hosts), check=False, timeout=300)

    assert done.returncode == 7, done.stderr  # a PID in use
    assert "Error: host-b:" in done.stderr and "Traceback" not in done.stderr
    # refused while the tree ran: its final (--stop) dump never started
    assert "checkpoint committed; CRIU ends the target" not in done.stderr, done.stderr
    assert hosts.is_running(hosts.a, worker.pid)
    held_by = hosts.b.host_pid(squatter)
    assert held_by is not None and b"sleep" in Path(f"/proc/{held_by}/cmdline").read_bytes(), "B's restore ran"
    assert_counts_on(out, "after the refusal")
    hosts.kill_in(hosts.b, squatter)


def take_pid_in(hosts: TwoHosts, host: NetHost, pid: int) -> int:
    """A sleeper that holds PID pid in host: forked right after ns_last_pid is set below it."""
    script = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid; sleep 600 & wait"
    hosts.processes.start_program(host.command("sh", "-c", script), "squatter")
    wait_until(lambda: host.host_pid(pid) is not None, what=f"PID {pid} taken in {host.alias}")
    return pid


def test_ssh_lost_mid_migration_leaves_the_source_running(hosts, store, tmp_path):
    out = tmp_path / "count.txt"
    worker = start_worker(hosts, out, 16)
    pause = tmp_path / "pause"
    coordinator = start_migration(hosts, store, [worker], tmp_path, pause_at="migrate.frozen", pause=pause)
    pid = wait_for_pause(pause, coordinator)
    ssh = [p for p in children(pid) if "ssh" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert ssh, "no ssh under the coordinator"
    os.kill(ssh[0], signal.SIGKILL)
    pause.unlink()  # go on: the next request finds the channel gone
    assert coordinator.wait(120) == 11, coordinator_output(tmp_path)
    assert "Error: " in coordinator_output(tmp_path)
    assert hosts.is_running(hosts.a, worker.pid)
    assert not hosts.is_running(hosts.b, worker.pid)
    assert_counts_on(out, "after ssh was lost")


@pytest.mark.parametrize("phase", MIGRATE_PHASES)
def test_kill_9_at_every_phase_leaves_exactly_one_copy(hosts, store, tmp_path, phase):
    out = tmp_path / "count.txt"
    worker = start_worker(hosts, out, 16)
    pause = tmp_path / "pause"
    coordinator = start_migration(hosts, store, [worker], tmp_path, pause_at=phase, pause=pause)
    pid = wait_for_pause(pause, coordinator)
    os.kill(pid, signal.SIGKILL)
    coordinator.wait(30)

    in_a = phase in SOURCE_RUNS_AFTER
    # B's agent learns of the coordinator's end from ssh (end of file), and acts on it
    wait_until(lambda: hosts.is_running(hosts.a, worker.pid) == in_a
               and hosts.is_running(hosts.b, worker.pid) != in_a
               and not agents_in(hosts.b), timeout=30, what=f"one copy after a kill at {phase}")
    time.sleep(1.0)  # and it stays so
    assert hosts.is_running(hosts.a, worker.pid) == in_a, f"the source after a kill at {phase}"
    assert hosts.is_running(hosts.b, worker.pid) != in_a, f"B's copy after a kill at {phase}"
    assert_counts_on(out, f"after a kill at {phase}")
    assert hosts.a.criu_tables() == [] if in_a else True


def test_a_server_keeps_its_client_when_b_takes_its_address(hosts, store, tmp_path):
    """A floating address: the server listens on F in A; a client in a third namespace C
    reaches F through A. The server moves to B, which holds F too; C's route to F then goes
    through B: the connection goes on, nothing lost or repeated."""
    with ClientHost(hosts) as client_host:
        server_status, client_status, port_file = tmp_path / "server.status", tmp_path / "client.status", \
            tmp_path / "port"
        server = hosts.start_in(hosts.a, [sys.executable, FIXTURES / "stream_peer.py", "server", port_file,
                                          server_status, client_host.floating], "server")
        port = wait_until(lambda: port_file.read_text().strip() if port_file.exists() else "", what="the port")
        hosts.processes.start_program(client_host.command(sys.executable, FIXTURES / "stream_peer.py", "client",
                                                          port, client_status, client_host.floating), "client")
        wait_until(lambda: received(client_status) > 100 and received(server_status) > 100, what="the stream")
        done = hosts.ckpt(hosts.a, "migrate", server.pid, "--to", hosts.b.alias, "--store", store, "--json",
                          env=migrate_env(hosts), timeout=300)
        result = json.loads(done.stdout)
        assert [c["restored"] for c in result["restore"]["connections"]] == ["established"], result["restore"]
        client_host.route_via(hosts.b)
        before = received(client_status)
        wait_until(lambda: received(client_status) > before + 100, timeout=30, what="the stream going on")
        for status in (client_status, server_status):
            assert "bad=-" in status.read_text(), status.read_text()
        assert hosts.is_running(hosts.b, server.pid) and not hosts.is_running(hosts.a, server.pid)


# Runs argv with SIGINT's default disposition (exec keeps it). A test run started in the
# background by a shell (`make test &`, CI) inherits SIGINT ignored, and Python then never makes
# it a KeyboardInterrupt: the coordinator would not see the Ctrl-C a test sends.
DEFAULT_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                        "os.execvp(sys.argv[1], sys.argv[1:])"]


def received(status: Path) -> int:
    text = status.read_text() if status.exists() else ""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    return int(fields.get("received", "0"))


class ClientHost:
    """A third network namespace C with a veth to A and one to B; the floating address F on
    A's and B's loopbacks; C's route to F through A, until route_via(B)."""

    def __init__(self, hosts: TwoHosts):
        self.hosts = hosts
        tag = secrets.token_hex(2)
        self.netns = f"ckpt-tc-{tag}"
        octet = os.getpid() % 250 + 1
        self.subnets = {hosts.a.alias: f"10.215.{octet}", hosts.b.alias: f"10.216.{octet}"}
        self.floating = f"10.217.{octet}.1"
        self.links = {hosts.a.alias: f"cc{tag}a", hosts.b.alias: f"cc{tag}b"}

    def command(self, *argv: object) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *map(str, argv)]

    def __enter__(self) -> ClientHost:
        run("ip", "netns", "add", self.netns)
        try:
            run(*self.command("ip", "link", "set", "lo", "up"))
            # C answers on its A-side address through B too, once F's route goes there
            run(*self.command("sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0"))
            for host in (self.hosts.a, self.hosts.b):
                self._link(host)
            run(*self.command("ip", "route", "add", f"{self.floating}/32", "via", f"{self.subnets['host-a']}.2"))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _link(self, host: NetHost) -> None:
        ours, theirs, subnet = self.links[host.alias], self.links[host.alias] + "x", self.subnets[host.alias]
        target = str(host.init_pid) if host.init_pid else f"/run/netns/{host.netns}"
        run("ip", "link", "add", ours, "type", "veth", "peer", "name", theirs)
        run("ip", "link", "set", ours, "netns", self.netns)
        run("ip", "link", "set", theirs, "netns", target)
        run(*self.command("ip", "addr", "add", f"{subnet}.1/24", "dev", ours))
        run(*self.command("ip", "link", "set", ours, "up"))
        run(*host.command("ip", "addr", "add", f"{subnet}.2/24", "dev", theirs))
        run(*host.command("ip", "link", "set", theirs, "up"))
        run(*host.command("ip", "addr", "add", f"{self.floating}/32", "dev", "lo"))
        for other, other_subnet in self.subnets.items():  # C's other address, through C
            if other != host.alias:
                run(*host.command("ip", "route", "add", f"{other_subnet}.0/24", "via", f"{subnet}.1"))

    def route_via(self, host: NetHost) -> None:
        run(*self.command("ip", "route", "replace", f"{self.floating}/32", "via", f"{self.subnets[host.alias]}.2"))

    def __exit__(self, *_exc) -> None:
        run("ip", "netns", "delete", self.netns, check=False)  # its veth ends go with it


# ---- a migration paused at a phase -------------------------------------------------------------

def start_migration(hosts: TwoHosts, store: Path, workers: list[Started], tmp_path: Path, *, pause_at: str,
                    pause: Path, group: str | None = None, rounds: int = 2) -> subprocess.Popen:
    """`ckpt migrate` of workers (a group when named) in A, to pause at phase pause_at; SIGINT
    has its default disposition in it (DEFAULT_SIGINT), so that a test's Ctrl-C is one."""
    environment = {**os.environ, **migrate_env(hosts), PAUSE_AT: pause_at, PAUSE_FILE: str(pause),
                   "CKPT_CACHE": str(hosts.a.workdir / "cache"), "PYTHONPATH": str(ROOT)}
    members = ["--group", group] if group else []
    log = open(tmp_path / "coordinator.log", "wb")
    coordinator = subprocess.Popen([*DEFAULT_SIGINT, *hosts.a.command(
                                        sys.executable, "-m", "ckpt", "migrate", *members, *[w.pid for w in workers],
                                        "--to", hosts.b.alias, "--store", store, "--rounds", rounds)],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=environment, cwd=ROOT,
                                   start_new_session=True)
    log.close()
    hosts.processes.popens.append(coordinator)
    return coordinator


def wait_for_pause(pause: Path, coordinator: subprocess.Popen) -> int:
    text = wait_until(lambda: (pause.read_text() if pause.exists() else "") or coordinator.poll() is not None,
                      timeout=120, what="the coordinator to reach its phase")
    assert text is not True, f"the coordinator ended ({coordinator.returncode}) before its phase"
    return int(str(text).split()[1])


def coordinator_output(tmp_path: Path) -> str:
    return (tmp_path / "coordinator.log").read_text()


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def agents_in(host: NetHost) -> list[int]:
    """`ckpt _member` processes still alive in host (by their command line)."""
    found = []
    for pid in host.pids():
        host_pid = host.host_pid(pid)
        try:
            cmdline = Path(f"/proc/{host_pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"_member" in cmdline:
            found.append(pid)
    return found


def test_a_group_moves_as_one_cut_and_its_stream_goes_on(hosts, store, tmp_path):
    """Two trees streaming to each other over TCP move to B together: none runs in B before
    both are back, and the stream goes on both ways, nothing lost or repeated."""
    server_status, client_status, port_file = tmp_path / "server.status", tmp_path / "client.status", tmp_path / "port"
    server = hosts.start_in(hosts.a, [sys.executable, FIXTURES / "stream_peer.py", "server", port_file,
                                      server_status], "server")
    port = wait_until(lambda: port_file.read_text().strip() if port_file.exists() else "", what="the port")
    client = hosts.start_in(hosts.a, [sys.executable, FIXTURES / "stream_peer.py", "client", port, client_status],
                            "client")
    wait_until(lambda: received(client_status) > 100 and received(server_status) > 100, what="the stream")

    done = hosts.ckpt(hosts.a, "migrate", "--group", "pair", server.pid, client.pid, "--to", hosts.b.alias,
                      "--store", store, "--json", "--rounds", "1", env=migrate_env(hosts), timeout=300)
    result = json.loads(done.stdout)

    assert [m["destination"] for m in result["members"]] == [{"host": hosts.b.alias, "pid": server.pid},
                                                             {"host": hosts.b.alias, "pid": client.pid}]
    for pid in (server.pid, client.pid):
        assert hosts.is_running(hosts.b, pid) and not hosts.is_running(hosts.a, pid)
    before = received(client_status), received(server_status)
    wait_until(lambda: received(client_status) > before[0] + 100 and received(server_status) > before[1] + 100,
               timeout=30, what="the stream going on in B")
    for status in (client_status, server_status):
        assert "bad=-" in status.read_text(), status.read_text()
    listed = json.loads(hosts.ckpt(hosts.a, "list", "--store", store, "--json").stdout)
    # the group's two members, and no pre-copy checkpoint
    assert [(entry["group"] or {}).get("id") for entry in listed] == [result["group"]] * 2, listed
    assert 0 < result["downtime_ms"]


@pytest.mark.parametrize("phase", ["migrate.restored-held", "migrate.decided"])
def test_kill_9_of_a_group_migration_leaves_one_copy_of_each_member(hosts, store, tmp_path, phase):
    outs = [tmp_path / "count-1.txt", tmp_path / "count-2.txt"]
    workers = [start_worker(hosts, out, 16) for out in outs]
    pause = tmp_path / "pause"
    coordinator = start_migration(hosts, store, workers, tmp_path, pause_at=phase, pause=pause,
                                  group="pair", rounds=1)
    os.kill(wait_for_pause(pause, coordinator), signal.SIGKILL)
    coordinator.wait(30)

    in_a = phase in SOURCE_RUNS_AFTER
    for worker, out in zip(workers, outs, strict=True):
        wait_until(lambda w=worker: hosts.is_running(hosts.a, w.pid) == in_a
                   and hosts.is_running(hosts.b, w.pid) != in_a and not agents_in(hosts.b),
                   timeout=30, what=f"one copy of {worker.pid} after a kill at {phase}")
        assert_counts_on(out, f"member {worker.pid} after a kill at {phase}")


def test_ssh_lost_after_the_decision_leaves_the_tree_to_b(hosts, store, tmp_path):
    """The source is ended and the move recorded when the channel dies: B's agent lets the
    tree run, and the coordinator must not restore it here too (two copies)."""
    out = tmp_path / "count.txt"
    worker = start_worker(hosts, out, 16)
    pause = tmp_path / "pause"
    coordinator = start_migration(hosts, store, [worker], tmp_path, pause_at="migrate.decided", pause=pause)
    pid = wait_for_pause(pause, coordinator)
    ssh = [p for p in children(pid) if b"ssh" in Path(f"/proc/{p}/cmdline").read_bytes()]
    for channel in ssh:
        os.kill(channel, signal.SIGKILL)
    pause.unlink()
    assert coordinator.wait(120) == 11, coordinator_output(tmp_path)
    wait_until(lambda: hosts.is_running(hosts.b, worker.pid) and not agents_in(hosts.b), timeout=30,
               what="the tree running in B")
    time.sleep(1.0)
    assert not hosts.is_running(hosts.a, worker.pid), "restored here too: two copies"
    assert_counts_on(out, "after ssh was lost past the decision")


def test_ctrl_c_while_a_groups_sources_are_ended_still_moves_every_member(hosts, store, tmp_path):
    """Ctrl-C once the sources are being ended: the move is finished first (else the members
    would run nowhere), then ckpt stops."""
    outs = [tmp_path / "count-1.txt", tmp_path / "count-2.txt"]
    workers = [start_worker(hosts, out, 16) for out in outs]
    pause = tmp_path / "pause"
    coordinator = start_migration(hosts, store, workers, tmp_path, pause_at="group.released", pause=pause,
                                  group="pair", rounds=1)
    os.kill(wait_for_pause(pause, coordinator), signal.SIGINT)
    time.sleep(0.5)
    pause.unlink()
    assert coordinator.wait(120) != 0
    for worker, out in zip(workers, outs, strict=True):
        wait_until(lambda w=worker: hosts.is_running(hosts.b, w.pid) and not agents_in(hosts.b), timeout=30,
                   what=f"{worker.pid} running in B")
        assert not hosts.is_running(hosts.a, worker.pid)
        assert_counts_on(out, f"member {worker.pid} after Ctrl-C")
