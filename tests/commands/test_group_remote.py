"""A group's members on other hosts (ckpt/commands/group_remote.py, member_agent.py) without
ssh or CRIU: --on, the ssh command, the hello's settings, the requests on the wire, and a
RemoteMember whose "ssh" is a stand-in that runs the far end's command here (or fails as ssh
does). The real thing, over sshd between two network namespaces: tests/integration/
test_groups_remote.py."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from ckpt.commands.dump import DumpRequest
from ckpt.commands.group_remote import RemoteLink, RemoteMember, parse_on, remote_member_factory
from ckpt.commands.member_agent import request_from_wire, request_to_wire, settings_from_hello
from ckpt.commands.restore import RestoreRequest
from ckpt.errors import ExitCode, MemberLost, ProcessNotFound, UsageError
from ckpt.settings import Settings
from ckpt.store import Origin


def test_on_maps_recorded_hosts_to_others():
    assert parse_on(["host-a=host-c", "host-b="]) == {"host-a": "host-c", "host-b": ""}
    for bad in ("host-a", "=host-c", "host-a=-oProxyCommand=x"):
        with pytest.raises(UsageError):
            parse_on([bad])


def test_the_ssh_command_quotes_the_remote_command_and_puts_the_users_options_first():
    settings = Settings(ssh="ssh -F '/etc/ckpt/ssh config'", remote_ckpt="'/opt/my ckpt/bin/ckpt' -q")
    link = RemoteLink.of(settings, "s3://b/p", password="secret")
    command = link.command("host-a")
    assert command[:3] == ["ssh", "-F", "/etc/ckpt/ssh config"]
    assert command[3:5] == ["-T", "-o"] and "BatchMode=yes" in command
    assert command[-2:] == ["host-a", "'/opt/my ckpt/bin/ckpt' -q _member"]
    assert "secret" not in " ".join(command) and "secret" not in repr(link)


def test_hello_sets_the_store_password_and_passed_settings_and_checks_them(tmp_path):
    base = Settings(store=tmp_path / "mine", lock_timeout=60.0, cache=tmp_path / "cache")
    got = settings_from_hello(base, {"store": "s3://b/p/", "password": "pw",
                                     "settings": {"lock_timeout": 5, "page_stream": False, "cache": "/elsewhere"}})
    assert (got.store, got.password, got.lock_timeout, got.page_stream) == ("s3://b/p", "pw", 5.0, False)
    assert got.cache == tmp_path / "cache"  # where things are on a host is the host's own
    with pytest.raises(UsageError, match="CKPT_LOCK_TIMEOUT"):
        settings_from_hello(base, {"store": "s3://b/p", "settings": {"lock_timeout": -1}})
    with pytest.raises(UsageError):
        settings_from_hello(base, {"settings": {}})


def test_requests_cross_the_wire_unchanged():
    dump = DumpRequest(pid=42, name="web", stop=True, group={"id": "x", "name": "web"}, origin=Origin("run", "w"))
    assert request_from_wire("dump", request_to_wire(dump)) == dump
    restore = RestoreRequest(ref="20261203-190102-123-3fa9c1", tcp_close=False, lazy=False)
    assert request_from_wire("restore", {**request_to_wire(restore), "from_a_newer_ckpt": 1}) == restore
    with pytest.raises(UsageError):
        request_from_wire("move", {})
    with pytest.raises(UsageError):
        request_from_wire("restore", {"lazy": True})  # no ref


def test_the_factory_gives_remote_members_for_other_hosts_and_local_ones_here():
    from ckpt.commands.group_member import MemberSpec

    local = []
    link = RemoteLink.of(Settings(), "s3://b/p")
    make = remote_member_factory(lambda spec: local.append(spec) or "local", link)
    group = {"id": "20261203-190102-123-3fa9c1", "name": "web"}
    assert make(MemberSpec("42", pid=42, group=group)) == "local" and local[0].pid == 42
    remote = make(MemberSpec("host-a:43", host="host-a", pid=43, group=group, stop=True, hold_limit=9))
    assert isinstance(remote, RemoteMember) and remote.label == "host-a:43" and remote.link.hold_limit == 9
    assert remote.request == DumpRequest(pid=43, stop=True, group=group, name="web")

    make_restore = remote_member_factory(lambda spec: "local", link, restore=True)
    peers = ((("10.0.0.1", 80), ("10.0.0.2", 5000)),)
    member = make_restore(MemberSpec("host-c:43", host="host-c", checkpoint="c1", group_peers=peers, lazy=False))
    assert isinstance(member, RemoteMember) and member.host == "host-c"
    assert member.request == RestoreRequest(ref="c1", lazy=False, group_peers=[[["10.0.0.1", 80], ["10.0.0.2", 5000]]])
    assert make_restore(MemberSpec("45", checkpoint="c3")) == "local"


def test_on_places_members_and_a_moved_member_is_nobodys_intra_group_peer():
    """--on host-b=: host-b's member comes here, host-a's stays on host-a; the moved member's
    connections come back closed, so neither side counts the other as a group peer."""
    from ckpt.commands.group import GroupRestoreRequest, placements, restore_specs
    from ckpt.store.groups import GroupManifest, GroupMember

    group = GroupManifest(id="20261203-190102-123-3fa9c1", created="", members=[
        GroupMember(checkpoint="20261203-190102-124-000001", pid=10, host="host-a"),
        GroupMember(checkpoint="20261203-190102-124-000002", pid=20, host="host-b"),
        GroupMember(checkpoint="20261203-190102-124-000003", pid=30, host="host-a")])
    connections = [[(("10.0.0.1", 80), ("10.0.0.2", 5000))], [(("10.0.0.2", 5000), ("10.0.0.1", 80))],
                   [(("10.0.0.1", 81), ("10.0.0.1", 6000))]]
    hosts = placements(group, {"host-b": ""})
    assert hosts == ["host-a", "", "host-a"]
    specs = restore_specs(group, connections, GroupRestoreRequest(ref="g"), hosts)
    assert [(s.label, s.host) for s in specs] == [("host-a:10", "host-a"), ("20", ""), ("host-a:30", "host-a")]
    assert specs[1].group_peers == ()  # moved: its connections come back closed
    assert specs[0].group_peers == (connections[2][0],) and specs[2].group_peers == (connections[0][0],)
    with pytest.raises(UsageError, match="no member of group"):
        placements(group, {"host-x": "host-c"})


# ---- a RemoteMember over a stand-in for ssh ---------------------------------------------------

def stand_in_ssh(tmp_path, body: str) -> str:
    """A "ssh" that skips its options and the host, and runs body (with $1: the remote command)."""
    script = tmp_path / "ssh"
    script.write_text(f"#!/bin/sh\nwhile [ $# -gt 1 ]; do shift; done\n{body}\n")
    script.chmod(0o755)
    return str(script)


def link_through(tmp_path, body: str, timeout: float = 30.0) -> RemoteLink:
    settings = Settings(ssh=stand_in_ssh(tmp_path, body), remote_ckpt=shlex.join([sys.executable, "-m", "ckpt"]))
    return replace(RemoteLink.of(settings, str(tmp_path / "store")), timeout=timeout)


def a_store(path):
    from ckpt.store import Store

    return Store.open(path, create=True, settings=Settings(store=path))


def test_the_agents_error_arrives_as_its_typed_error_with_the_host_in_front(tmp_path):
    a_store(tmp_path / "store")
    gone = subprocess.Popen(["true"])
    gone.wait()
    member = RemoteMember("host-a", DumpRequest(pid=gone.pid), link_through(tmp_path, 'exec sh -c "$1"'))
    try:
        with pytest.raises(ProcessNotFound, match="^host-a: ") as caught:
            member.prepare()
        assert caught.value.exit_code == ExitCode.NOT_FOUND
    finally:
        member.abort()
    assert member.process is not None and member.process.returncode == ExitCode.NOT_FOUND


def test_a_channel_that_ends_is_member_lost_naming_the_host_and_ssh_last_words(tmp_path):
    refused = 'echo "ssh: connect to host 10.0.0.9 port 22: Connection refused" >&2; exit 255'
    member = RemoteMember("host-a", DumpRequest(pid=42), link_through(tmp_path, refused))
    with pytest.raises(MemberLost, match="host-a: .*during hello .*255.*Connection refused") as caught:
        member.prepare()
    assert caught.value.exit_code == ExitCode.MEMBER_LOST == 11
    member.abort()  # safe after the loss, and again
    member.abort()


def test_a_member_that_does_not_answer_in_time_is_lost_and_its_abort_is_quick(tmp_path):
    member = RemoteMember("host-a", DumpRequest(pid=42), link_through(tmp_path, "exec cat 3>&1 >/dev/null",
                                                                            timeout=0.5))
    with pytest.raises(MemberLost, match="no answer to hello within 0.5 s"):
        member.prepare()
    started = time.monotonic()
    member.abort()  # its stdin closed: the stand-in ends
    assert time.monotonic() - started < 3.0 and member.process is not None and member.process.poll() is not None


def test_a_host_whose_store_of_that_name_is_another_is_refused(tmp_path):
    """Every host has a /var/lib/ckpt: a member must not write into its own host's."""
    from ckpt.commands.member_agent import store_identity
    from ckpt.errors import StoreError

    theirs, ours = a_store(tmp_path / "store"), a_store(tmp_path / "another")
    link = replace(link_through(tmp_path, 'exec sh -c "$1"'), store_identity=store_identity(ours))
    member = RemoteMember("host-a", DumpRequest(pid=42), link)
    with pytest.raises(StoreError, match="host-a: the store at .* is another store than the coordinator's"):
        member.prepare()
    member.abort()
    gone = subprocess.Popen(["true"])
    gone.wait()
    good = RemoteMember("host-a", DumpRequest(pid=gone.pid), replace(link, store_identity=store_identity(theirs)))
    with pytest.raises(ProcessNotFound):  # past hello: the store is the same
        good.prepare()
    good.abort()


def test_members_anywhere_opens_the_store_only_for_a_member_on_another_host(tmp_path):
    """The CLI's member_factory: this host's members as the coordinator makes them; the link
    to other hosts (the store's location and identity) made at the first remote member."""
    from ckpt.commands.group_member import LocalDumpMember, MemberSpec
    from ckpt.commands.group_remote import members_anywhere
    from ckpt.commands.member_agent import store_identity
    from ckpt.reporting import NullReporter

    where = tmp_path / "store"
    settings = Settings(store=where, ssh="ssh -F /dev/null")
    make = members_anywhere(where, NullReporter(), settings=settings, passwords=None, timeout=7)
    assert isinstance(make(MemberSpec("42", pid=42)), LocalDumpMember)
    assert not where.exists(), "the store was opened for a member of this host"
    store = a_store(where)
    remote = make(MemberSpec("host-a:43", host="host-a", pid=43, hold_limit=5))
    assert isinstance(remote, RemoteMember) and remote.link.store == str(where)
    assert (remote.link.store_identity, remote.link.timeout, remote.link.hold_limit) == (store_identity(store), 7, 5)
    assert remote.link.ssh == ("ssh", "-F", "/dev/null") and remote.link.password is None
