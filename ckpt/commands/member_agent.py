"""The member agent: `ckpt _member`, the far end of the ssh channel through which a group
checkpoint's coordinator drives a member on another host (ckpt/commands/group_remote.py is the
near end). It reads one JSON request per line on its stdin and answers each with one JSON
object per line on its stdout, nothing else (its messages go to stderr), following the
protocol of docs/design.md, "Groups: the protocol": hello, prepare, capture, release, commit,
abort. It drives the same local member that a coordinator drives on its own host.

End of file on stdin is `abort`, whenever it comes: the ssh channel is gone or the coordinator
died, and nobody will ever release a held tree or commit it. A reader thread notices it at
once, also while a phase runs (the phase is then cut short, as an interrupted coordinator's
would be), and a held tree is let go (CRIU thaws a dumped one, ends a restored one)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import IO, Any, Callable

from ckpt.commands.dump import DumpRequest, DumpSession
from ckpt.commands.group_member import (PROTOCOL_VERSION, Committed, Held, LocalDumpMember, LocalRestoreMember, Member,
                                        Prepared, Released)
from ckpt.commands.restore import RestoreRequest, RestoreSession
from ckpt.errors import CkptError, ExitCode, StoreError, UsageError, to_record
from ckpt.reporting import Reporter
from ckpt.restore.netlock import ConnectionLock
from ckpt.settings import Settings, store_from_flag
from ckpt.store import Origin, Store

# The settings a coordinator passes to its members' agents: how long to wait and how much to
# log, which are the user's choice for the whole group. Where things are on a host (its cache,
# CRIU, tracking records) and its S3 credentials are the member host's own.
PASSED_SETTINGS = ("lock_timeout", "lock_ttl", "s3_timeout", "hook_timeout", "section_timeout",
                   "criu_log_level", "lazy_min_mib", "page_stream")
# Requests an agent takes at most: hello, prepare, capture, release, commit (or abort).
MAX_REQUESTS = 8
# Seconds an agent waits for its next request before it aborts on its own (a held tree is let
# go sooner: after the coordinator's hold limit).
IDLE_LIMIT = 900.0
KINDS = ("dump", "restore")


# ---- the requests on the wire ---------------------------------------------------------------

def request_to_wire(request: DumpRequest | RestoreRequest) -> dict:
    """A DumpRequest or RestoreRequest as plain JSON (prepare's `request`)."""
    data = asdict(request)
    if isinstance(request, DumpRequest):
        data["origin"] = request.origin.to_json()
    return data


def request_from_wire(kind: str, data: object) -> DumpRequest | RestoreRequest:
    """prepare's `request`, checked: fields a newer coordinator sends are ignored."""
    if kind not in KINDS:
        raise UsageError(f"a member is a dump or a restore, not {kind!r}")
    if not isinstance(data, dict):
        raise UsageError("prepare carries no request")
    cls: Any = DumpRequest if kind == "dump" else RestoreRequest
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in data.items() if k in known}
    if kind == "dump":
        values["origin"] = Origin.from_json(values.get("origin")) or Origin("dump")
    try:
        return cls(**values)
    except TypeError as exc:
        raise UsageError(f"a {kind} request without what it needs ({exc})") from None


def settings_from_hello(base: Settings, hello: dict) -> Settings:
    """The agent's settings: its host's own, with the store, the password and PASSED_SETTINGS
    of the coordinator (each checked as its CKPT_* variable would be)."""
    if not isinstance(hello.get("store"), str):
        raise UsageError("hello names no store")
    passed: dict[str, Any] = {"store": store_from_flag(hello["store"])}
    password = hello.get("password")
    if isinstance(password, str) and password:
        passed.update(password=password, password_file=None)
    sent = hello.get("settings")
    sent = sent if isinstance(sent, dict) else {}
    for f in fields(Settings):
        if f.name in PASSED_SETTINGS and sent.get(f.name) is not None:
            passed[f.name] = f.metadata["parse"](f.metadata["env"], str(sent[f.name]))
    return replace(base, **passed)


def store_identity(store: Store) -> str:
    """What tells one store from another of the same location on another host (the default
    /var/lib/ckpt of every host): a digest of the seed of its page ids, made at random with it."""
    return hashlib.sha256(b"ckpt store " + store.blocks.seed.to_bytes(8, "little")).hexdigest()[:32]


