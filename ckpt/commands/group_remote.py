"""Members of a group checkpoint on other hosts (docs/design.md, "Groups: the protocol"): a
RemoteMember is the coordinator's end of `ssh -T -o BatchMode=yes HOST ckpt _member`, whose far
end (ckpt/commands/member_agent.py) drives the member there. Each Member method is one request
and one answer over the channel, within the coordinator's phase timeout. No daemon, no port, no
secret of ckpt's own: the user's ssh configuration, keys and known_hosts reach the host, and an
encrypted store's password travels inside the channel (hello), never on a command line.

remote_member_factory gives a coordinator (ckpt/commands/group.py) its members: a RemoteMember
for HOST:PID (or, for a restore, a member recorded on another host), the coordinator's own
local member otherwise."""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import IO, Callable

from ckpt.commands.dump import DumpRequest
from ckpt.commands.group_member import (PROTOCOL_VERSION, Committed, Held, Member, MemberSpec, Prepared, Released,
                                        member_request)
from ckpt.commands.member_agent import request_to_wire, settings_for_members, store_identity
from ckpt.commands.restore import RestoreRequest
from ckpt.errors import CkptError, MemberLost, UsageError, from_record
from ckpt.reporting import NullReporter, Reporter
from ckpt.settings import Settings, StoreLocation
from ckpt.store import Store
from ckpt.store.password import PasswordSource

# What ckpt adds to the user's ssh command (options the user gives in CKPT_SSH come first, and
# ssh takes the first value of an option): no terminal (stdin and stdout carry the protocol), no
# prompt (a password prompt would wait forever), and a dead connection noticed within 15 s.
SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
# Seconds an aborted agent has to end (it lets its tree go first) before its ssh is killed.
ABORT_WAIT = 5.0
# Seconds a channel that ended has to tell why (ssh's exit code and last words on stderr).
LAST_WORDS_WAIT = 2.0
STDERR_KEPT = 20  # lines of the channel's stderr kept for the error of a lost member
# Storing a large tree's memory takes longer than a freeze: commit may take this many phase
# timeouts (as the coordinator allows its members: ckpt/commands/group.py).
COMMIT_SLACK = 10.0


@dataclass(frozen=True)
class RemoteLink:
    """How a coordinator reaches its members on other hosts, and what it tells their agents."""

    ssh: tuple[str, ...]  # the ssh client and the user's options (CKPT_SSH)
    remote_ckpt: tuple[str, ...]  # ckpt on the member's host (CKPT_REMOTE_CKPT)
    store: str  # the store's location, which every member host must reach (an s3:// URL)
    password: str | None = field(default=None, repr=False)  # the encrypted store's, or None
    settings: dict = field(default_factory=dict)  # member_agent.PASSED_SETTINGS
    timeout: float = 120.0  # seconds a member has to answer one request (the phase timeout)
    hold_limit: float = 60.0  # seconds a member holds its tree at most, whatever happens
    store_identity: str | None = None  # member_agent.store_identity: the agent checks it is the same store

    @classmethod
    def of(cls, settings: Settings, store: str, password: str | None = None, timeout: float = 120.0,
           hold_limit: float = 60.0, store_identity: str | None = None) -> RemoteLink:
        return cls(tuple(shlex.split(settings.ssh)), tuple(shlex.split(settings.remote_ckpt)), str(store),
                   password, settings_for_members(settings), timeout, hold_limit, store_identity)

    @classmethod
    def for_store(cls, store: Store, settings: Settings, passwords: PasswordSource, timeout: float = 120.0,
                  hold_limit: float = 60.0) -> RemoteLink:
        """The link of a coordinator that opened store: its location, its password (encrypted),
        its identity (so that a host with another store of that name is refused)."""
        return cls.of(settings, store.location, members_password(store, passwords), timeout, hold_limit,
                      store_identity(store))

    def command(self, host: str) -> list[str]:
        """The ssh command line that starts the member agent on host."""
        check_host(host)
        # ssh hands the remote command to the host's shell as one string: each word quoted.
        remote = " ".join(shlex.quote(word) for word in (*self.remote_ckpt, "_member"))
        return [*self.ssh, *SSH_OPTIONS, host, remote]


def members_password(store: Store, passwords: PasswordSource) -> str | None:
    """The password the coordinator opened an encrypted store with, for the members' hello
    (None for a plain store). Asks the passwords' source again: a source with a prompt should
    remember what was typed."""
    from ckpt.store.opening import find_encryption

    if not store.remote and find_encryption(store.backend) is None:
        return None
    return passwords.password_for(store.location).decode()


def check_host(host: str) -> None:
    if not host or host.startswith("-") or any(c.isspace() for c in host):
        raise UsageError(f"{host!r} is not a host name", hint="name a host as ssh knows it: host-a or user@host-a")


