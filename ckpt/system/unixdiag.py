"""The peers of connected UNIX sockets, from the kernel's sock_diag netlink interface.

/proc lists a socket's inode but not the inode of the socket it is connected to; the kernel
says it through NETLINK_SOCK_DIAG (as `ss -x` asks it). See sock_diag(7).
"""

from __future__ import annotations

import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER = 0x1, 0x4
UNIX_DIAG_NAME, UNIX_DIAG_PEER = 0, 2
STREAM_TYPES = (socket.SOCK_STREAM, socket.SOCK_SEQPACKET)

NLMSG = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
REQUEST = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie[2]
DIAG_MSG = struct.Struct("=BBBBIII")  # family, type, state, pad, ino, cookie[2]
RTATTR = struct.Struct("=HH")  # length, type


def stream_peers() -> dict[int, int]:
    """Inode of every connected UNIX stream (or seqpacket) socket -> inode of its peer."""
    return _peers(STREAM_TYPES)[0]


def datagram_peers() -> tuple[dict[int, int], dict[int, str]]:
    """Inode of every connected UNIX datagram socket -> inode of the socket it sends to; and
    the path each bound socket has (an abstract name starts with "@", as `ss` shows it)."""
    return _peers((socket.SOCK_DGRAM,))


def _peers(types: tuple[int, ...]) -> tuple[dict[int, int], dict[int, str]]:
    """One sock_diag dump: the peers of the connected sockets of those types, and the name of
    every bound socket."""
    request = REQUEST.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_PEER | UDIAG_SHOW_NAME,
                           0xFFFFFFFF, 0xFFFFFFFF)
    message = NLMSG.pack(NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + request
    peers: dict[int, int] = {}
    names: dict[int, str] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as nl:
        nl.sendto(message, (0, 0))
        while True:
            data = nl.recv(1 << 16)
            offset = 0
            while offset + NLMSG.size <= len(data):
                length, kind, _, _, _ = NLMSG.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return peers, names
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + NLMSG.size)
                    raise OSError(-errno, os.strerror(-errno))
                _parse(data[offset + NLMSG.size:offset + length], types, peers, names)
                offset += (length + 3) & ~3
            if not data:
                return peers, names


def _parse(body: bytes, types: tuple[int, ...], peers: dict[int, int], names: dict[int, str]) -> None:
    _, kind, _, _, inode, _, _ = DIAG_MSG.unpack_from(body)
    offset = DIAG_MSG.size
    while offset + RTATTR.size <= len(body):
        length, attr = RTATTR.unpack_from(body, offset)
        if length < RTATTR.size:
            return
        if attr == UNIX_DIAG_PEER and kind in types:
            (peer,) = struct.unpack_from("=I", body, offset + RTATTR.size)
            if peer:
                peers[inode] = peer
        elif attr == UNIX_DIAG_NAME and length > RTATTR.size:
            name = body[offset + RTATTR.size:offset + length]
            names[inode] = ("@" + name[1:].decode(errors="replace") if name[:1] == b"\0"
                            else name.rstrip(b"\0").decode(errors="replace"))
        offset += (length + 3) & ~3
