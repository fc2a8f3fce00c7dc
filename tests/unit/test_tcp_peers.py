"""ckpt/restore/tcppeers.py: how each TCP connection comes back, a pure function of the
connections and this host's sockets and addresses."""

import ipaddress

import pytest

from ckpt.criu.images import TcpConnection
from ckpt.restore.tcppeers import decide, summary
from ckpt.system.inetdiag import CLOSE_WAIT, ESTABLISHED, FIN_WAIT2, TIME_WAIT, normalized

IP = ipaddress.ip_address
HERE = {IP("192.0.2.2")}
CLIENT = TcpConnection(1, ESTABLISHED, ("127.0.0.1", 40000), ("127.0.0.1", 8080))
PEER = ((IP("127.0.0.1"), 8080), (IP("127.0.0.1"), 40000))  # the reverse pair: the peer's end


@pytest.mark.parametrize(("connection", "peer_states", "restored", "why"), [
    (CLIENT, {ESTABLISHED}, "established", "its peer on this host holds it (ESTABLISHED)"),
    (CLIENT, {CLOSE_WAIT}, "closed", "its peer on this host is in CLOSE-WAIT: it has seen the connection end"),
    (CLIENT, set(), "closed", "its peer on this host is gone"),
    (CLIENT, {TIME_WAIT, ESTABLISHED}, "established", "its peer on this host holds it (ESTABLISHED)"),
    # the peer had closed its end before the dump: its FIN-WAIT-2 is the live match
    (TcpConnection(1, CLOSE_WAIT, ("127.0.0.1", 40000), ("127.0.0.1", 8080)), {FIN_WAIT2}, "established",
     "its peer on this host holds it (FIN-WAIT-2)"),
    # one of this host's addresses, and an IPv4-mapped one, are on this host too
    (TcpConnection(1, ESTABLISHED, ("192.0.2.2", 40000), ("192.0.2.2", 8080)), set(), "closed",
     "its peer on this host is gone"),
    (TcpConnection(1, ESTABLISHED, ("::ffff:127.0.0.1", 40000), ("::ffff:127.0.0.1", 8080)), {ESTABLISHED},
     "established", "its peer on this host holds it (ESTABLISHED)"),
    (TcpConnection(1, ESTABLISHED, ("192.0.2.2", 40000), ("198.51.100.7", 443)), set(), "established",
     "its peer is on another host (not checked)"),
])
def test_a_connection_on_the_host_that_took_it(connection, peer_states, restored, why):
    # as inetdiag.tcp_sockets() lists them: IPv4-mapped addresses as IPv4
    local, remote = ((normalized(IP(a)), port) for a, port in (connection.local, connection.remote))
    sockets = {(remote, local): peer_states} if peer_states else {}
    [plan] = decide([connection], another_host=False, close=None, sockets=sockets, addresses=HERE)
    assert (plan.restored, plan.why) == (restored, why)


def test_both_ends_in_the_checkpoint_come_back_together():
    server_end = TcpConnection(2, ESTABLISHED, ("127.0.0.1", 8080), ("127.0.0.1", 40000))
    plans = decide([CLIENT, server_end], another_host=False, close=None, sockets={}, addresses=HERE)
    assert [p.restored for p in plans] == ["established", "established"]
    assert plans[0].why == "its peer is in the checkpoint too"


@pytest.mark.parametrize(("another_host", "close", "restored"), [
    (True, None, "closed"), (True, False, "established"), (False, True, "closed"), (False, False, "established")])
def test_the_flags_and_another_host_decide_for_every_connection(another_host, close, restored):
    sockets = {PEER: {CLOSE_WAIT}}
    plans = decide([CLIENT], another_host=another_host, close=close, sockets=sockets, addresses=HERE)
    assert [p.restored for p in plans] == [restored]


def test_summary():
    alive = decide([CLIENT], another_host=False, close=None, sockets={PEER: {ESTABLISHED}}, addresses=HERE)
    dead = decide([CLIENT], another_host=False, close=None, sockets={}, addresses=HERE)
    assert [summary([]), summary(alive), summary(dead), summary(alive + dead)] == \
        [None, "established", "closed", "mixed"]
    assert dead[0].to_json() == {"local": "127.0.0.1:40000", "remote": "127.0.0.1:8080", "state": "ESTABLISHED",
                                 "restored": "closed", "why": "its peer on this host is gone"}


def test_a_host_whose_sockets_cannot_be_looked_up_restores_as_before(monkeypatch):
    """sock_diag refused (seccomp, an LSM, no tcp_diag): no traceback, no peer judged gone; each
    connection says why it was not checked (second read of 8d1f686)."""
    from ckpt.restore import tcppeers
    from ckpt.system import inetdiag

    def refused():
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(inetdiag, "tcp_sockets", refused)
    (plan,) = tcppeers.plan([CLIENT], another_host=False, close=None)
    assert plan.restored == "established"
    assert plan.why == "its peer could not be looked up here (Operation not permitted)"