class RemoteMember:
    """A member on another host, driven over ssh (see the module's docstring). Any failure of
    the far end arrives as the typed error the agent reported, with the host's name in front;
    a channel that ends or stays silent past the phase timeout is MemberLost. Either way the
    agent has let its tree go, or will once it reads end of file; abort() is always safe."""

    def __init__(self, host: str, request: DumpRequest | RestoreRequest, link: RemoteLink,
                 reporter: Reporter = NullReporter(), label: str | None = None):
        check_host(host)
        self.host, self.request, self.link, self.reporter = host, request, link, reporter
        self.kind = "dump" if isinstance(request, DumpRequest) else "restore"
        what = request.pid if isinstance(request, DumpRequest) else request.ref
        self.label = label or f"{host}:{what}"
        self.hostname = ""  # the host's own name, from hello
        self.process: subprocess.Popen | None = None
        self._answers: queue.Queue[bytes | None] = queue.Queue()
        self._stderr: deque[str] = deque(maxlen=STDERR_KEPT)
        self._readers: list[threading.Thread] = []

    # ---- the phases -----------------------------------------------------------------------

    def connect(self) -> None:
        """Starts ssh and the agent and says hello (the store, its password, the settings):
        once, before prepare, or by prepare."""
        if self.process is not None:
            return
        self._start()
        hello = self._ask({"op": "hello", "version": PROTOCOL_VERSION, "store": self.link.store,
                           "store_identity": self.link.store_identity, "password": self.link.password,
                           "settings": self.link.settings})
        self.hostname = str(hello.get("hostname", ""))

    def prepare(self, extra: dict | None = None) -> Prepared:
        """Connects unless connected, then prepares (extra: more of the prepare request, such
        as a migration's {"migration": true})."""
        self.connect()
        answer = self._ask({"op": "prepare", "kind": self.kind, "request": request_to_wire(self.request),
                            "hold_limit": self.link.hold_limit, **(extra or {})})
        return Prepared.from_json(answer)

    def capture(self) -> Held:
        return Held.from_json(self._ask({"op": "capture"}))

    def release(self) -> Released:
        return Released.from_json(self._ask({"op": "release"}))

    def commit(self) -> Committed:
        committed = Committed.from_json(self._ask({"op": "commit"}, slack=COMMIT_SLACK))
        self._close(wait=ABORT_WAIT)  # the agent is done and ends
        return committed

    def abort(self) -> None:
        """Tells the agent to abort, closes its stdin (end of file is abort too), and kills ssh
        if it has not ended within ABORT_WAIT seconds (the agent then reads end of file)."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            try:
                self._send({"op": "abort"})
            except MemberLost:
                pass  # gone already: it aborted on its own
        self._close(wait=ABORT_WAIT)

    # ---- the channel ----------------------------------------------------------------------

    def _start(self) -> None:
        command = self.link.command(self.host)
        try:
            # A session of its own: a Ctrl-C meant for the coordinator must not end ssh before
            # the coordinator has aborted its members.
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise MemberLost(f"{self.host}: cannot run {command[0]}: {exc.strerror}",
                             hint="install OpenSSH's client, or set CKPT_SSH to the ssh command") from None
        out, err = self.process.stdout, self.process.stderr  # pipes: never None here
        self._readers = [threading.Thread(target=self._read_answers, args=(out,), daemon=True,
                                          name=f"ckpt-member-{self.host}-out"),
                         threading.Thread(target=self._read_stderr, args=(err,), daemon=True,
                                          name=f"ckpt-member-{self.host}-err")]
        for reader in self._readers:
            reader.start()

    def _read_answers(self, stream: IO[bytes]) -> None:
        try:
            for line in stream:
                self._answers.put(line)
        except (OSError, ValueError):
            pass
        finally:
            self._answers.put(None)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        """Keeps the last lines (for MemberLost) and relays the agent's messages, each after the
        member's label as the coordinator's own members' are ("[host-b:4242] ...")."""
        prefix = f"[{self.label}] "
        try:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip()
                if not line:
                    continue
                self._stderr.append(line)
                kind, _, message = line.partition(": ")
                if kind == "warn":
                    self.reporter.warn(prefix + message)
                else:
                    self.reporter.info(prefix + (message if kind in ("step", "info") else line))
        except (OSError, ValueError):
            pass

    def _send(self, message: dict) -> None:
        process = self.process
        if process is None or process.stdin is None:
            raise RuntimeError("a request before prepare")  # a coordinator's bug, not the user's
        try:
            process.stdin.write(json.dumps(message).encode() + b"\n")
            process.stdin.flush()
        except (OSError, ValueError):
            raise self._lost(str(message.get("op"))) from None

    def _ask(self, message: dict, slack: float = 1.0) -> dict:
        """One request and its answer (within slack phase timeouts); the agent's error as its
        typed error, or MemberLost."""
        op, timeout = str(message["op"]), self.link.timeout * slack
        self._send(message)
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise MemberLost(f"{self.host}: no answer to {op} within {timeout:g} s",
                             hint="every member was aborted; a slow host may need a longer --timeout") from None
        if line is None:
            raise self._lost(op)
        try:
            answer = json.loads(line)
        except ValueError:
            raise MemberLost(f"{self.host}: answered {op} with {line[:80]!r}, not the protocol's JSON",
                             hint="CKPT_REMOTE_CKPT must name ckpt on that host, and its shell's startup "
                                  "files must print nothing") from None
        if not isinstance(answer, dict) or not answer.get("ok"):
            raise self._failure(answer if isinstance(answer, dict) else {})
        return answer

    def _failure(self, answer: dict) -> CkptError:
        record = dict(answer)
        record["message"] = f"{self.host}: {answer.get('message') or answer.get('error') or 'failed'}"
        return from_record(record)

    def _lost(self, op: str) -> MemberLost:
        """The channel ended: ssh's exit code and its (or the agent's) last line, waited for briefly."""
        process = self.process
        code = None
        if process is not None:
            try:
                code = process.wait(LAST_WORDS_WAIT)
            except subprocess.TimeoutExpired:
                pass
        for reader in self._readers[1:]:
            reader.join(LAST_WORDS_WAIT)
        said = f": {self._stderr[-1]}" if self._stderr else ""
        ended = f"ssh exited with {code}" if code is not None else "the channel closed"
        return MemberLost(f"{self.host}: the member's channel ended during {op} ({ended}){said}",
                          hint=f"check that '{' '.join(self.link.command(self.host))}' works; every member "
                               "was aborted")

    def _close(self, wait: float) -> None:
        """Closes the agent's stdin, waits for ssh to end, kills it past `wait` seconds."""
        process = self.process
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            self.reporter.warn(f"{self.host}: ssh did not end within {wait:g} s of the abort; killed")
            process.kill()
            process.wait()
        for reader in self._readers:
            reader.join(LAST_WORDS_WAIT)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


