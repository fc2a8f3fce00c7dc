"""`ckpt run`'s CKPT_SOCKET: a line protocol over a UNIX stream socket, for programs in any
language (docs/api.md, "Any language"; docs/design.md "The CKPT_SOCKET protocol").

One request per connection: the client connects, sends one line, reads the one-line reply and
closes. The supervisor shuts its side down after the reply (so `socat` and `nc -N` end at
once) and waits for the client to have closed the connection everywhere before it freezes
anything: a connection held across a freeze would be a socket to outside the tree.

    CHECKPOINT [ID] [NAME]  -> OK <id>          the dump starts once the client has closed
    RESULT <id>             -> CHECKPOINTED <id> | RESTORED <id> | FAILED <reason> | PENDING
    BEGIN [PID]             -> SECTION <token> | BUSY      (BUSY: a dump is under way, ask again)
                               PID: of the supervised tree, or the connecting process (default)
    END <token>             -> OK
    JOURNAL ...             -> handle_journal()
    anything else           -> ERROR <reason>

While the supervisor dumps, the socket's name is gone: a client retries a refused or missing
socket (request() does, for up to CONNECT_RETRY_S).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from ckpt.errors import CkptError

ENV = "CKPT_SOCKET"
SOCKET_DIR = Path("/run/ckpt/run")
MAX_LINE = 4096
CONNECT_RETRY_S = 120.0  # a dump takes the socket away for its pre-flight and CRIU's work
REPLY_TIMEOUT_S = 30.0
CLIENT_CLOSE_S = 5.0  # how long the server waits for a client to close after its reply


class ProtocolError(Exception):
    """The supervisor could not be reached, or answered ERROR."""


# ---- the client side ------------------------------------------------------------------------

def socket_path() -> str | None:
    from ckpt import settings

    path = settings.Settings.from_environment().socket
    return str(path) if path is not None else None


def request(line: str, path: str | None = None, retry_s: float = CONNECT_RETRY_S) -> str:
    """Sends one request line, returns the reply line (without its newline), and closes the
    connection before returning. Retries while the socket is away (a dump is under way)."""
    path = path or socket_path()
    if not path:
        raise ProtocolError(f"{ENV} is not set: this program does not run under 'ckpt run'")
    deadline = time.monotonic() + retry_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(REPLY_TIMEOUT_S)
            try:
                sock.connect(path)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED) or time.monotonic() >= deadline:
                    raise ProtocolError(f"cannot reach the supervisor at {path}: {exc.strerror}") from None
                time.sleep(0.02)
                continue
            sock.sendall(line.encode() + b"\n")
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while len(data) <= MAX_LINE:
                chunk = sock.recv(MAX_LINE)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            raise ProtocolError(f"the supervisor at {path} did not answer: {exc}") from None
        finally:
            sock.close()  # before returning: the caller may be frozen next
        reply = data.decode(errors="replace").split("\n", 1)[0]
        if not reply:
            raise ProtocolError(f"the supervisor at {path} closed the connection without answering")
        return reply


def request_checkpoint(checkpoint_id: str, name: str | None = None, path: str | None = None) -> None:
    """Asks the supervising `ckpt run` to checkpoint this process's tree with that id; returns
    once the request is accepted and the connection closed (the dump follows; its outcome goes
    to the result file <agent dir>/<pid>-<id>.json, ckpt/agent/results.py). Raises ProtocolError
    when refused."""
    reply = request(f"CHECKPOINT {checkpoint_id}" + (f" {name}" if name else ""), path)
    if reply.split()[:1] != ["OK"]:
        raise ProtocolError(reply.removeprefix("ERROR ").strip() or "refused")


def handle_journal(words: list[str], supervision: Supervision) -> str:
    """JOURNAL-INTENT / JOURNAL-RECORD / JOURNAL-GET (ckpt/agent/journal.py answers them) in
    the journal of the supervisor's store and --name."""
    from ckpt.agent.journal import handle_protocol

    try:
        store = supervision.journal_store()
    except CkptError as exc:
        return f"ERROR {exc.message}"
    return handle_protocol(words, store, supervision.agent_name())


# ---- the server side (ckpt run) -------------------------------------------------------------

