"""The group coordinator (ckpt/commands/group.py) with fake members: the order of the phases,
fail closed at every phase, --stop commits the group before any member is let go, the skew."""

from __future__ import annotations

import threading
import time

import pytest

from ckpt.commands.group import GroupDumpRequest, group_dump
from ckpt.commands.group_member import Committed, Held, MemberSpec, Prepared, Released, parse_member
from ckpt.criu.images import TcpConnection
from ckpt.errors import GroupFailed, ProcessNotFound, UsageError
from ckpt.restore import tcppeers
from ckpt.store import Store
from ckpt.system.inetdiag import ESTABLISHED
from tests.commands.conftest import Heard
from tests.helpers import env_settings

PHASES = ("prepare", "capture", "release", "commit")


class FakeMember:
    """A member that logs each phase into a shared journal; fails (or hangs until aborted) at
    one phase if told to. Its times: frozen at 100 + index / 100, held 50 ms later."""

    def __init__(self, spec: MemberSpec, index: int, journal: list, fail_at: str | None = None,
                 hang_at: str | None = None, on_release=None):
        self.spec, self.label, self.index, self.journal = spec, spec.label, index, journal
        self.fail_at, self.hang_at, self.on_release = fail_at, hang_at, on_release
        self.aborted = threading.Event()

    def _phase(self, name: str) -> None:
        self.journal.append((name, self.label))
        if name == self.hang_at:
            self.aborted.wait(10)
            raise ProcessNotFound("cut short by the abort")
        if name == self.fail_at:
            raise ProcessNotFound(f"process {self.spec.pid} is gone")

    def prepare(self) -> Prepared:
        self._phase("prepare")
        # members 0 and 1 share a UNIX stream connection (inodes 100 and 101)
        unix = {0: [[100, 101]], 1: [[101, 100], [7, 8]]}.get(self.index, [])
        return Prepared(hostname="here", command=f"tree {self.index}", unix_connections=unix)

    def capture(self) -> Held:
        self._phase("capture")
        frozen = 100.0 + self.index / 100
        checkpoint = f"cp-{self.index}" if self.spec.stop else ""
        return Held(frozen_at=frozen, held_at=frozen + 0.05, checkpoint=checkpoint, freeze_ms=50.0)

    def release(self) -> Released:
        if self.on_release is not None:
            self.on_release()
        self._phase("release")
        return Released(released_at=100.0 + self.index / 100 + 0.2)

    def commit(self) -> Committed:
        self._phase("commit")
        return Committed(checkpoint=f"cp-{self.index}", freeze_ms=50.0, result={"id": f"cp-{self.index}"})

    def abort(self) -> None:
        self.journal.append(("abort", self.label))
        self.aborted.set()


class Members:
    """The factory a test hands group_dump(); keeps the members it made."""

    def __init__(self, **behaviour):
        self.journal: list = []
        self.made: list[FakeMember] = []
        self.behaviour = behaviour  # label -> dict(fail_at=..., hang_at=..., on_release=...)

    def __call__(self, spec: MemberSpec) -> FakeMember:
        member = FakeMember(spec, len(self.made), self.journal, **self.behaviour.get(spec.label, {}))
        self.made.append(member)
        return member

    def order(self, phase: str) -> list[int]:
        return [i for i, (name, _) in enumerate(self.journal) if name == phase]


def run(members: Members, labels=("11", "22", "33"), reporter=None, **request) -> object:
    settings = env_settings()
    return group_dump(settings.store, GroupDumpRequest(members=list(labels), name="g", **request),
                      reporter or Heard(), settings=settings, member_factory=members)


def groups_in_store() -> list[str]:
    settings = env_settings()
    return Store.open(settings.store, False, settings=settings).groups.ids()


def test_phases_in_order_and_the_group_committed_last():
    members = Members()
    result = run(members)
    prepares, captures, releases, commits = (members.order(p) for p in PHASES)
    assert max(prepares) < min(captures)
    assert max(captures) < min(releases), "a member was let go before every member was held"
    assert max(releases) < min(commits)
    assert not members.order("abort")
    group = result.to_json()
    assert [m["checkpoint"] for m in group["members"]] == ["cp-0", "cp-1", "cp-2"]
    assert group["stats"] == {"freeze_skew_ms": 20.0, "span_ms": 220.0, "longest_freeze_ms": 200.0}
    assert [m["frozen_at"] for m in group["members"]] == [100.0, 100.01, 100.02]
    assert groups_in_store() == [group["id"]]