# ---- which member a coordinator gets for each name -------------------------------------------

MemberFactory = Callable[[MemberSpec], Member]


def remote_member_factory(local: MemberFactory, link: RemoteLink, reporter: Reporter = NullReporter(), *,
                          restore: bool = False) -> MemberFactory:
    """The coordinator's member_factory (ckpt/commands/group.py): a member of another host
    (MemberSpec.host: for a restore, where the coordinator placed it, --on included) is a
    RemoteMember, one of this host local(spec)."""
    def make(spec: MemberSpec) -> Member:
        if not spec.host:
            return local(spec)
        return RemoteMember(spec.host, member_request(spec, restore), replace(link, hold_limit=spec.hold_limit),
                            reporter, label=spec.label)
    return make


def members_anywhere(store_root: StoreLocation, reporter: Reporter, *, settings: Settings,
                     passwords: PasswordSource | None, restore: bool = False, timeout: float = 120.0
                     ) -> MemberFactory:
    """The member_factory of `ckpt dump --group` and `ckpt restore GROUP`: this host's members
    as the coordinator makes them (group.local_member_factory), the others' over ssh. The link
    (the store opened for its location, password and identity) is made at the first member on
    another host: a group of this host's trees never asks for a password twice."""
    from ckpt.commands.group import local_member_factory

    passwords = PasswordSource.passed_or_settings(passwords, settings)
    local = local_member_factory(store_root, reporter, settings=settings, passwords=passwords, restore=restore)
    links: list[RemoteLink] = []

    def far(spec: MemberSpec) -> Member:
        if not links:
            store = Store.open(store_root, False, settings=settings, passwords=passwords)
            links.append(RemoteLink.for_store(store, settings, passwords, timeout=timeout))
        return remote_member_factory(local, links[0], reporter, restore=restore)(spec)

    def make(spec: MemberSpec) -> Member:
        return far(spec) if spec.host else local(spec)
    return make


def parse_on(values: list[str]) -> dict[str, str]:
    """--on FROM=TO, given once per host: {recorded host: host to restore on} ("" = here)."""
    moves: dict[str, str] = {}
    for value in values:
        source, sep, target = value.partition("=")
        if not sep or not source:
            raise UsageError(f"--on {value!r} is not FROM=TO", hint="e.g. --on host-a=host-c (host-a= restores here)")
        check_host(source)
        if target:
            check_host(target)
        moves[source] = target
    return moves
