"""Two test hosts on this one kernel, for what crosses hosts (group checkpoints over ssh):
network namespaces A and B joined by a veth pair (10.213.N.1 and .2, only inside them; each
with its loopback up), an sshd in each on its address (its host key, a client key and
authorized_keys made here), a client config (`ssh -F`) naming them host-a and host-b, and a
SeaweedFS S3 server in A on A's address, which both reach. The hosts share the PIDs and the
filesystem of this kernel; each has its own network (so its own nftables tables), its own
ckpt cache and its own sshd.

With own_pids=True, host B is also a PID namespace of its own (with a mount namespace for its
/proc and a UTS namespace named "host-b"), as another machine would be: a migration's
destination restores a tree with the PIDs its source, on the same kernel, still holds frozen.
Its PID 1 is tests/fixtures/host_init.py, which starts B's sshd and reaps every orphan of the
namespace (restored trees end up its children); its death ends every process in B. PIDs seen
inside B differ from the host's: `NetHost.start`, `pids`, `is_running` and `kill` speak B's.

Everything started here is ended by PID, and the namespaces deleted, even when a test fails.
Nothing is sent anywhere but to the addresses of these namespaces."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import FIXTURES, ROOT, Processes, wait_until
from tests.s3server import ACCESS_KEY, SECRET_KEY, WeedServer

SSHD = "/usr/sbin/sshd"
READY_TIMEOUT = 20.0
BUCKET = "ckpt-hosts"


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=check, timeout=60)


@dataclass
class Started:
    """A process started on a test host: `pid` as the host sees it (what ckpt and CRIU there
    are given), `host_pid` as this kernel's root namespace sees it, `popen` what we started
    (nsenter, in a host of its own PIDs: argv is its child)."""

    popen: subprocess.Popen
    pid: int
    host_pid: int


@dataclass
class NetHost:
    alias: str  # its name in the ssh client config: host-a, host-b
    netns: str
    address: str
    workdir: Path
    init_pid: int | None = None  # a host of its own PIDs: its PID 1, as this kernel's root namespace sees it

    def command(self, *argv: object) -> list[str]:
        """argv run inside this host's network namespace, and nothing else's: not `ip netns
        exec`, whose mount namespace of its own (for /sys) CRIU would have to dump, and cannot
        ("has unreachable sharing"). nsenter execs argv: its PID is argv's.

        A host of its own PIDs: its network, PID, mount and UTS namespaces, the working
        directory kept (entering a mount namespace would move it to /). nsenter then forks:
        argv is nsenter's child, with a PID of its own in the host (`start` finds both)."""
        if self.init_pid is None:
            return ["nsenter", f"--net=/run/netns/{self.netns}", *map(str, argv)]
        return ["nsenter", f"--target={self.init_pid}", "--net", "--pid", "--mount", "--uts", "--wd=.",
                *map(str, argv)]

    # ---- processes, by the PIDs this host sees -------------------------------------------------

    def start(self, processes: Processes, argv: list, label: str) -> Started:
        """argv started on this host in a session of its own (stdio to the test's directory),
        ended at teardown by processes (through nsenter's tree, by PID)."""
        if self.init_pid is None:
            popen = processes.start_program(self.command(*argv), label)
            return Started(popen, popen.pid, popen.pid)
        # setsid: argv leads a session of B's (nsenter's session is outside B); nsenter's child
        # leads no process group, so setsid execs argv without forking again.
        popen = processes.start_program(self.command("setsid", *argv), label)
        child = wait_until(lambda: _children(popen.pid) or popen.poll() is not None, timeout=READY_TIMEOUT,
                           what=f"the process nsenter starts on {self.alias}")
        if child is True:
            raise RuntimeError(f"nsenter on {self.alias} ended ({popen.returncode}) before starting {argv}")
        host_pid = child[0]
        return Started(popen, self.pid_of(host_pid), host_pid)

    def pid_of(self, host_pid: int) -> int:
        """This host's PID of a process of the root namespace's host_pid."""
        if self.init_pid is None:
            return host_pid
        for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
        raise RuntimeError(f"no NSpid for {host_pid}")

    def host_pid(self, pid: int) -> int | None:
        """The root namespace's PID of this host's pid (None: no such process here)."""
        if self.init_pid is None:
            return pid if _state(pid) is not None else None
        return self._members().get(pid)

    def pids(self) -> list[int]:
        """The PIDs of this host's live processes, as it sees them (a host that shares this
        kernel's PIDs: every live process)."""
        if self.init_pid is None:
            return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                          and _state(int(p.name)) not in (None, "Z", "X"))
        return sorted(pid for pid, host_pid in self._members().items() if _state(host_pid) not in (None, "Z", "X"))

    def is_running(self, pid: int) -> bool:
        """Whether this host's pid is a live (not zombie) process of this host."""
        host_pid = self.host_pid(pid)
        return host_pid is not None and _state(host_pid) not in (None, "Z", "X")

    def kill(self, pid: int, timeout: float = 10.0) -> None:
        """SIGKILL to this host's pid, then until it is gone (reaped, or a zombie)."""
        host_pid = self.host_pid(pid)
        if host_pid is None:
            return
        try:
            os.kill(host_pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_until(lambda: _state(host_pid) in (None, "Z", "X"), timeout=timeout, what=f"{pid} on {self.alias} gone")

    def _members(self) -> dict[int, int]:
        """{PID in this host: PID in the root namespace} of every process of its PID namespace."""
        namespace = os.stat(f"/proc/{self.init_pid}/ns/pid").st_ino
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.stat(entry / "ns" / "pid").st_ino != namespace:
                    continue
                found[self.pid_of(int(entry.name))] = int(entry.name)
            except (OSError, RuntimeError):
                continue  # gone meanwhile
        return found

    def nft_tables(self) -> list[str]:
        listed = run(*self.command("nft", "list", "tables")).stdout
        return [line for line in listed.splitlines() if line.strip()]

    def criu_tables(self) -> list[str]:
        """CRIU's network lock tables left in this host's namespace (its names hold "CRIU")."""
        return [t for t in self.nft_tables() if "CRIU" in t]


class OneHost:
    """A network namespace of its own (loopback only): a host whose nftables no other test touches."""

    def __init__(self, workdir: Path):
        self.host = NetHost("host", f"ckpt-t1-{secrets.token_hex(3)}", "127.0.0.1", workdir)

    def __enter__(self) -> NetHost:
        run("ip", "netns", "add", self.host.netns)
        try:
            run("ip", "-n", self.host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self.host

    def __exit__(self, *_exc) -> None:
        run("ip", "netns", "del", self.host.netns, check=False)


class NamespacedWeed(WeedServer):
    """SeaweedFS in a test host's namespace: its readiness is asked from inside it too."""

    def _wait_ready(self) -> bool:
        script = ("import sys, boto3\n"
                  "c = boto3.client('s3', endpoint_url=sys.argv[1], aws_access_key_id=sys.argv[2], "
                  "aws_secret_access_key=sys.argv[3], region_name='us-east-1')\n"
                  "c.create_bucket(Bucket=sys.argv[4])\n")
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            made = subprocess.run([*self.run_in, sys.executable, "-c", script, self.endpoint, ACCESS_KEY,
                                   SECRET_KEY, BUCKET], capture_output=True, timeout=30)
            if made.returncode == 0 or b"BucketAlreadyOwnedByYou" in made.stderr:
                return True
            time.sleep(0.2)
        return False


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class TwoHosts:
    """host-a and host-b (see the module's docstring); a context manager that tears all down.
    own_pids: B has PIDs (and /proc, and a hostname) of its own; s3: start the S3 server (a
    caller that uses a directory store may do without); lifetime: B's PID 1 ends by itself
    after that many seconds."""

    def __init__(self, workdir: Path, processes: Processes, own_pids: bool = False, s3: bool = True,
                 lifetime: float = 7200.0):
        self.workdir, self.processes = workdir, processes
        self.own_pids, self.with_s3, self.lifetime = own_pids, s3, lifetime
        tag = secrets.token_hex(3)
        subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.hosts = [NetHost(f"host-{x}", f"ckpt-t{x}-{tag}", f"{subnet}.{i}", workdir / f"host-{x}")
                      for i, x in ((1, "a"), (2, "b"))]
        self.a, self.b = self.hosts
        self.veth = (f"ck{tag}a", f"ck{tag}b")
        self.ssh_config = workdir / "ssh_config"
        self.weed: NamespacedWeed | None = None
        self.sshd: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        try:
            self._network()
            self._keys()
            if self.with_s3:
                self.weed = NamespacedWeed(self.workdir / "weed", self.a.address, tuple(self.a.command()))
                (self.workdir / "weed").mkdir()
                self.weed.start()
            for host in self.hosts:
                self._start_sshd(host)
            for host, sshd in zip(self.hosts, self.sshd, strict=True):
                log = host.workdir / "sshd.log"
                wait_until(lambda: sshd.poll() is not None or "Server listening" in log.read_text(),
                           timeout=READY_TIMEOUT, what=f"the sshd of {host.alias}")
                if sshd.poll() is not None:
                    raise RuntimeError(f"the sshd of {host.alias} ended: {log.read_text()}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # ---- what the tests use ---------------------------------------------------------------

    @property
    def store_url(self) -> str:
        return f"s3://{BUCKET}/t-{secrets.token_hex(4)}"

    def ssh(self, via: NetHost | None = None) -> str:
        """CKPT_SSH with the hosts' client config: for a coordinator inside a test host, or
        (via) for one outside them all, ssh run inside via's namespace."""
        return shlex.join([*(via.command() if via else []), "ssh", "-F", str(self.ssh_config)])

    def remote_ckpt(self) -> str:
        """CKPT_REMOTE_CKPT: this tree's ckpt, by the interpreter of the tests."""
        return shlex.join([sys.executable, "-m", "ckpt"])

    def pids_in(self, host: NetHost) -> list[int]:
        return host.pids()

    def is_running(self, host: NetHost, pid: int) -> bool:
        return host.is_running(pid)

    def kill_in(self, host: NetHost, pid: int) -> None:
        host.kill(pid)

    def start_in(self, host: NetHost, argv: list, label: str) -> Started:
        return host.start(self.processes, argv, label)

    def s3_environment(self) -> dict[str, str]:
        if not self.with_s3:
            return {}
        if self.weed is None:
            raise RuntimeError("not started")
        return {"AWS_ENDPOINT_URL": self.weed.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def ckpt(self, host: NetHost, *args: object, env: dict | None = None, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess:
        """The real CLI run inside host's namespace, with its cache and the S3 server's variables."""
        environment = {**os.environ, **self.s3_environment(), "CKPT_CACHE": str(host.workdir / "cache"),
                       "PYTHONPATH": str(ROOT), **(env or {})}
        done = subprocess.run(host.command(sys.executable, "-m", "ckpt", *args), capture_output=True, text=True,
                              env=environment, timeout=timeout, cwd=ROOT)
        if check and done.returncode != 0:
            raise AssertionError(f"ckpt {' '.join(map(str, args))} on {host.alias} failed ({done.returncode}):\n"
                                 f"{done.stderr}")
        return done

    # ---- setting up -------------------------------------------------------------------------

    def _network(self) -> None:
        for host in self.hosts:
            host.workdir.mkdir(parents=True)
            run("ip", "netns", "add", host.netns)
        run("ip", "link", "add", self.veth[0], "netns", self.a.netns, "type", "veth",
            "peer", "name", self.veth[1], "netns", self.b.netns)
        for host, veth in zip(self.hosts, self.veth, strict=True):
            run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", veth)
            run("ip", "-n", host.netns, "link", "set", veth, "up")
            run("ip", "-n", host.netns, "link", "set", "lo", "up")

    def _keys(self) -> None:
        self.client_key = self.workdir / "client_key"
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ckpt-tests", "-f", self.client_key)
        (self.workdir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        known, config = [], ["Host *", "  User root", f"  IdentityFile {self.client_key}", "  IdentitiesOnly yes",
                             f"  UserKnownHostsFile {self.workdir / 'known_hosts'}",
                             "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking yes",
                             "  LogLevel ERROR", "  ConnectTimeout 10"]
        for host in self.hosts:
            key = host.workdir / "host_key"
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.alias, "-f", key)
            known.append(f"{host.address} {Path(f'{key}.pub').read_text().strip()}")
            config[:0] = [f"Host {host.alias}", f"  HostName {host.address}"]
        (self.workdir / "known_hosts").write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("\n".join(config) + "\n")

    def _start_sshd(self, host: NetHost) -> None:
        # sshd's privilege separation needs this directory (made by its service, which is not run here).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        environment = {**self.s3_environment(), "CKPT_CACHE": str(host.workdir / "cache"), "PYTHONPATH": str(ROOT)}
        config = host.workdir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host.address}", "Port 22", f"HostKey {host.workdir / 'host_key'}",
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "UseDNS no", f"PidFile {host.workdir / 'sshd.pid'}", "LogLevel INFO",
            # what the member's `ckpt` needs of its host: this tree, its own cache, the S3 server
            "SetEnv " + " ".join(f"{k}={v}" for k, v in environment.items()),
        ]) + "\n")
        log = open(host.workdir / "sshd.log", "wb")
        try:
            if host is self.b and self.own_pids:
                log.close()  # host_init.py appends sshd's output to it
                self._start_own_pids(host, [SSHD, "-D", "-e", "-f", config])
            else:
                self.sshd.append(subprocess.Popen(host.command(SSHD, "-D", "-e", "-f", config),
                                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                  start_new_session=True))
        finally:
            log.close()

    def _start_own_pids(self, host: NetHost, daemon: list) -> None:
        """host's PID 1 (host_init.py, in its network namespace and new PID, mount and UTS
        namespaces: unshare forks it, mounts a /proc of the new PID namespace, and with
        --kill-child has it killed if unshare dies) starting daemon. The Popen kept is unshare's;
        host.init_pid is its child, PID 1."""
        log = open(host.workdir / "init.log", "wb")
        unshare = subprocess.Popen(
            host.command("unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child",
                         sys.executable, FIXTURES / "host_init.py", host.alias, self.lifetime,
                         host.workdir / "sshd.log", *daemon),
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.sshd.append(unshare)
        child = wait_until(lambda: _children(unshare.pid) or unshare.poll() is not None, timeout=READY_TIMEOUT,
                           what=f"the PID 1 of {host.alias}")
        if child is True:
            raise RuntimeError(f"unshare for {host.alias} ended ({unshare.returncode})")
        host.init_pid = child[0]

    def close(self) -> None:
        """Ends the sshds and the S3 server (by PID; B's PID 1, which ends all of B's processes,
        when B has PIDs of its own), then deletes the namespaces."""
        init = self.b.init_pid
        if init is not None:
            try:
                os.kill(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.b.init_pid = None
        for sshd in self.sshd:
            if sshd.poll() is None:
                sshd.kill()
            sshd.wait(10)
        if self.weed is not None:
            self.weed.stop()
        for host in self.hosts:
            run("ip", "netns", "del", host.netns, check=False)  # its veth end goes with it


@contextmanager
def hosts_with_own_pids(tmp_path: Path) -> Iterator[TwoHosts]:
    """Hosts A and B, B with PIDs of its own, without the S3 server (a directory store both
    reach): a migration's hosts. Everything started through them is ended on the way out."""
    processes = Processes(tmp_path)
    try:
        with TwoHosts(tmp_path / "hosts", processes, own_pids=True, s3=False) as made:
            yield made
    finally:
        processes.cleanup()