def open_members_store(settings: Settings, identity: object) -> Store:
    """The store hello names, opened (never created: a member writes into the coordinator's
    store or nowhere) and checked to be the coordinator's when it sent its identity."""
    store = Store.open(settings.store, create=False, settings=settings)
    if isinstance(identity, str) and identity and store_identity(store) != identity:
        raise StoreError(f"the store at {store.location} on {socket.gethostname()} is another store than the "
                         "coordinator's of that name",
                         hint="every host of a group must reach the same store: an S3 store, or a directory "
                              "shared at the same path")
    return store


def settings_for_members(settings: Settings) -> dict:
    """What hello passes of the coordinator's settings (settings_from_hello takes it)."""
    return {name: getattr(settings, name) for name in PASSED_SETTINGS}


# ---- the local member an agent drives -------------------------------------------------------

MemberMaker = Callable[[DumpRequest | RestoreRequest, Store, Reporter, float], Member]


def session_member(request: DumpRequest | RestoreRequest, store: Store, reporter: Reporter,
                   hold_limit: float) -> Member:
    """The local member of a request, on the store hello named (the agent's default): the
    same member a coordinator drives on its own host."""
    settings = store.settings
    if isinstance(request, DumpRequest):
        dump = DumpSession(store.location, request, reporter, settings=settings, store=store)
        return LocalDumpMember(dump, str(request.pid), hold_limit)
    restore = RestoreSession(store.location, request, reporter, settings=settings, store=store)
    return HostLockedRestore(LocalRestoreMember(restore, request.ref, hold_limit), request.group_peers, reporter)