@dataclass
class Client:
    pid: int
    uid: int


class Supervision(Protocol):
    """What the server asks of `ckpt run`'s supervisor (called from the server's thread)."""

    def checkpoint_requested(self, checkpoint_id: str, name: str | None, client: Client,
                             error: str | None, result_file: bool) -> None:
        """Queue a dump with that id (error: the request failed after its OK); result_file: the
        client chose the id and waits for its result file (results.py; a shell asks RESULT)."""

    def result(self, checkpoint_id: str) -> str:
        """The reply to RESULT <id>."""

    def journal_store(self):
        """The store the journal requests go to (the supervisor's)."""

    def agent_name(self) -> str | None:
        """Whose journal: the supervised command's --name."""

    def supervised_pid(self) -> int | None:
        """The root PID of the supervised tree (None before it starts): BEGIN names its PIDs."""


SO_PEERCRED_FORMAT = struct.Struct("3i")  # pid, uid, gid


def peer_of(conn: socket.socket) -> Client:
    pid, uid, _ = SO_PEERCRED_FORMAT.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            SO_PEERCRED_FORMAT.size))
    return Client(pid, uid)


class Server:
    """The CKPT_SOCKET server of one `ckpt run`, in a thread of its own: it answers while the
    supervisor dumps (a section's END must get through while the dump waits for it), except
    inside paused(), which covers the pre-flight and CRIU's work."""

    def __init__(self, path: Path, supervision: Supervision):
        self.path = path
        self.supervision = supervision
        self.lock = threading.Lock()  # held while a connection is served, and while paused
        self.listener: socket.socket | None = None
        self.markers: dict[str, Path] = {}  # BEGIN's sections: token -> marker
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        from ckpt.system.files import make_private_dir

        make_private_dir(self.path.parent)
        _remove_stale_sockets(self.path.parent)
        self._listen()
        self.thread = threading.Thread(target=self._serve, name="ckpt-socket", daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # owner-only from the start, not after a chmod
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        listener.listen(16)
        listener.setblocking(False)
        self.listener = listener

    def _unlisten(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        with self.lock:
            self._unlisten()
            for marker in self.markers.values():
                marker.unlink(missing_ok=True)
            self.markers.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No connection from the tree exists inside: the name is removed first (a connect finds
        nothing), then what was already queued is served, then the listener is closed."""
        with self.lock:
            self.path.unlink(missing_ok=True)
            self._drain()
            self._unlisten()
            try:
                yield
            finally:
                if not self.stopping.is_set():
                    self._listen()

    def _drain(self) -> None:
        while self.listener is not None:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._serve_one(conn)

    def _serve(self) -> None:
        import select

        while not self.stopping.is_set():
            listener = self.listener
            if listener is None:
                time.sleep(0.02)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.1)
            except (OSError, ValueError):
                continue  # closed by paused() meanwhile
            if not ready:
                continue
            with self.lock:
                if self.listener is listener:
                    self._drain()

    def _serve_one(self, conn: socket.socket) -> None:
        after: Callable[[str | None], None] | None = None
        try:
            conn.setblocking(True)
            conn.settimeout(2.0)
            client = peer_of(conn)
            peer_inode = _peer_inode(conn)
            try:
                line = _read_line(conn)
                reply, after = self._dispatch(line.split(), client)
            except (OSError, UnicodeDecodeError) as exc:
                reply = f"ERROR {exc}"
            try:
                conn.sendall(reply.encode() + b"\n")
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            closed = _wait_closed(conn, peer_inode)
        except OSError:
            closed = False
        finally:
            conn.close()
        if after is not None:
            after(None if closed else "the client kept its connection to CKPT_SOCKET open; nothing was dumped")

    def _dispatch(self, words: list[str], client: Client) -> tuple[str, Callable[[str | None], None] | None]:
        if not words:
            return "ERROR empty request", None
        verb, args = words[0].upper(), words[1:]
        if verb.startswith("JOURNAL"):
            # The journal's own verb family: ckpt/agent/journal.py answers it.
            return handle_journal([verb, *args], self.supervision), None
        handler = {"CHECKPOINT": self._checkpoint, "RESULT": self._result, "BEGIN": self._begin,
                   "END": self._end}.get(verb)
        if handler is None:
            return f"ERROR unknown request {verb[:40]!r}", None
        return handler(args, client)

    def _checkpoint(self, args: list[str], client: Client) -> tuple[str, Callable[[str | None], None] | None]:
        from ckpt.store import ids

        checkpoint_id = args.pop(0) if args and ids.is_id(args[0]) else None
        if len(args) > 1:
            return "ERROR CHECKPOINT takes an optional id and an optional name", None
        name = args[0] if args else None
        if name is not None and not ids.NAME_RE.match(name):
            return f"ERROR invalid checkpoint name {name[:64]!r}", None
        chosen = checkpoint_id or ids.new_id()

        def queue(error: str | None) -> None:
            self.supervision.checkpoint_requested(chosen, name, client, error, checkpoint_id is not None)
        return f"OK {chosen}", queue

    def _result(self, args: list[str], client: Client) -> tuple[str, None]:
        from ckpt.store import ids

        if len(args) != 1 or not ids.is_id(args[0]):
            return "ERROR RESULT takes a checkpoint id", None
        return self.supervision.result(args[0]), None

    def _begin(self, args: list[str], client: Client) -> tuple[str, None]:
        from ckpt.agent.sections import tree_of, try_enter

        # A shell's section belongs to the shell ($$), not to the socat that connected and is
        # gone a moment later (a marker of a gone process counts for nothing).
        if len(args) > 1 or (args and not args[0].isdigit()):
            return "ERROR BEGIN takes an optional PID", None
        pid = int(args[0]) if args else client.pid
        if not os.path.isdir(f"/proc/{pid}"):
            return f"ERROR no process {pid}", None
        # Only the supervised tree's dumps may be held off, not those of any process on the host.
        root = self.supervision.supervised_pid()
        if pid != client.pid and (root is None or pid not in tree_of(root)):
            return (f"ERROR PID {pid} is not in the supervised tree (root PID {root}): BEGIN takes a PID of "
                    "that tree, or none for the connecting process"), None
        # The supervisor owns the section: once it is gone (even by SIGKILL, which leaves the
        # marker behind), the section is void.
        try:
            marker = try_enter(pid, pid, uid=client.uid, owner=os.getpid())
        except ProcessLookupError:
            return f"ERROR no process {pid}", None
        if marker is None:
            return "BUSY", None
        self.markers[marker.name] = marker
        return f"SECTION {marker.name}", None

    def _end(self, args: list[str], client: Client) -> tuple[str, None]:
        if len(args) != 1 or args[0] not in self.markers:
            return "ERROR END takes a token BEGIN gave", None
        self.markers.pop(args[0]).unlink(missing_ok=True)
        return "OK", None


def _remove_stale_sockets(directory: Path) -> None:
    """The sockets of supervisors that were killed (SIGKILL leaves the name behind)."""
    for path in directory.glob("*.sock"):
        try:
            if not os.path.exists(f"/proc/{int(path.stem)}"):
                path.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue


def _read_line(conn: socket.socket) -> str:
    data = b""
    while b"\n" not in data and len(data) <= MAX_LINE:
        chunk = conn.recv(MAX_LINE)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode()


def _peer_inode(conn: socket.socket) -> int | None:
    from ckpt.system import unixdiag

    try:
        return unixdiag.stream_peers().get(os.fstat(conn.fileno()).st_ino)
    except OSError:
        return None


def _wait_closed(conn: socket.socket, peer_inode: int | None) -> bool:
    """Whether the client closed its end everywhere (not merely shut it down, and not in a child
    that inherited it) within CLIENT_CLOSE_S: its socket then no longer exists."""
    from ckpt.system import unixdiag

    deadline = time.monotonic() + CLIENT_CLOSE_S
    try:
        while conn.recv(MAX_LINE):
            if time.monotonic() >= deadline:
                return False
    except OSError:
        pass  # reset or timed out: the socket's existence below decides
    if peer_inode is None:
        return True
    while time.monotonic() < deadline:
        try:
            if peer_inode not in unixdiag.stream_peers():
                return True
        except OSError:
            return True
        time.sleep(0.005)
    return False
