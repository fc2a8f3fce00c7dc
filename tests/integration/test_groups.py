"""Group checkpoints on one host (issue 26), with real CRIU: a server tree and a client tree, in
sessions of their own, stream numbered lines to each other over TCP on 127.0.0.1 both ways as
fast as they can, each checking that what it receives is consecutive (tests/fixtures/
stream_peer.py). A group dump while they run, both killed (or ended by --stop), the group
restored: both carry on, and no number is lost or repeated on either side. A member that
fails aborts the group: every tree runs on, unfrozen, nothing locked, nothing visible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.phases import PAUSE_AT, PAUSE_FILE
from ckpt.store import Store
from tests.helpers import ROOT, alive, ckpt, ckpt_json, env_settings, state, wait_until
from tests.jsonshape import assert_shape

pytestmark = pytest.mark.integration


PEERS: list[int] = []  # every peer's PID, for a failure's message


class Peer:
    """One end of the stream: its process and what its status file says."""

    def __init__(self, procs, tmp_path: Path, role: str, where: str | Path):
        self.status = tmp_path / f"{role}.status"
        self.popen = procs.start("stream_peer.py", role, where, self.status)
        self.pid, self.procs = self.popen.pid, procs
        PEERS.append(self.pid)

    def read(self) -> dict:
        """{"sent": N, "received": M, "bad": "-" or what went wrong}"""
        try:
            text = self.status.read_text().strip()
        except OSError:
            return {"sent": 0, "received": 0, "bad": "-"}
        fields = dict(item.split("=", 1) for item in text.split())
        return {"sent": int(fields["sent"]), "received": int(fields["received"]), "bad": fields["bad"]}

    def progresses(self, beyond: int = 0, by: int = 20000) -> dict:
        """Waits until it has received `by` numbers past `beyond`, consecutively, and keeps doing so."""
        wait_until(lambda: self.read()["received"] > beyond + by or self.read()["bad"] != "-", timeout=20,
                   what=f"PID {self.pid} to receive past {beyond + by}")
        seen = self.read()
        assert seen["bad"] == "-", f"PID {self.pid}: {seen}; states: {[(p, state(p)) for p in PEERS]}"
        assert state(self.pid) not in ("t", "T", None)
        return seen


def stream_pair(procs, tmp_path: Path) -> tuple[Peer, Peer]:
    port_file = tmp_path / "port"
    server = Peer(procs, tmp_path, "server", port_file)
    port = wait_until(lambda: port_file.exists() and port_file.read_text(), what="the server's port")
    client = Peer(procs, tmp_path, "client", port)
    server.progresses()
    client.progresses()
    return server, client


def groups_in_store(store_dir: Path) -> list[str]:
    settings = env_settings()
    return Store.open(store_dir, False, settings=settings).groups.ids()


def nft_tables() -> list[str]:
    """Every CRIU table of the ruleset, as `nft list ruleset` prints it."""
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
    return ["table " + t for t in ruleset.split("table ")[1:] if t.startswith("inet CRIU-")]


def criu_tables() -> list[str]:
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if "CRIU" in line]


@pytest.mark.parametrize("stop", [False, True], ids=["running", "stop"])
def test_a_group_restored_carries_on_with_no_number_lost_or_repeated(procs, tmp_path, isolated_env, stop):
    server, client = stream_pair(procs, tmp_path)
    tables_before = criu_tables()
    dumped = ckpt_json("dump", "--group", "g", server.pid, client.pid, *(["--stop"] if stop else []))
    at_dump = {p.pid: p.read() for p in (server, client)}
    assert_shape(dumped, "dump: group")
    assert dumped["name"] == "g" and dumped["stopped"] == stop
    members = dumped["members"]
    assert [m["pid"] for m in members] == [server.pid, client.pid]
    for member in members:
        assert member["frozen_at"] <= member["dumped_at"] <= member["thawed_at"]
        assert member["freeze_ms"] > 0 and member["hostname"] and member["checkpoint"]
    stats = dumped["stats"]
    assert set(stats) == {"freeze_skew_ms", "span_ms", "longest_freeze_ms"}
    assert 0 <= stats["freeze_skew_ms"] < 1000, stats  # frozen together, not one after the other
    assert groups_in_store(isolated_env) == [dumped["id"]]
    if stop:
        for peer in (server, client):
            peer.popen.wait(timeout=10)
        # CRIU's lock stays until the restore: both directions of the connection dropped, in
        # each member's table (in the host's network namespace, per connection).
        port = (tmp_path / "port").read_text()
        locked = [t for t in nft_tables() if port in t]
        assert len(locked) == 2 and all(t.count(f"127.0.0.1 . {port} . 127.0.0.1") == 1 for t in locked), locked
    else:
        for peer in (server, client):  # they ran on after the dump
            peer.progresses(at_dump[peer.pid]["received"])
        for peer in (server, client):
            procs.kill_tree(peer.pid)
    restored = ckpt_json("restore", "g")
    assert_shape(restored, "restore: group")
    assert [m["pid"] for m in restored["members"]] == [server.pid, client.pid]
    for peer in (server, client):
        procs.adopt(peer.pid)
    for result in restored["member_results"]:
        assert [c["restored"] for c in result["connections"]] == ["established"], result["connections"]
    # Both carry on from the checkpoint, every number received once, in order.
    for peer in (server, client):
        peer.progresses(at_dump[peer.pid]["received"] if stop else 0, by=50000)
    assert criu_tables() == tables_before, "CRIU's network lock was left behind"


def test_a_member_that_fails_aborts_the_group_and_every_tree_runs_on(procs, tmp_path, isolated_env):
    server, client = stream_pair(procs, tmp_path)
    tables_before = criu_tables()
    # A member refused before anything is frozen (PID 1).
    refused = ckpt("dump", "--group", "g", server.pid, client.pid, 1, check=False)
    assert refused.returncode == 2 and "member 1 failed to prepare" in refused.stderr, refused.stderr
    # CRIU failing on one member while the others are frozen and held: the third member's tree
    # ends between the prepare and the freeze.
    victim = procs.start_program(["sleep", "600"], "victim")
    proc, pause = paused_group_dump(tmp_path, "group.prepared", server.pid, client.pid, victim.pid)
    procs.kill_tree(victim.pid)
    pause.unlink()
    _, errors = proc.communicate(timeout=120)
    assert proc.returncode != 0 and f"member {victim.pid} failed to freeze and dump" in errors, errors
    for peer in (server, client):
        peer.progresses(peer.read()["received"])
    assert criu_tables() == tables_before, "CRIU's network lock was left behind"
    assert groups_in_store(isolated_env) == []
    # No member was committed (the failure came before any commit): no checkpoint at all.
    assert ckpt_json("list") == []
    assert not [p for p in (isolated_env / "tmp").iterdir() if p.name.startswith("dump-")]
    # Nothing is left locked: the next group dump of the same trees works (its members from a group file).
    members = tmp_path / "g.members"
    members.write_text(f"# the server and its client\n{server.pid}\n\n{client.pid}  # the client\n")
    dumped = ckpt_json("dump", "--group", "g", "--members", members)
    assert dumped["id"] in groups_in_store(isolated_env)
    assert [m["pid"] for m in dumped["members"]] == [server.pid, client.pid]


def paused_group_dump(tmp_path: Path, phase: str, *pids: int) -> tuple[subprocess.Popen, Path]:
    """`ckpt dump --group g PIDS` paused at a phase (the test-only hook of ckpt/phases.py)."""
    pause = tmp_path / "paused-at"
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", "dump", "--group", "g", *map(str, pids)], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, PAUSE_AT: phase, PAUSE_FILE: str(pause)})
    wait_until(lambda: pause.exists() or proc.poll() is not None, timeout=60, what=f"phase {phase}")
    assert pause.exists(), proc.communicate()[1]
    return proc, pause


def test_a_restore_of_a_group_refuses_what_groups_do_not_take(procs, tmp_path, isolated_env):
    server, client = stream_pair(procs, tmp_path)
    ckpt_json("dump", "--group", "g", server.pid, client.pid)
    refused = ckpt("restore", "g", "--new-pidns", check=False)
    assert refused.returncode == 2 and "--new-pidns is not taken for a group" in refused.stderr
    two = ckpt("dump", server.pid, client.pid, check=False)
    assert two.returncode == 2 and "2 PIDs need --group NAME" in two.stderr
    assert alive(server.pid) and alive(client.pid)


def group_tables() -> list[str]:
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if "ckpt-group-" in line]


def test_a_group_restore_killed_while_its_members_are_held_leaves_no_lock_and_nothing_running(
        procs, tmp_path, isolated_env):
    """kill -9 of `ckpt restore GROUP` while its members are restored and held: CRIU ends what
    it restored (none ran), and the group restore's own nftables table goes with its owner
    (its watchdog), instead of dropping those connections' packets for good."""
    server, client = stream_pair(procs, tmp_path)
    ckpt_json("dump", "--group", "g", server.pid, client.pid)
    for peer in (server, client):
        procs.kill_tree(peer.pid)
    pause = tmp_path / "restore-paused-at"
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", "restore", "g"], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, PAUSE_AT: "restore.post-restore", PAUSE_FILE: str(pause)})
    wait_until(lambda: pause.exists() or proc.poll() is not None, timeout=60, what="the restore's hold")
    assert pause.exists() and len(group_tables()) == 1, group_tables()
    proc.kill()
    proc.wait(10)
    for peer in (server, client):
        procs.adopt(peer.pid)  # ended by the test should CRIU not end them
    wait_until(lambda: group_tables() == [], timeout=10, what="the group restore's table to go")
    wait_until(lambda: not any(alive(p.pid) for p in (server, client)), timeout=10,
               what="CRIU to end the restored members")
