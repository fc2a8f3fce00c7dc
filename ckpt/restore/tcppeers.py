"""How each TCP connection of a checkpoint comes back: established again (TCP repair) or closed.

A connection restored established whose peer has given it up does not fail: the peer is in
CLOSE-WAIT (it saw the end of the killed original) or gone, the restored end retransmits
into it for a quarter of an hour, and the program waits on it, without an error. So on the host
that took the checkpoint each connection is decided on its own, just before CRIU runs:

- its peer is another socket of the checkpoint, or of another member of the group being
  restored with it (a group restore lets no member run before every member is back):
  established (both come back together);
- its peer is on this host (a loopback address or one of this host's): established only if
  a socket with the reverse address pair is there in the state that matches the one dumped
  (ESTABLISHED for ESTABLISHED...); in another state (CLOSE-WAIT, FIN-WAIT: the peer saw the
  connection end) or absent, closed: the program reads end of file or fails to write (EPIPE),
  and can reconnect;
- its peer is elsewhere: established, as before (whether a remote peer reset the connection
  since cannot be told without sending it a packet).

On another host every connection is closed (its peers have moved on, its local address is
another machine's); --tcp-close closes every one, --tcp-established restores every one.
decide() is a pure function of the connections and this host's sockets and addresses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt.criu.images import TcpConnection
from ckpt.system import inetdiag
from ckpt.system.inetdiag import CLOSE_WAIT, CLOSING, ESTABLISHED, FIN_WAIT1, FIN_WAIT2, LAST_ACK, STATES

# The state the dumped end was in -> the states its peer is in while the connection lives. A
# peer in another state has closed its end since (or the ends no longer agree).
LIVE_PEER_STATES = {
    ESTABLISHED: {ESTABLISHED},
    CLOSE_WAIT: {FIN_WAIT1, FIN_WAIT2},  # the peer had closed its end before the dump
    FIN_WAIT1: {ESTABLISHED, CLOSE_WAIT, FIN_WAIT1, CLOSING},  # ours was closed, maybe not yet seen
    FIN_WAIT2: {CLOSE_WAIT},
    LAST_ACK: {FIN_WAIT1, FIN_WAIT2},
    CLOSING: {CLOSING, FIN_WAIT1},
}

SocketTable = dict[tuple[inetdiag.Endpoint, inetdiag.Endpoint], set[int]]


@dataclass(frozen=True)
class ConnectionPlan:
    """One connection and how it comes back."""

    id: int  # its socket's id in the images' files.img
    local: str  # address:port ([address]:port for IPv6)
    remote: str
    state: str  # at the dump, as `ss` names it
    restored: str  # "established" or "closed"
    why: str

    def to_json(self) -> dict:
        return {"local": self.local, "remote": self.remote, "state": self.state, "restored": self.restored,
                "why": self.why}

    def describe(self, would: bool = False) -> str:
        comes = "would come" if would else "comes"
        return f"TCP connection {self.local} -> {self.remote} ({self.state}) {comes} back {self.restored}: {self.why}"


def _endpoint(address: tuple[str, int]) -> inetdiag.Endpoint:
    return inetdiag.normalized(ipaddress.ip_address(address[0])), address[1]


def _shown(address: tuple[str, int]) -> str:
    ip = inetdiag.normalized(ipaddress.ip_address(address[0]))
    return f"[{ip}]:{address[1]}" if ip.version == 6 else f"{ip}:{address[1]}"


Pair = tuple[tuple[str, int], tuple[str, int]]  # (local, remote) address and port


def decide(connections: list[TcpConnection], *, another_host: bool, close: bool | None,  # noqa: PLR0913
           sockets: SocketTable, addresses: set[inetdiag.Address], unchecked: str | None = None,
           group_peers: Sequence[Pair] = (), migrated: bool = False) -> list[ConnectionPlan]:
    """How each connection comes back (see the module's doc). close: --tcp-close (True),
    --tcp-established (False) or neither (None); sockets: this host's TCP sockets
    (inetdiag.tcp_sockets()); addresses: this host's (inetdiag.local_addresses()); unchecked:
    why this host's sockets could not be looked up (then no peer is judged gone); group_peers:
    the connections of the other members of a group restored with this tree; migrated: the tree
    was moved here by `ckpt migrate` (a connection comes back established where this host
    holds its local address: the address moved with the tree; closed otherwise)."""
    ours = {(_endpoint(c.local), _endpoint(c.remote)) for c in connections}
    in_group = {(_endpoint(local), _endpoint(remote)) for local, remote in group_peers}
    plans = []
    for conn in connections:
        local, remote = _endpoint(conn.local), _endpoint(conn.remote)
        if close is not None:
            restored, why = ("closed", "--tcp-close") if close else ("established", "--tcp-established")
        elif migrated:
            restored, why = _moved(conn.local, addresses)
        elif another_host:
            restored, why = "closed", "the checkpoint was taken on another host (--tcp-established keeps it)"
        elif (remote, local) in ours:
            restored, why = "established", "its peer is in the checkpoint too"
        elif (remote, local) in in_group:
            restored, why = "established", "its peer is another member of the group, restored with it"
        elif unchecked is not None:
            restored, why = "established", unchecked
        elif not inetdiag.is_local(remote[0], addresses):
            restored, why = "established", "its peer is on another host (not checked)"
        else:
            restored, why = _local_peer(conn.state, sockets.get((remote, local), set()))
        plans.append(ConnectionPlan(conn.id, _shown(conn.local), _shown(conn.remote),
                                    STATES.get(conn.state, str(conn.state)), restored, why))
    return plans


def _moved(local: tuple[str, int], addresses: set[inetdiag.Address]) -> tuple[str, str]:
    if inetdiag.is_local(_endpoint(local)[0], addresses):
        return "established", "its address moved with the tree (this host holds it)"
    return "closed", "its address stayed on the source host (give this host the address to keep it)"


def _local_peer(dumped: int, states: set[int]) -> tuple[str, str]:
    live = LIVE_PEER_STATES.get(dumped)
    if live is None:  # SYN-SENT: no peer socket to look for yet
        return "established", "its peer on this host is not checked in this state"
    if states & live:
        return "established", f"its peer on this host holds it ({STATES[min(states & live)]})"
    if not states:
        return "closed", "its peer on this host is gone"
    seen = ", ".join(STATES.get(s, str(s)) for s in sorted(states))
    return "closed", f"its peer on this host is in {seen}: it has seen the connection end"


def plan(connections: list[TcpConnection], another_host: bool, close: bool | None,
         group_peers: Sequence[Pair] = (), migrated: bool = False) -> list[ConnectionPlan]:
    """decide() against this host's sockets and addresses, looked up now (only where needed)."""
    if not connections:
        return []
    needed = close is None and not another_host
    try:
        sockets = inetdiag.tcp_sockets() if needed and not migrated else {}
        addresses = inetdiag.local_addresses() if needed or (migrated and close is None) else set()
    except OSError as exc:
        # sock_diag refused (a seccomp or LSM policy, no tcp_diag module): the connections come
        # back as a plain restore brings them, and each says why it was not checked.
        return decide(connections, another_host=another_host, close=close, sockets={}, addresses=set(),
                      unchecked=f"its peer could not be looked up here ({exc.strerror or exc})",
                      group_peers=group_peers, migrated=migrated)
    return decide(connections, another_host=another_host, close=close, sockets=sockets, addresses=addresses,
                  group_peers=group_peers, migrated=migrated)


def summary(plans: list[ConnectionPlan]) -> str | None:
    """"established", "closed", "mixed" (some of each), or None (no connections)."""
    kinds = {p.restored for p in plans}
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"