class HostLockedRestore:
    """A restore member whose TCP connections to the group's other members are locked on this
    host (ckpt/restore/netlock.py) from its prepare, before any member is restored, to its
    release: the coordinator locks those of its own host's members only, and a member restored
    here beside a peer not back yet would otherwise send into it and be reset. One end of a
    connection locked is enough: its table drops the connection's packets both ways."""

    def __init__(self, member: LocalRestoreMember, group_peers: list, reporter: Reporter):
        self.member, self.label, self.reporter = member, member.label, reporter
        self.peers = {(tuple(local), tuple(remote)) for local, remote in group_peers}
        self.lock: ConnectionLock | None = None

    def prepare(self) -> Prepared:
        prepared = self.member.prepare()
        manifest = self.member.session.manifest
        own = [((c["local"][0], int(c["local"][1])), (c["remote"][0], int(c["remote"][1])))
               for c in manifest.criu.get("tcp_connections", [])]
        between = [pair for pair in own if (pair[1], pair[0]) in self.peers]
        self.lock = ConnectionLock(manifest.id, between, self.reporter)
        self.lock.lock()
        return prepared

    def capture(self) -> Held:
        return self.member.capture()

    def release(self) -> Released:
        self._lift()  # every member is back and held: their sockets exist, none sends yet
        return self.member.release()

    def commit(self) -> Committed:
        return self.member.commit()

    def abort(self) -> None:
        try:
            self.member.abort()
        finally:
            self._lift()

    def _lift(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.lift()


class MigrationDestination:
    """The destination of `ckpt migrate` (docs/design.md, "Migration"): a restore member that,
    aborted, first reads the migration's decision. Once the coordinator has recorded it the
    source tree is gone and this tree is the only copy: an abort (the coordinator died, its
    channel ended) then lets it run and finishes it instead of ending it. A tree whose release
    failed is never tried again: the coordinator, told so, restores it at the source."""

    def __init__(self, member: Member, store: Store, reporter: Reporter):
        self.member, self.label, self.store, self.reporter = member, member.label, store, reporter
        self.checkpoint = ""  # the restored checkpoint's ID, once prepared
        self.release_tried = False
        self.released = False

    def prepare(self) -> Prepared:
        prepared = self.member.prepare()
        session = self._session()
        self.checkpoint = session.manifest.id
        # Held past its limit (the coordinator silent: a partition, not an end of file), the
        # tree runs if the move was recorded: its source is gone.
        session.on_hold_expiry = self._decided
        return prepared

    def capture(self) -> Held:
        return self.member.capture()

    def release(self) -> Released:
        self.release_tried = True
        released = self.member.release()
        self.released = True
        return released

    def commit(self) -> Committed:
        return self.member.commit()

    def abort(self) -> None:
        if self.released:  # it runs (released after the decision): finished, never ended
            self._finish("the coordinator is gone after this host's tree was let run; it runs on")
        elif self.checkpoint and not self.release_tried and (self._session().released_on_expiry or self._decided()):
            try:
                self.release()
            except CkptError as exc:
                self.reporter.warn(f"the tree could not be let run here: {exc.message}")
                self.member.abort()
                return
            self._finish("the coordinator is gone after the source tree was ended: this host's tree is the "
                         "only copy, and runs")
        else:
            self.member.abort()

    def _finish(self, why: str) -> None:
        self.reporter.warn(why)
        try:
            self.commit()
        except CkptError as exc:
            self.reporter.warn(f"the tree runs, but did not finish cleanly: {exc.message}")

    def _decided(self) -> bool:
        try:
            return self.store.migrations.decided(self.checkpoint)
        except (CkptError, OSError) as exc:  # the store unreachable: nobody can tell, the source may live
            self.reporter.warn(f"cannot read the migration's decision ({exc}): this host's tree is ended")
            return False

    def _session(self) -> RestoreSession:
        inner = self.member.member if isinstance(self.member, HostLockedRestore) else self.member
        if not isinstance(inner, LocalRestoreMember):
            raise RuntimeError("a migration's destination is a restore member")
        return inner.session


# ---- the agent ------------------------------------------------------------------------------

class ChannelClosed(BaseException):
    """End of file on the agent's stdin (or SIGTERM, SIGHUP) while a phase runs: raised in the
    phase, which is cut short as an interrupt would cut it (not an Exception: nothing in the
    session may take it for a failure of its own and go on)."""


@dataclass
class AgentState:
    store: Store | None = None  # hello's, opened
    member: Member | None = None  # from prepare
    done: tuple[str, ...] = ()  # the phases answered, in order


# Each request and the one before it (abort may come at any time).
ORDER = {"hello": None, "prepare": "hello", "capture": "prepare", "release": "capture", "commit": "release"}


class MemberAgent:
    """Serves one member for one coordinator: see the module's docstring. The core never
    prints: requests and answers are the streams handed to serve(), messages go to reporter."""

    def __init__(self, settings: Settings, reporter: Reporter, make_member: MemberMaker = session_member,
                 idle_limit: float = IDLE_LIMIT):
        self.base, self.reporter, self.make_member, self.idle_limit = settings, reporter, make_member, idle_limit
        self.state = AgentState()
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._busy = False  # a phase runs (only the main thread changes it)
        self._gone = False  # end of file, SIGTERM or SIGHUP: the coordinator is gone
        self._answers: IO[str] | None = None

    def serve(self, requests: IO[bytes], answers: IO[str]) -> int:
        """Answers the requests until commit, abort or end of file; returns the exit code (0
        after commit or abort, the error's after a failure, 1 after end of file)."""
        self._answers = answers
        signals = self._catch_signals()
        reader = threading.Thread(target=self._read, args=(requests, signals), name="ckpt-member-stdin",
                                  daemon=True)
        reader.start()
        try:
            return self._loop()
        except BaseException:
            self._abort()  # interrupted (SIGINT) or a bug: nothing held is left behind
            raise
        finally:
            for number, handler in signals.items():
                signal.signal(number, handler)

    def _catch_signals(self) -> dict[int, Any]:
        """SIGUSR1 (the reader's word that stdin ended), SIGTERM and SIGHUP: the coordinator is
        gone. Only the main thread can take signals; elsewhere end of file is seen between phases."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {number: signal.signal(number, self._coordinator_gone)
                for number in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP)}

    def _coordinator_gone(self, number: int, _frame: object) -> None:
        # SIGUSR1 comes after the reader queued end of file, behind any request still to be
        # answered; SIGTERM and SIGHUP end the agent between requests too.
        if number != signal.SIGUSR1:
            self._gone = True
        if self._busy:
            raise ChannelClosed()

    def _read(self, requests: IO[bytes], signals: dict) -> None:
        try:
            for line in requests:
                self._requests.put(line)
        except (OSError, ValueError):
            pass  # stdin went away: as end of file
        finally:
            self._requests.put(None)
            if signals:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    def _loop(self) -> int:
        for _ in range(MAX_REQUESTS):
            line = self._next_request()
            if line is None:
                self._abort()
                return int(ExitCode.ERROR)
            code = self._handle(line)
            if code is not None:
                return code
        self._abort()
        return int(ExitCode.USAGE)

    def _next_request(self) -> bytes | None:
        """The next request line; None once the coordinator is gone or idle too long."""
        deadline = time.monotonic() + self.idle_limit
        while not self._gone:
            try:
                line = self._requests.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    self.reporter.warn(f"no request for {self.idle_limit:g} s: the member is aborted")
                    return None
                continue
            if line is None:
                self.reporter.warn("the coordinator is gone (end of file): the member is aborted")
            return line
        self.reporter.warn("ended by a signal: the member is aborted")
        return None

    def _handle(self, line: bytes) -> int | None:
        """One request: its answer written; the exit code once the agent is done, else None."""
        try:
            op, answer = self._run(line)
        except ChannelClosed:
            self.reporter.warn("the coordinator is gone (end of file) while a phase ran: the member is aborted")
            self._abort()
            return int(ExitCode.ERROR)
        except CkptError as exc:
            self._abort()
            self._answer({"ok": False, "error": exc.message, **to_record(exc)})
            return int(exc.exit_code)
        except Exception as exc:  # a bug: answered, the member aborted, then raised for the CLI's handler
            self._abort()
            self._answer({"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}",
                          "message": f"internal error: {type(exc).__name__}: {exc}", "hint": None,
                          "exit_code": int(ExitCode.INTERNAL)})
            raise
        if not self._answer({"ok": True, **answer}):
            self._abort()
            return int(ExitCode.ERROR)
        return 0 if op in ("commit", "abort") else None

    def _run(self, line: bytes) -> tuple[str, dict]:
        try:
            message = json.loads(line)
        except ValueError:
            raise UsageError("a request that is not JSON") from None
        op = message.get("op") if isinstance(message, dict) else None
        if op == "abort":
            self._abort()
            return op, {}
        if op not in ORDER:
            raise UsageError(f"unknown request {op!r}")
        before = self.state.done[-1] if self.state.done else None
        if ORDER[op] != before:
            raise UsageError(f"{op} after {before or 'nothing'}", hint="the coordinator broke the protocol's order")
        self._busy = True
        try:
            answer = getattr(self, f"_{op}")(message)
        finally:
            self._busy = False
        self.state.done += (op,)
        return op, answer

    def _hello(self, message: dict) -> dict:
        if message.get("version") != PROTOCOL_VERSION:
            raise UsageError(f"the coordinator speaks version {message.get('version')} of the group protocol, "
                             f"this ckpt {PROTOCOL_VERSION}", hint="run the same ckpt version on every host")
        settings = settings_from_hello(self.base, message)
        self.state.store = open_members_store(settings, message.get("store_identity"))
        # pycriu's image readers take 0.1-0.3 s to import: here, not while a migration's source
        # is frozen waiting for this host's restore (the agent is reached before the freeze).
        from ckpt.criu.images import warm_up

        warm_up()
        return {"version": PROTOCOL_VERSION, "hostname": socket.gethostname(), "pid": os.getpid()}

    def _prepare(self, message: dict) -> dict:
        request = request_from_wire(str(message.get("kind")), message.get("request"))
        hold_limit = float(message.get("hold_limit") or 60.0)
        if self.state.store is None:
            raise UsageError("prepare before hello")
        member = self.make_member(request, self.state.store, self.reporter, hold_limit)
        if message.get("migration") and isinstance(request, RestoreRequest):
            member = MigrationDestination(member, self.state.store, self.reporter)
        self.state.member = member
        return member.prepare().to_json()

    def _capture(self, _message: dict) -> dict:
        return self._member().capture().to_json()

    def _release(self, _message: dict) -> dict:
        member = self._member()
        if isinstance(member, MigrationDestination):
            # Its source is gone: cut short by the channel's end (once CRIU was told to go),
            # the abort that follows would end the only copy. The end of file is acted on after.
            self._busy = False
        return member.release().to_json()

    def _commit(self, _message: dict) -> dict:
        return self._member().commit().to_json()

    def _member(self) -> Member:
        if self.state.member is None:
            raise UsageError("no member prepared")
        return self.state.member

    def _abort(self) -> None:
        member, self.state.member = self.state.member, None
        if member is not None:
            member.abort()

    def _answer(self, answer: dict) -> bool:
        """Writes one answer line; False when nobody reads any more (the channel is gone)."""
        if self._answers is None:
            return False
        try:
            self._answers.write(json.dumps(answer) + "\n")
            self._answers.flush()
        except (OSError, ValueError):
            return False
        return True
