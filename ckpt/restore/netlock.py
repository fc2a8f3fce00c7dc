"""The TCP connections between the members of a group, kept quiet while the group is restored.

CRIU's restore of a tree in the host's network namespace locks no connection itself: it counts
on the lock its dump left (CRIU's nftables table `CRIU-<uuid>`, left by a --stop dump until
the restore lifts it; a dump that let the tree run lifted it at its end). Within one tree that
does not matter, but between members restored one beside the other it does: a member's CRIU
sends a connection's not-yet-sent bytes with TCP repair off (soccr's "not-sent send queue"),
and when the peer member's socket is not back yet, the peer's kernel answers with a reset
(nobody there, or the peer's restored listening socket): CRIU then fails with EPIPE ("Can't
restore not-sent send queue data") or the connection comes back reset. Seen here with two
members streaming to each other, dumped without --stop.

So a group restore drops the packets of every connection between its members, both ways, in
a table of its own (`inet ckpt-group-<id>`, the same match as CRIU's), from before the first
member's restore until every member is back and held (its sockets exist, still in repair
mode, so nothing is sent), and lifts it before any member runs. A dropped segment is sent
again by TCP; nothing is lost.

The table outlives no owner: its name carries the owner's PID, and a detached watchdog (a
shell loop, one `kill -0` and one `nft list table` a second) removes it once the owner is gone
and the table is still there (a `kill -9` of the restore: seen to leave it for good before).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ckpt.reporting import Reporter

Pair = tuple[tuple[str, int], tuple[str, int]]  # (local, remote) address and port
NFT_TIMEOUT = 10.0


def table_name(group_id: str, owner: int) -> str:
    """The owner's PID in the name: a watchdog never removes a later restore's table."""
    return f"ckpt-group-{group_id.replace('-', '')[-16:]}-{owner}"


WATCHDOG = ("while kill -0 {owner} 2>/dev/null && nft list table inet {table} >/dev/null 2>&1; do sleep 1; done; "
            "kill -0 {owner} 2>/dev/null || nft delete table inet {table} 2>/dev/null")


def _watch(table: str, owner: int) -> None:
    """Removes the table once its owner is gone (started detached; ends by itself once the
    owner lifted the table)."""
    subprocess.Popen(["sh", "-c", WATCHDOG.format(owner=owner, table=table)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def ruleset(table: str, pairs: Sequence[Pair]) -> str:
    """The nftables script: the table made anew (a leftover of a killed restore replaced), with
    both directions of every pair dropped on input and output."""
    elements: dict[int, set[str]] = {4: set(), 6: set()}
    for local, remote in pairs:
        for src, dst in ((local, remote), (remote, local)):
            version = ipaddress.ip_address(src[0]).version
            elements[version].add(f"{src[0]} . {src[1]} . {dst[0]} . {dst[1]}")
    lines = [f"table inet {table}", f"delete table inet {table}", f"table inet {table} {{"]
    for version, kind in ((4, "ipv4_addr"), (6, "ipv6_addr")):
        lines.append(f"  set conns{version} {{ type {kind} . inet_service . {kind} . inet_service;")
        if elements[version]:
            lines.append(f"    elements = {{ {', '.join(sorted(elements[version]))} }}")
        lines.append("  }")
    for chain, hook in (("output", "output"), ("input", "input")):
        lines.append(f"  chain {chain} {{ type filter hook {hook} priority filter; policy accept;")
        lines.append("    ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop")
        lines.append("    ip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True, check=True,
                   timeout=NFT_TIMEOUT)


class ConnectionLock:
    """The lock of one group restore: lock() before the members are restored, lift() once
    every one is held (and on any failure)."""

    def __init__(self, group_id: str, pairs: Sequence[Pair], reporter: Reporter):
        self.table, self.pairs, self.reporter = table_name(group_id, os.getpid()), list(pairs), reporter
        self.locked = False

    def lock(self) -> None:
        if not self.pairs:
            return
        if shutil.which("nft") is None:
            self.reporter.warn("nft is not installed: the connections between members are not locked while "
                               "they are restored (one may come back reset)")
            return
        try:
            _nft(ruleset(self.table, self.pairs))
        except (OSError, subprocess.SubprocessError) as exc:
            self.reporter.warn(f"the connections between members could not be locked ({_why(exc)}): one may "
                               "come back reset")
            return
        self.locked = True
        try:
            _watch(self.table, os.getpid())
        except OSError as exc:
            self.reporter.warn(f"no watchdog for nftables table inet {self.table} ({exc.strerror}): if this "
                               f"restore is killed, remove it with 'nft delete table inet {self.table}'")

    def lift(self) -> None:
        if not self.locked:
            return
        self.locked = False
        try:
            _nft(f"delete table inet {self.table}\n")
        except (OSError, subprocess.SubprocessError) as exc:
            self.reporter.warn(f"nftables table inet {self.table} could not be removed ({_why(exc)}): "
                               f"remove it with 'nft delete table inet {self.table}'")


@contextmanager
def locked_connections(group_id: str, pairs: Sequence[Pair], reporter: Reporter) -> Iterator[ConnectionLock]:
    """The lock for a `with` block: lifted at its end whatever happens (lift() may come earlier)."""
    lock = ConnectionLock(group_id, pairs, reporter)
    lock.lock()
    try:
        yield lock
    finally:
        lock.lift()


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return (exc.stderr or "").strip().splitlines()[-1] if exc.stderr else f"exit {exc.returncode}"
    return str(exc)
