"""This host's TCP sockets, from the kernel's sock_diag netlink interface (as `ss -t` asks it),
and whether an address is one of this host's. See sock_diag(7).

A restore asks it whether the peer of a dumped connection, when on this host, still holds
its end (ckpt/restore/tcppeers.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

from ckpt.system.unixdiag import NETLINK_SOCK_DIAG, NLM_F_DUMP, NLM_F_REQUEST, NLMSG, NLMSG_DONE, NLMSG_ERROR, \
    SOCK_DIAG_BY_FAMILY

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[Address, int]

# The kernel's TCP states (include/net/tcp_states.h), as ss names them.
STATES = {1: "ESTABLISHED", 2: "SYN-SENT", 3: "SYN-RECV", 4: "FIN-WAIT-1", 5: "FIN-WAIT-2", 6: "TIME-WAIT",
          7: "CLOSE", 8: "CLOSE-WAIT", 9: "LAST-ACK", 10: "LISTEN", 11: "CLOSING"}
ESTABLISHED, FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING = 1, 4, 5, 6, 7, 8, 9, 11

REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states; then a sockid
SOCKID = struct.Struct("!HH16s16s")  # sport, dport, src, dst (network order); then ifindex, cookie[2]
MESSAGE = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans; then its sockid


def normalized(address: Address) -> Address:
    """An IPv4-mapped IPv6 address (an AF_INET6 socket talking IPv4) as the IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def tcp_sockets() -> dict[tuple[Endpoint, Endpoint], set[int]]:
    """Every TCP socket of this network namespace, IPv4 and IPv6, in any state: (local, remote)
    -> the states (STATES) of the sockets with that pair (a TIME-WAIT may share it with a new
    one), addresses normalized. One sock_diag dump per family."""
    found: dict[tuple[Endpoint, Endpoint], set[int]] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        _dump(family, found)
    return found


def _dump(family: int, found: dict[tuple[Endpoint, Endpoint], set[int]]) -> None:
    request = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + bytes(48)
    message = NLMSG.pack(NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + request
    size = 4 if family == socket.AF_INET else 16
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(5.0)  # the kernel answers at once; a bound all the same
        nl.sendto(message, (0, 0))
        while True:
            data = nl.recv(1 << 16)
            if not data:
                return
            offset = 0
            while offset + NLMSG.size <= len(data):
                length, kind, _, _, _ = NLMSG.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + NLMSG.size)
                    if -errno == 2 and family == socket.AF_INET6:  # ENOENT: no IPv6 in this kernel
                        return
                    raise OSError(-errno, os.strerror(-errno))
                body = offset + NLMSG.size
                _, state, _, _ = MESSAGE.unpack_from(data, body)
                sport, dport, src, dst = SOCKID.unpack_from(data, body + MESSAGE.size)
                local = (normalized(ipaddress.ip_address(src[:size])), sport)
                remote = (normalized(ipaddress.ip_address(dst[:size])), dport)
                found.setdefault((local, remote), set()).add(state)
                offset += (length + 3) & ~3


def local_addresses() -> set[Address]:
    """The addresses of this host (its network namespace): IPv4 from the kernel's local routing
    table (/proc/net/fib_trie: the host routes of type LOCAL), IPv6 from /proc/net/if_inet6."""
    found: set[Address] = set()
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        lines = []
    for previous, line in zip(lines, lines[1:], strict=False):
        # "   |-- 10.0.2.15" then "      /32 host LOCAL"
        if line.strip().endswith("host LOCAL") and "|--" in previous:
            found.add(ipaddress.ip_address(previous.split("|--")[1].strip()))
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    except (OSError, IndexError, ValueError):
        pass
    return found


def is_local(address: Address, addresses: set[Address]) -> bool:
    """Whether a peer at that address is on this host: a loopback address, or one of addresses
    (local_addresses()), or the unspecified address (a connection to 0.0.0.0 reaches this host)."""
    address = normalized(address)
    return address.is_loopback or address.is_unspecified or address in addresses
