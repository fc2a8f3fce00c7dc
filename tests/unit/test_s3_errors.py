"""The S3 backend's failures: transient ones retried (503 SlowDown, a body cut midway: through a
small fault-injecting proxy in front of the real server), the rest one typed error each with
its exit code and a one-line message saying what to do: a stopped server, wrong or missing
credentials, a missing bucket, a malformed URL."""

import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ckpt.errors import DiskFull, ExitCode, StoreAccessDenied, StoreNotFound, StoreUnreachable, UsageError
from ckpt.store.backends.s3 import S3Backend
from tests.conftest import S3_BUCKET
from tests.helpers import ROOT
from tests.s3server import WeedServer


def one_line(error) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_a_stopped_server_is_unreachable_quickly(s3_env, tmp_path, monkeypatch):
    server = WeedServer(tmp_path).start()
    try:
        server.client().create_bucket(Bucket="gone")
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        backend = S3Backend("gone", "store")
        backend.put("checkpoints/a.json", b"{}")
    finally:
        server.stop()
    for fresh in (False, True):  # a request of a backend in use, and a first one (HeadBucket)
        if fresh:
            backend = S3Backend("gone", "store")
        started = time.monotonic()
        with pytest.raises(StoreUnreachable) as info:
            backend.get("checkpoints/a.json")
        assert time.monotonic() - started < 10, "bounded retries"
        assert info.value.exit_code == ExitCode.UNREACHABLE == 9
        assert server.endpoint in one_line(info.value) and "AWS_ENDPOINT_URL" in str(info.value)


@pytest.mark.parametrize("variable, value", [("AWS_SECRET_ACCESS_KEY", "wrong-secret"),
                                              ("AWS_ACCESS_KEY_ID", "unknown-key")])
