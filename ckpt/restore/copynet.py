"""A copy's own network (docs/design.md, "Clones"): a network namespace with its loopback up
and a veth to the host, a /30 of 10.214.0.0/16 (the host end .1, the copy .2), a default route
through the host end, and the host masquerading 10.214.0.0/16 (nftables table `ip
ckpt-copies`, net.ipv4.ip_forward=1): the copy reaches what the host reaches, and its
listening ports answer at its own address.

Each namespace has a record `<copies dir>/net-<name>.json` (its veth, its /30, who made it,
and once restored the copy's init): the record is the /30's reservation, and says when the
namespace can go (its init is gone, or it never got one and its maker is gone). Records are
read and written under one lock (`<copies dir>/.network.lock`): several copies are set up at
once, each taking the first free /30.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ckpt.errors import CopyNetworkFailed
from ckpt.system import procfs
from ckpt.system.files import atomic_write_bytes, make_readable_dir
from ckpt.system.locks import wait_for_flock

NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps a namespace alive (a bind mount)
TABLE = "ckpt-copies"
PREFIX = "10.214"
SLOTS = 1 << 14  # /30s in 10.214.0.0/16; slot 0 is never used (10.214.0.0 is the network's own)
LOCK_TIMEOUT = 30.0


@dataclass(frozen=True)
class CopyNetwork:
    """One copy's network namespace, its veth's host end and its /30 (slot n: 10.214.0.0 + 4n)."""

    name: str
    host_veth: str
    slot: int

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def _ip(self, last: int) -> str:
        value = self.slot * 4 + last
        return f"{PREFIX}.{value >> 8}.{value & 255}"

    @property
    def address(self) -> str:
        """The copy's address (its eth0)."""
        return self._ip(2)

    @property
    def host_address(self) -> str:
        """The host end's address: the copy's default route, and where it reaches the host."""
        return self._ip(1)

    def to_json(self) -> dict:
        return {"netns": self.name, "host_veth": self.host_veth, "address": self.address,
                "host_address": self.host_address}


def names(tag: str, index: int) -> tuple[str, str]:
    """(namespace, host veth) of copy `index` of the clone whose short tag is `tag`: a veth's
    name is at most 15 characters (IFNAMSIZ), so the tag is the clone id's last 6 characters."""
    return f"ckpt-{tag}-{index}", f"ckh-{tag}-{index}"


def set_up(copies_dir: Path, tag: str, index: int) -> CopyNetwork:
    """Makes copy `index`'s namespace, veth, addresses and route, and the host's masquerade.
    Namespaces of copies that are gone are removed first. CopyNetworkFailed names the step that
    failed; nothing of this copy's is left then."""
    name, veth = names(tag, index)
    with _locked(copies_dir):
        _remove_stale(copies_dir)
        if (NETNS_DIR / name).exists() or _record_path(copies_dir, name).exists():
            raise CopyNetworkFailed(f"network namespace {name} exists already",
                                    hint=f"another copy has it; 'ip netns delete {name}' if none runs")
        network = CopyNetwork(name, veth, _free_slot(copies_dir))
        _write_record(copies_dir, network, {"maker": _me(), "init": None})
        try:
            _create(network)
            _masquerade()
        except BaseException:
            _remove(copies_dir, network)
            raise
    return network


def adopt(copies_dir: Path, network: CopyNetwork, init_pid: int) -> None:
    """Records the copy's init: the namespace is the copy's for as long as that init lives."""
    with _locked(copies_dir):
        _write_record(copies_dir, network, {"maker": _me(), "init": _identity(init_pid)})


def tear_down(copies_dir: Path, network: CopyNetwork) -> None:
    """Removes the namespace (its veth goes with it), its record, and the masquerade once no
    copy's namespace is left."""
    with _locked(copies_dir):
        _remove(copies_dir, network)


def remove_stale(copies_dir: Path) -> list[str]:
    """Removes the namespaces of copies that are gone (`ckpt clone` does it before it makes
    new ones); returns their names."""
    with _locked(copies_dir):
        return _remove_stale(copies_dir)


# ---- records ------------------------------------------------------------------------------

def _record_path(copies_dir: Path, name: str) -> Path:
    return copies_dir / f"net-{name}.json"


def _write_record(copies_dir: Path, network: CopyNetwork, owners: dict) -> None:
    data = {"format": 1, "netns": network.name, "host_veth": network.host_veth, "slot": network.slot, **owners}
    atomic_write_bytes(_record_path(copies_dir, network.name), json.dumps(data).encode(), durable=False)