def test_a_unix_connection_between_members_is_warned_of_once():
    heard = Heard()
    run(Members(), reporter=heard)
    assert heard.of("warn") == ["members 11 and 22 are connected by a UNIX stream socket: it is not restored "
                                "(after a restore each end writes into a file); use TCP on 127.0.0.1 between "
                                "members, or make them one tree"]


def test_stop_commits_the_group_before_any_member_is_let_go():
    seen = []
    members = Members(**{"11": {"on_release": lambda: seen.append(groups_in_store())}})
    result = run(members, stop=True)
    assert seen == [[result.group.id]]
    assert result.group.stopped
    assert [m.checkpoint for m in result.group.members] == ["cp-0", "cp-1", "cp-2"]


@pytest.mark.parametrize("stop", [False, True], ids=["plain", "stop"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_failure_at_any_phase_aborts_every_member(phase, stop):
    members = Members(**{"22": {"fail_at": phase}})
    if stop and phase in ("release", "commit"):
        # past the commit point of a --stop group: the group stands, nothing is aborted
        with pytest.raises(GroupFailed):
            run(members, stop=True)
        assert len(groups_in_store()) == 1
        return
    with pytest.raises(GroupFailed, match="member 22 failed") as failed:
        run(members, stop=stop)
    assert failed.value.exit_code == ProcessNotFound.exit_code
    assert sorted(label for name, label in members.journal if name == "abort") == ["11", "22", "33"]
    assert groups_in_store() == []
    if phase in ("prepare", "capture"):
        assert not members.order("release"), "a member was let go though another had failed"


def test_a_member_that_does_not_answer_in_time_aborts_the_group():
    members = Members(**{"33": {"hang_at": "capture"}})
    with pytest.raises(GroupFailed, match="member 33 did not freeze and dump within 0.3 s"):
        run(members, phase_timeout=0.3)
    assert sorted(label for name, label in members.journal if name == "abort") == ["11", "22", "33"]
    assert not members.order("release")
    assert groups_in_store() == []


def test_members_on_other_hosts_need_a_factory_that_reaches_them():
    settings = env_settings()
    with pytest.raises(UsageError, match="host-a:42 is on another host"):
        group_dump(settings.store, GroupDumpRequest(members=["1", "host-a:42"]), settings=settings)


@pytest.mark.parametrize("text,member", [("42", ("", 42)), ("host-a:42", ("host-a", 42)),
                                         ("[::1]:42", ("[::1]", 42))])
def test_member_names(text, member):
    assert parse_member(text) == member


@pytest.mark.parametrize("text", ["x", ":42", "host:0", "host:", "-3"])
def test_bad_member_names(text):
    with pytest.raises(UsageError):
        parse_member(text)


def test_a_member_named_twice_is_refused():
    with pytest.raises(UsageError, match="named twice"):
        run(Members(), labels=("11", "11"))


def test_a_connection_to_another_member_comes_back_established_though_its_peer_is_gone():
    conn = TcpConnection(id=7, state=ESTABLISHED, local=("127.0.0.1", 40000), remote=("127.0.0.1", 5000))
    peer = (("127.0.0.1", 5000), ("127.0.0.1", 40000))
    alone, = tcppeers.decide([conn], another_host=False, close=None, sockets={}, addresses=set())
    in_group, = tcppeers.decide([conn], another_host=False, close=None, sockets={}, addresses=set(),
                                group_peers=[peer])
    assert (alone.restored, alone.why) == ("closed", "its peer on this host is gone")
    assert (in_group.restored, in_group.why) == ("established", "its peer is another member of the group, "
                                                                "restored with it")
    # --tcp-close still closes it
    closed, = tcppeers.decide([conn], another_host=False, close=True, sockets={}, addresses=set(),
                              group_peers=[peer])
    assert closed.restored == "closed"


class SlowStopGroup:
    """Two real target processes dumped --stop as a group through real DumpSessions and a fake
    CRIU: the second member's CRIU takes `slow` seconds more to reach post-dump."""

    def __init__(self, tmp_path, slow: float):
        from dataclasses import replace

        from tests.commands.fakes_dump import start_target

        self.settings = replace(env_settings(), page_stream=False)
        self.store = Store.open(tmp_path / "store", create=True, settings=self.settings)
        self.targets = [start_target(), start_target()]
        self.slow = {self.targets[0].pid: 0.0, self.targets[1].pid: slow}

    def member(self, spec):
        from dataclasses import replace

        from ckpt.commands.dump import DumpSession
        from ckpt.commands.group_member import LocalDumpMember, member_request
        from tests.commands.fakes_dump import FakeCriu

        request = replace(member_request(spec, False), dirty_tracking=False)
        target = next(t for t in self.targets if t.pid == spec.pid)
        criu = FakeCriu(target=target, stop_for=self.slow[spec.pid])
        return LocalDumpMember(DumpSession(self.store.root, request, store=self.store, criu=lambda _settings: criu,
                                           settings=self.settings), spec.label, spec.hold_limit)

    def dump(self, hold_limit: float, phase_timeout: float):
        return group_dump(self.store.root, GroupDumpRequest(members=[str(t.pid) for t in self.targets], name="g",
                                                            stop=True, hold_limit=hold_limit,
                                                            phase_timeout=phase_timeout),
                          settings=self.settings, member_factory=self.member)

    def assert_nothing_visible_and_every_tree_runs(self) -> None:
        from tests.commands.fakes_dump import alive

        # (a member that reached its hold committed its checkpoint there: unfinished, never shown,
        # removed by prune)
        assert self.store.groups.ids() == [] and self.store.manifests() == []
        assert [alive(t.pid) for t in self.targets] == [True, True]

    def end(self) -> None:
        from tests.commands.fakes_dump import end

        for target in self.targets:
            end(target)


def test_a_stop_group_whose_capture_times_out_thaws_every_tree_and_commits_nothing(tmp_path):
    """--stop, one member slower than the phase timeout: every member is aborted, and the one
    still working when the abort came is refused at its post-dump (it is not committed and
    ended): every tree runs on, no group, and no member checkpoint visible."""
    group = SlowStopGroup(tmp_path, slow=1.5)
    try:
        with pytest.raises(GroupFailed, match="within"):
            group.dump(hold_limit=30, phase_timeout=0.7)
        time.sleep(2.0)  # the slow member's CRIU reaches post-dump after the abort
        group.assert_nothing_visible_and_every_tree_runs()
        # the slow member, refused at its post-dump, did not commit
        assert [group.store.load(i).pid for i in group.store.checkpoint_ids()] == [group.targets[0].pid]
    finally:
        group.end()


def test_a_stop_group_is_not_committed_once_a_member_was_held_near_its_limit(tmp_path):
    """--stop, the first member held longer than most of its hold limit while the other is
    dumped: the group is not committed (the first member may let its tree go any moment, and
    would run on beside a committed group whose other members are ended): every tree runs on."""
    group = SlowStopGroup(tmp_path, slow=1.5)
    try:
        with pytest.raises(GroupFailed, match="hold limit"):
            group.dump(hold_limit=1.0, phase_timeout=10)
        group.assert_nothing_visible_and_every_tree_runs()
    finally:
        group.end()


def test_a_group_file_names_one_member_a_line_and_a_bad_one_is_named(tmp_path):
    from ckpt.commands.group import read_members_file

    members = tmp_path / "web.members"
    members.write_text("# the web group\n4242\n\nhost-b:5151   # the tool server\n")
    assert read_members_file(members) == ["4242", "host-b:5151"]
    members.write_text("4242\nhost-b:\n")
    with pytest.raises(UsageError, match="member 2"):
        read_members_file(members)
    members.write_text("# nobody\n")
    with pytest.raises(UsageError, match="names no member"):
        read_members_file(members)
    with pytest.raises(UsageError, match="cannot read the group file"):
        read_members_file(tmp_path / "missing")
