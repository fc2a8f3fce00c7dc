"""A counting relay in front of the test S3 server: ckpt talks to 127.0.0.1:PORT (through
AWS_ENDPOINT_URL), every byte is relayed as it is to the server, and each HTTP request of the
client's streams is recorded (method, path, query, Range header) to count what a command
asked of the bucket. Requests are parsed from the client's side only (request line, headers,
a Content-Length body skipped); a request the relay cannot parse (a chunked body) is recorded
as such, so that a test can refuse to trust a count it did not see whole."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

JOIN_TIMEOUT = 5.0
CHUNK = 1 << 16


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # /bucket/key, as sent (path-style addressing)
    query: str
    range: str | None


class CountingRelay:
    """Relays 127.0.0.1:port to the server at upstream (host, port) and records the requests."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.requests: list[Request] = []
        self.unparsed = 0  # connections whose requests could not all be parsed
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed: stop()
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            for target, args in ((self._client_to_server, (client, server)), (self._pipe, (server, client))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                with self._lock:
                    self._threads.append(thread)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        parser = _RequestParser(self._record)
        try:
            while data := client.recv(CHUNK):
                server.sendall(data)
                if not parser.feed(data):
                    with self._lock:
                        self.unparsed += 1
                    parser = _RequestParser(None)  # relays on, counts no more
        except OSError:
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def stop(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for thread in [self._accepting, *threads]:
            thread.join(JOIN_TIMEOUT)


class _RequestParser:
    """HTTP/1.1 requests in a byte stream: head, then a body of Content-Length bytes."""

    def __init__(self, record):
        self.record = record
        self.buffer = b""
        self.body_left = 0

    def feed(self, data: bytes) -> bool:
        """False once the stream holds something it cannot parse (then it counts no more)."""
        if self.record is None:
            return True
        self.buffer += data
        while True:
            if self.body_left:
                skipped = min(self.body_left, len(self.buffer))
                self.buffer = self.buffer[skipped:]
                self.body_left -= skipped
                if self.body_left:
                    return True
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return len(self.buffer) < (1 << 20)  # a head of a MiB is no request of boto3's
            head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4:]
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                return False
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if "chunked" in headers.get("transfer-encoding", "").lower():
                return False
            url = urlsplit(parts[1])
            self.record(Request(parts[0], url.path, url.query, headers.get("range")))
            self.body_left = int(headers.get("content-length", "0") or 0)