def _records(copies_dir: Path) -> list[dict]:
    found = []
    for path in copies_dir.glob("net-*.json"):
        try:
            data = json.loads(path.read_text())
            found.append({**data, "slot": int(data["slot"]), "netns": str(data["netns"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours: its slot is skipped by name below anyway
    return found


def _me() -> list[int]:
    return _identity(os.getpid())


def _identity(pid: int) -> list[int]:
    """(PID, start time): a PID alone may be another process's by the time it is looked at."""
    return [pid, procfs.start_ticks(pid)]


def _alive(identity: object) -> bool:
    if not isinstance(identity, list) or len(identity) != 2:
        return False
    try:
        return procfs.is_running(int(identity[0]), int(identity[1]))
    except (ValueError, TypeError):
        return False


def _remove_stale(copies_dir: Path) -> list[str]:
    removed = []
    for record in _records(copies_dir):
        owner = record.get("init") or record.get("maker")
        if not _alive(owner):
            _remove(copies_dir, CopyNetwork(record["netns"], str(record.get("host_veth", "")), record["slot"]))
            removed.append(record["netns"])
    return removed


def _free_slot(copies_dir: Path) -> int:
    used = {record["slot"] for record in _records(copies_dir)}
    for slot in range(1, SLOTS):
        if slot not in used:
            return slot
    raise CopyNetworkFailed(f"all {SLOTS - 1} copy networks of {PREFIX}.0.0/16 are in use",
                            hint="end some copies (or remove stale namespaces with 'ip netns delete')")


@contextmanager
def _locked(copies_dir: Path) -> Iterator[None]:
    make_readable_dir(copies_dir)
    fd = os.open(copies_dir / ".network.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        wait_for_flock(fd, fcntl.LOCK_EX, time.monotonic() + LOCK_TIMEOUT, lambda: CopyNetworkFailed(
            f"the copies' network lock ({copies_dir}/.network.lock) is held for over {LOCK_TIMEOUT:g} s"))
        yield
    finally:
        os.close(fd)


# ---- the namespace, its veth, the host's masquerade ---------------------------------------

def _run(argv: list[str], what: str, stdin: str | None = None) -> None:
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CopyNetworkFailed(f"{what}: {exc}") from None
    if proc.returncode != 0:
        raise CopyNetworkFailed(f"{what}: {(proc.stderr or proc.stdout).strip() or f'exit code {proc.returncode}'}")


def _create(network: CopyNetwork) -> None:
    name, veth = network.name, network.host_veth
    _run(["ip", "netns", "add", name], f"cannot create network namespace {name}")
    _run(["ip", "-n", name, "link", "set", "lo", "up"], f"cannot bring up the loopback of {name}")
    # The copy's end is made inside the namespace as eth0: never a name that clashes on the host.
    _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name],
         f"cannot create the veth {veth} of {name}")
    _run(["ip", "addr", "add", f"{network.host_address}/30", "dev", veth], f"cannot address {veth}")
    _run(["ip", "link", "set", veth, "up"], f"cannot bring up {veth}")
    _run(["ip", "-n", name, "addr", "add", f"{network.address}/30", "dev", "eth0"], f"cannot address {name}'s eth0")
    _run(["ip", "-n", name, "link", "set", "eth0", "up"], f"cannot bring up {name}'s eth0")
    _run(["ip", "-n", name, "route", "add", "default", "via", network.host_address],
         f"cannot route {name} through {network.host_address}")


def _masquerade() -> None:
    """The host forwards the copies' packets and masquerades them on the way out (not between
    copies, nor to the host itself, which sees the copy's own address). One nft transaction,
    idempotent: the table and chain made if absent, the rule replaced."""
    try:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    except OSError as exc:
        raise CopyNetworkFailed(f"cannot set net.ipv4.ip_forward=1: {exc.strerror}") from None
    rules = (f"add table ip {TABLE}\n"
             f"add chain ip {TABLE} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}\n"
             f"flush chain ip {TABLE} postrouting\n"
             f"add rule ip {TABLE} postrouting ip saddr {PREFIX}.0.0/16 ip daddr != {PREFIX}.0.0/16 masquerade\n")
    _run(["nft", "-f", "-"], f"cannot add the masquerade of {PREFIX}.0.0/16 (nftables table ip {TABLE})", rules)


def _remove(copies_dir: Path, network: CopyNetwork) -> None:
    """Best effort, each step on its own: whatever of it exists goes."""
    if network.path.exists():
        subprocess.run(["ip", "netns", "delete", network.name], capture_output=True, timeout=30)
    if network.host_veth and Path(f"/sys/class/net/{network.host_veth}").exists():
        subprocess.run(["ip", "link", "delete", network.host_veth], capture_output=True, timeout=30)
    _record_path(copies_dir, network.name).unlink(missing_ok=True)
    if not _records(copies_dir):
        subprocess.run(["nft", "delete", "table", "ip", TABLE], capture_output=True, timeout=30)