def test_wrong_credentials_are_refused_with_the_fix(s3_url, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(StoreAccessDenied) as info:
        S3Backend.from_url(s3_url).list("checkpoints/")
    assert info.value.exit_code == ExitCode.PERMISSION
    assert "refused access" in one_line(info.value) and "AWS_SECRET_ACCESS_KEY" in str(info.value)


def test_missing_credentials_say_how_to_give_them(s3_url, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    started = time.monotonic()
    with pytest.raises(StoreAccessDenied, match="no AWS credentials found.*AWS_ACCESS_KEY_ID") as info:
        S3Backend.from_url(s3_url).stat("store.json")
    assert time.monotonic() - started < 5
    one_line(info.value)


def test_a_missing_bucket_is_named(s3_env):
    with pytest.raises(StoreNotFound) as info:
        S3Backend.from_url("s3://no-such-bucket/store").get("store.json")
    assert info.value.exit_code == ExitCode.NOT_FOUND
    assert "no bucket 'no-such-bucket'" in one_line(info.value) and "aws s3 mb" in str(info.value)


@pytest.mark.parametrize("url", ["s3:/bucket", "bucket/prefix", "s3://B/x", "s3://ab", "s3://bucket/a/../b",
                                 "s3://bucket/.hidden"])
def test_urls_that_are_not_stores_are_refused(url):
    with pytest.raises(UsageError) as info:
        S3Backend.from_url(url)
    assert info.value.exit_code == ExitCode.USAGE
    one_line(info.value)


def test_a_profile_that_does_not_exist_is_named(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(UsageError, match="profile 'nobody' does not exist"):
        S3Backend.from_url(f"s3://{S3_BUCKET}/x")


# ---- transient faults, through a proxy -------------------------------------------------------

class FaultyProxy:
    """Forwards requests to the server; the next `slow_down` requests are answered 503 SlowDown
    instead, and the next `cut` GET responses are cut after half of their body (the connection
    closed), as a reset mid-download would."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.slow_down = 0
        self.cut = 0
        self.cut_uploads = 0  # the next PUTs: body read, then the connection dropped unanswered
        self.refuse_puts: tuple[int, bytes] | None = None  # every PUT answered with this
        self.requests: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests.append(self.command)
                if self.command == "PUT" and proxy.cut_uploads > 0:
                    proxy.cut_uploads -= 1
                    self.close_connection = True
                    self.connection.shutdown(2)  # a reset mid-upload: no answer at all
                    return
                if self.command == "PUT" and proxy.refuse_puts is not None:
                    status, error = proxy.refuse_puts
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                if proxy.slow_down > 0:
                    proxy.slow_down -= 1
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                upstream_conn = http.client.HTTPConnection(host, int(port), timeout=30)
                upstream_conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in self.headers.items():
                    upstream_conn.putheader(key, value)
                upstream_conn.endheaders(body)
                response = upstream_conn.getresponse()
                data = response.read()
                upstream_conn.close()
                cut = self.command == "GET" and proxy.cut > 0 and len(data) > 1
                if cut:
                    proxy.cut -= 1
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if cut:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # the client gave up on a cut response: expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(s3_env, monkeypatch):
    faulty = FaultyProxy(s3_env.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", faulty.endpoint)
    yield faulty
    faulty.close()


def test_slow_down_is_retried_with_backoff(proxy, s3_url):
    backend = S3Backend.from_url(s3_url)
    backend.put("objects/ab/one", b"one")
    proxy.slow_down = 2
    started = time.monotonic()
    backend.put("objects/ab/two", b"two")
    assert proxy.slow_down == 0 and backend.get("objects/ab/two") == b"two"
    assert time.monotonic() - started < 10
    few = S3Backend.from_url(s3_url, attempts=3)
    assert few.exists("objects/ab/one")
    proxy.slow_down = 100  # more than the retries: a typed error, not a traceback
    with pytest.raises(StoreUnreachable, match="SlowDown.*after 3 attempts") as info:
        few.get("objects/ab/one")
    assert info.value.exit_code == ExitCode.UNREACHABLE
    one_line(info.value)


def test_a_download_cut_midway_is_asked_again(proxy, s3_url, tmp_path):
    data = os.urandom(12 << 20)
    backend = S3Backend.from_url(s3_url, part_size=5 << 20)
    backend.put("packs/ab/pack", data)
    for read in (lambda: backend.get("packs/ab/pack"),
                 lambda: (backend.get_file("packs/ab/pack", tmp_path / "pack"), (tmp_path / "pack").read_bytes())[1]):
        proxy.cut = 2
        gets = proxy.requests.count("GET")
        assert read() == data
        assert proxy.cut == 0 and proxy.requests.count("GET") - gets == 3 + 2, "3 ranges, 2 asked again"


def test_an_upload_cut_midway_is_sent_again(proxy, s3_url):
    """A connection dropped while a part (or a whole object) is being sent: botocore sends it
    again, and the blob is whole."""
    data = os.urandom(12 << 20)
    backend = S3Backend.from_url(s3_url, part_size=5 << 20)
    proxy.cut_uploads = 2
    with backend.writer("packs/ab/cut") as out:
        out.write(data)
        out.commit()
    assert proxy.cut_uploads == 0 and backend.get("packs/ab/cut") == data, proxy.requests
    proxy.cut_uploads = 1
    backend.put("objects/ab/small", b"small")
    assert backend.get("objects/ab/small") == b"small"


@pytest.mark.parametrize("status,code", [(403, "QuotaExceeded"), (507, "XMinioStorageFull")])
def test_a_full_bucket_quota_is_a_full_disk(proxy, s3_url, status, code):
    """Ceph RGW answers a full quota 403 QuotaExceeded, MinIO 507: both are a full store (exit
    1, "ckpt prune" in the hint), not refused credentials."""
    backend = S3Backend.from_url(s3_url, attempts=2)
    backend.exists("objects/ab/x")  # the bucket check passes first
    proxy.refuse_puts = (status, f"<Error><Code>{code}</Code><Message>quota</Message></Error>".encode())
    with pytest.raises(DiskFull) as info:
        backend.put("objects/ab/full", b"data")
    assert info.value.exit_code == ExitCode.ERROR and "prune" in (info.value.hint or "")
    one_line(info.value)


def test_a_full_bucket_answered_500_internal_error_is_exit_9_as_the_docs_say(proxy, s3_url):
    """Issue 23: a server that reports a full bucket as 500 InternalError cannot be told from
    one failing for a while: exit 9 (try again later), not the 1 of a quota error. The table of
    exit codes in docs/commands.md says so."""
    backend = S3Backend.from_url(s3_url, attempts=2)
    backend.exists("objects/ab/x")
    proxy.refuse_puts = (500, b"<Error><Code>InternalError</Code><Message>disk full</Message></Error>")
    with pytest.raises(StoreUnreachable, match="InternalError") as info:
        backend.put("objects/ab/full", b"data")
    assert info.value.exit_code == ExitCode.UNREACHABLE == 9
    one_line(info.value)
    table = (ROOT / "docs" / "commands.md").read_text().splitlines()
    row = next(line for line in table if line.startswith("| 9 |"))
    assert "full bucket" in row and "500 InternalError" in row, row


def test_a_forked_process_requests_with_credentials_whose_refresh_lock_was_held_at_the_fork(s3_url):
    """A lazy restore's page server is forked; its client is made from the session it
    inherits only where the credentials are static (S3Backend._connect): refreshable ones,
    whose lock another thread of the parent held at the fork, must not block the child's
    first request for ever."""
    import signal

    from botocore.credentials import RefreshableCredentials

    backend = S3Backend.from_url(s3_url)
    backend.put("before-fork", b"1")
    static = backend._session.get_credentials().get_frozen_credentials()

    def fresh() -> dict:
        expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
        return {"access_key": static.access_key, "secret_key": static.secret_key, "token": None,
                "expiry_time": expiry}

    expiring = dict(fresh(), expiry_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60)))
    credentials = RefreshableCredentials.create_from_metadata(expiring, fresh, "test")
    backend._session._credentials = credentials  # (what a profile of temporary credentials gives)
    credentials._refresh_lock.acquire()  # as a thread mid-refresh holds it
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked process
        code = 3
        try:
            signal.alarm(20)  # held for ever: killed, not hung
            backend.put("after-fork", b"2")  # a refresh is due (60 s left): it takes the lock
            code = 0 if backend.get("after-fork") == b"2" else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    credentials._refresh_lock.release()
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.get("after-fork") == b"2"


def test_a_forked_process_with_static_credentials_makes_its_client_from_the_inherited_session(s3_url):
    """Its models loaded already: 0.005 s against 0.06-0.08 s of a lazy restore's page server's
    CPU before its first fetch; its client is its own (the parent's connections are not used)."""
    backend = S3Backend.from_url(s3_url)
    backend.put("before-fork", b"1")
    inherited, parent_client = backend._session, backend._client
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked process
        code = 3
        try:
            same = backend.get("before-fork") == b"1"
            code = 0 if same and backend._session is inherited and backend._client is not parent_client else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
