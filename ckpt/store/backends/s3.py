"""The S3 backend: blobs as objects of an S3-compatible bucket (AWS S3, MinIO, Ceph RGW,
SeaweedFS, Garage), addressed as s3://BUCKET/PREFIX; a blob's key is PREFIX/<name>.

Endpoint, region and credentials come the way AWS tools take them (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/config): botocore's default session
reads them, ckpt never does (botocore alone, not boto3, which imports its transfer manager:
importing boto3 and making its client took 0.19 s against botocore's 0.15; `ckpt list` of a
store in S3, 5 alternating pairs, 0.350-0.357 s against 0.333-0.347 s).
Checksums are computed and validated "when required" only: recent
botocore otherwise sends CRC trailers (aws-chunked uploads) that some servers refuse; blobs are
named by their content hash and checked by the store anyway.

Writes are single PUTs up to MULTIPART_FROM, multipart uploads above (parts uploaded in
parallel as they are written, visible only when the upload is completed). put_if_absent is
PutObject with If-None-Match: * (412: BlobExists). The lock is a set of lock objects under
locks/ that their holders refresh (see "Storage backends" in docs/design.md for the protocol).
Every request has a budget (`timeout`, CKPT_S3_TIMEOUT, 60 s by default; longer for a large
body, at MIN_BODY_RATE): transient failures (503 SlowDown, 500, resets, timeouts) are retried
with backoff within it, and a GET cut mid-body is asked again within it; past it the command
ends with StoreUnreachable (exit 9), and a server that let a request time out is not asked
again by this process (a hung server, SIGSTOPped or black-holed, would otherwise make every
clean-up request wait its own budget too). The rest end in the typed errors of
ckpt/errors.py (StoreUnreachable, StoreAccessDenied, StoreNotFound, DiskFull, StoreError).
"""

from __future__ import annotations

import base64
import builtins
import concurrent.futures
import errno
import json
import os
import random
import re
import secrets
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import botocore.session
import urllib3.exceptions
from botocore.config import Config
from botocore.credentials import RefreshableCredentials
from botocore.exceptions import BotoCoreError, ClientError, ConnectionClosedError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import (ConnectTimeoutError, HTTPClientError, IncompleteReadError, NoCredentialsError,
                                 PartialCredentialsError, ProfileNotFound, ReadTimeoutError, ResponseStreamingError)

from ckpt.errors import (CkptError, DiskFull, StoreAccessDenied, StoreBusy, StoreError, StoreNotFound,
                         StoreUnreachable, UsageError)
from ckpt.store.backends.base import (Backend, BlobExists, BlobInfo, BlobNotFound, BlobWriter, BufferedBlobWriter,
                                      LockOwner,
                                      check_name)
from ckpt.system import procfs
from ckpt.system.files import new_file, pwrite_all

# Parts of a multipart upload, and ranges of a large GET: big enough that a request's latency
# (tens of ms to AWS) is small next to its transfer, small enough that CONCURRENCY of them in
# memory stay modest. S3 wants parts of at least 5 MiB (but the last) and at most 10,000 of
# them: the part size doubles every 2,000 parts, so a blob may grow far beyond 16 MiB x 10,000.
PART_SIZE = 16 << 20
MIN_PART_SIZE = 5 << 20
PARTS_PER_SIZE = 2000
# A blob put whole above this goes as a multipart upload (parts in parallel, each retried
# alone) instead of one PUT.
MULTIPART_FROM = 32 << 20
CONCURRENCY = 4
# Requests for separate small blobs (a tree's small images read or stored, page lists, the
# first segments of its packs) worth having in flight at once: each waits a round trip (20 ms
# away, a 101-process tree's 600 small reads took 2.7 s four at a time) and moves little.
REQUESTS_IN_FLIGHT = 16
# Requests are retried here, not by botocore (whose retries know no overall deadline):
# throttling (503 SlowDown: backoff from 1 s, doubling, at most 20 s) and transient errors
# (5xx, resets, timeouts: backoff from 50 ms), at most MAX_ATTEMPTS times and only while the
# request's budget lasts. A server that is down fails in about a second; throttling is
# waited out for up to ~30 s (within the default budget).
MAX_ATTEMPTS = 6
DEFAULT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0  # at most; a third of the budget when that is less
# A request's budget grows by its body's size at this rate (a PUT is answered only once the
# server stored the whole body): a 16 MiB part gets 16 s more.
MIN_BODY_RATE = 1 << 20
# A GET whose body is cut (a reset after the headers, which botocore does not retry) is asked
# again, this many times.
STREAM_RETRIES = 5
LIST_PAGE = 1000
# Held while a forked process makes its own client (S3Backend._after_fork): never taken in the
# process that made the backend, so a fork never leaves it held.
_RECONNECTING = threading.Lock()
# The clients a forked process replaced, never collected: their pooled connections' descriptors
# are the parent's (or were closed by detach_stdio, and their numbers are other files' now);
# closing them when the client is collected would close whatever holds those numbers here.
_FORSAKEN: list[Any] = []
DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys

# A lock object not refreshed for LOCK_TTL seconds is stale (its holder died on another host,
# or lost the server): anyone may delete it. Holders refresh every LOCK_TTL / 5.
LOCK_TTL = 300.0
LOCKS_PREFIX = "locks/"

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# An unfinished multipart upload, as list(incomplete=True) names it and delete() accepts:
# "<dir>/.<last>.<upload id, base64url>.upload" (a dot-name: the backend's own, like the local
# backend's temp files; base64url because upload ids may hold any character).
_UPLOAD_SUFFIX = ".upload"

_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
              "TooManyRequestsException", "ServiceUnavailable", "RequestTimeout", "InternalError"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "TokenRefreshRequired", "AllAccessDisabled", "InvalidSecurity", "403"}
_STREAM_ERRORS = (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError,
                  urllib3.exceptions.HTTPError, ConnectionError)
# Failures of a request worth another attempt, and those that mean the server did not answer.
_TIMEOUTS = (ReadTimeoutError, ConnectTimeoutError)
_TRANSIENT = (BotoConnectionError, HTTPClientError, ResponseStreamingError, IncompleteReadError)


def _session_after_fork(inherited: Any) -> Any:
    """The botocore session a forked process makes its client from: the one it inherited
    where its credentials are static (keys from the environment or a file: nothing of the
    parent's is used again but loaded models), else a new one. Refreshable credentials (an
    instance's role, SSO, an assumed role) hold a lock another thread of the parent may have
    held at the fork, which nothing would release here, and their fetchers keep the parent's
    pooled connections."""
    credentials = inherited.get_credentials()
    if credentials is None or isinstance(credentials, RefreshableCredentials):
        return botocore.session.get_session()
    return inherited


class _PreconditionFailed(Exception):
    """412: an If-None-Match or If-Match did not hold."""


class _RangeNotSatisfiable(Exception):
    """416: the range starts at or past the end of the blob (which exists)."""


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET[/PREFIX]; UsageError if it is not one."""
    rest = url[len("s3://"):] if url.startswith("s3://") else None
    if rest is None:
        raise UsageError(f"{url!r} is not an s3:// URL", hint="give s3://BUCKET or s3://BUCKET/PREFIX")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise UsageError(f"{bucket!r} in {url!r} is not a bucket name",
                         hint="bucket names are 3 to 63 lower-case letters, digits, dots and dashes")
    if prefix:
        try:
            check_name(prefix)
        except ValueError:
            raise UsageError(f"{prefix!r} in {url!r} is not a usable prefix",
                             hint="use words of letters, digits, '.', '_' and '-' separated by '/'") from None
    return bucket, prefix


class S3Backend(Backend):
    """Blobs in s3://bucket/prefix. part_size, page_size, lock_ttl and attempts are for tests
    (small parts, pages, TTLs and few attempts exercise multipart uploads, pagination,
    staleness and exhausted retries quickly)."""

    def __init__(self, bucket: str, prefix: str = "", *, part_size: int = PART_SIZE, page_size: int = LIST_PAGE,
                 lock_ttl: float = LOCK_TTL, concurrency: int = CONCURRENCY, attempts: int = MAX_ATTEMPTS,
                 timeout: float = DEFAULT_TIMEOUT):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.part_size = max(part_size, MIN_PART_SIZE)
        self.page_size = page_size
        self.lock_ttl = lock_ttl
        self.concurrency = concurrency
        self.attempts = attempts
        self.timeout = timeout
        # Set once a request went unanswered for its whole budget: every later request of this
        # process fails at once with the same error.
        self._unanswered: StoreUnreachable | None = None
        self._session: Any = None  # botocore's, kept for the client of a forked process (see _connect)
        self._connect()
        self.endpoint = self._client.meta.endpoint_url

    def _connect(self, forked: bool = False) -> None:
        """A client, pool and locks of this process: after a fork (a lazy restore's page
        server) the parent's are unusable (their threads and connections are the parent's).
        The PID is set last: a thread of the forked process that sees it set uses this client."""
        replaced = getattr(self, "_client", None)
        if replaced is not None:
            _FORSAKEN.append(replaced)
        config = Config(
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
            retries={"mode": "standard", "total_max_attempts": 1},  # retried by _call, within a budget
            # Half the budget without a byte from the server ends an attempt: two fit in it.
            connect_timeout=min(CONNECT_TIMEOUT, max(1.0, self.timeout / 3)), read_timeout=max(1.0, self.timeout / 2),
            # A connection for each request in flight, and as many again for what runs beside
            # them (the parts of a transfer, a restore's page-list and index threads, a
            # prefetch's ranges, the lock's refresh): a request beyond the pool would open a
            # connection of its own and log a warning when it is discarded.
            # (a restore's page lists, images, index files and whole packs are read at once)
            max_pool_connections=4 * REQUESTS_IN_FLIGHT)
        try:
            # The default session: AWS_PROFILE, AWS_ENDPOINT_URL(_S3), AWS_ACCESS_KEY_ID, ~/.aws/config.
            # Kept for a forked process's client: a session of its own cost a lazy restore's
            # page server 0.06-0.08 s of CPU before its first fetch (0.25 s of wall time while
            # it planned), against 0.005 s from the session it inherits (its models loaded).
            session: Any = _session_after_fork(self._session) if forked else botocore.session.get_session()
            self._session = session
            self._client: Any = session.create_client("s3", config=config)
        except ProfileNotFound as exc:
            raise UsageError(f"the AWS profile {exc.kwargs.get('profile')!r} does not exist",
                             hint="set AWS_PROFILE to a profile of ~/.aws/config, or unset it") from None
        except ValueError as exc:  # a malformed AWS_ENDPOINT_URL
            raise UsageError(f"the S3 endpoint is not usable: {exc}",
                             hint="set AWS_ENDPOINT_URL to e.g. http://127.0.0.1:8333, or unset it for AWS") from None
        self._checked = getattr(self, "_checked", False)
        self._check_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        """The first request of a forked process makes its client; its other threads asking
        meanwhile wait for it (a forked page server's threads start at once), and none of them
        ever sends on a connection of the parent's pool."""
        if os.getpid() != self._pid:
            with _RECONNECTING:
                if os.getpid() != self._pid:
                    self._connect(forked=True)

    def requests_in_flight(self) -> int:
        return REQUESTS_IN_FLIGHT

    def gc_margin(self) -> float:
        # Twice the locks' TTL: a blob younger than that may belong to a command whose lock
        # another took for stale and that has not yet seen it (it checks before committing).
        return 2 * self.lock_ttl

    def now(self) -> float:
        """The server's clock (the Date of a list answer): what LastModified is compared with."""
        response = self._request("ListObjectsV2", "", Prefix=self._root + LOCKS_PREFIX, MaxKeys=1)
        server = _server_time(response)
        return server if server is not None else time.time()

    @classmethod
    def from_url(cls, url: str, **options) -> S3Backend:
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **options)

    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._root}{name}"

    def _key(self, name: str) -> str:
        return self._root + check_name(name)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        self._after_fork()
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="ckpt-s3")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- requests and their errors ---------------------------------------------------------

    def _ready(self) -> None:
        """Checks once that the bucket exists and takes ckpt's credentials: the first request
        says clearly what is wrong (a HEAD of a missing object cannot tell a missing bucket)."""
        if self._checked:
            return
        with self._check_lock:
            if self._checked:
                return
            try:
                self._call("HeadBucket", "", None, {})
            except BlobNotFound:
                raise self._no_bucket() from None
            self._checked = True

    def _no_bucket(self) -> StoreNotFound:
        return StoreNotFound(f"there is no bucket {self.bucket!r} at {self.endpoint}",
                             hint=f"create it (e.g. `aws s3 mb s3://{self.bucket}`) or correct the store's URL")

    def _request(self, operation: str, what: str, deadline: float | None = None, **kwargs: Any) -> dict:
        """One S3 request, retried within its budget (see _call); what names the blob (or
        prefix) for messages; deadline (time.monotonic()) overrides the budget."""
        self._after_fork()
        self._ready()
        return self._call(operation, what, deadline, kwargs)

    def _call(self, operation: str, what: str, deadline: float | None, kwargs: dict) -> dict:
        """The request, its transient failures retried with backoff until the deadline (by
        default now + the budget for its body); its failures as typed errors."""
        method = getattr(self._client, _snake(operation))
        body: Any = kwargs.get("Body")
        rewind = body.tell() if hasattr(body, "seek") else None
        if deadline is None:
            deadline = time.monotonic() + self._budget(body)
        attempt = 0
        while True:
            attempt += 1
            if self._unanswered is not None:  # another thread's request spent its budget meanwhile
                raise self._unanswered
            if rewind is not None:
                body.seek(rewind)
            try:
                return method(Bucket=self.bucket, **kwargs) if operation != "HeadBucket" else method(Bucket=self.bucket)
            except ClientError as exc:
                code, status = _code(exc)
                if code in ("NoSuchKey", "NoSuchUpload") or (status == 404 and code in ("404", "NotFound")):
                    raise BlobNotFound(errno.ENOENT, "no such blob", self.where(what)) from None
                if status == 412:
                    raise _PreconditionFailed() from None
                if status == 416:
                    raise _RangeNotSatisfiable() from None
                if code == "NoSuchBucket":
                    raise self._no_bucket() from None
                transient = code in _THROTTLED or status >= 500
                if transient and self._pause_before_retry(attempt, deadline, throttled=code in _THROTTLED):
                    continue
                raise self._typed(exc, operation, self.where(what), attempt) from None
            except BotoCoreError as exc:
                if isinstance(exc, _TRANSIENT) and self._pause_before_retry(attempt, deadline, throttled=False):
                    continue
                if isinstance(exc, _TIMEOUTS):
                    raise self._not_answering(operation, what) from None
                raise self._typed(exc, operation, self.where(what), attempt) from None

    def _budget(self, body) -> float:
        size = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0
        if hasattr(body, "fileno"):
            try:
                size = os.fstat(body.fileno()).st_size
            except (OSError, ValueError):
                size = 0
        return self.timeout + size / MIN_BODY_RATE

    def _pause_before_retry(self, attempt: int, deadline: float, throttled: bool) -> bool:
        """Sleeps before the next attempt and returns True, or False if no attempt is left or
        the pause would reach the deadline."""
        if attempt >= self.attempts:
            return False
        pause = min(20.0, 2.0 ** (attempt - 1)) if throttled else min(2.0, 0.05 * 2 ** attempt)
        pause *= random.uniform(0.5, 1)
        if time.monotonic() + pause >= deadline:
            return False
        time.sleep(pause)
        return True

    def _not_answering(self, operation: str, what: str) -> StoreUnreachable:
        """A request went unanswered for its whole budget: the error, remembered so that no
        later request of this process waits for the same server again."""
        error = StoreUnreachable(
            f"the S3 server at {self.endpoint} did not answer {operation} of {self.where(what)} within "
            f"{self.timeout:g} s",
            hint="check that it runs and can be reached, then run the command again (CKPT_S3_TIMEOUT sets how "
                 "many seconds ckpt waits for it)")
        self._unanswered = error
        return error

    def _typed(self, exc: Exception, operation: str, where: str, attempts: int = 1) -> CkptError:
        """The typed error for a failure botocore did not (or no longer) retry: one line with the fix."""
        at = f"the S3 server at {self.endpoint}"
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoreAccessDenied(f"no AWS credentials found for {self.url()}",
                                     hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if isinstance(exc, (BotoConnectionError, HTTPClientError, urllib3.exceptions.HTTPError)):
            return StoreUnreachable(f"cannot reach {at} ({operation} of {where}): {exc}",
                                    hint="check that it runs and AWS_ENDPOINT_URL (or the profile's endpoint_url); "
                                         "then run the command again")
        if isinstance(exc, ClientError):
            code, status = _code(exc)
            message = exc.response.get("Error", {}).get("Message") or ""
            told = f"{code}{': ' + message if message and message != code else ''}"
            # Before 403: Ceph RGW answers a full quota 403 QuotaExceeded (MinIO: 507).
            if "Quota" in code or "StorageFull" in code or status == 507:
                return DiskFull(f"{at} has no room for {where} ({told})",
                                hint="free space in the bucket (ckpt prune) or raise its quota")
            if code in _DENIED or status == 403:
                return StoreAccessDenied(f"{at} refused access to {where} ({told})",
                                         hint="check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                                              "and the bucket's permissions")
            if code in _THROTTLED or status >= 500:
                return StoreUnreachable(f"{at} kept answering {told} to {operation} of {where} "
                                        f"after {attempts} attempt{'s' if attempts > 1 else ''}",
                                        hint="try again later")
            return StoreError(f"{at} refused {operation} of {where} ({told})")
        return StoreError(f"{operation} of {where} on {at} failed: {exc}")

    # ---- writing ---------------------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        if len(data) > MULTIPART_FROM:
            with self.writer(name) as out:
                out.write(data)
                out.commit()
            return
        self._request("PutObject", name, Key=self._key(name), Body=bytes(data))

    def put_if_absent(self, name: str, data: bytes) -> None:
        key = self._key(name)
        data = bytes(data)
        for attempt in range(MAX_ATTEMPTS):
            try:
                self._request("PutObject", name, Key=key, Body=data, IfNoneMatch="*")
                return
            except _PreconditionFailed:
                # Ours, if botocore retried a PUT whose first answer was lost: the same bytes
                # are there (a manifest names its host, pid and time: another writer's differ).
                try:
                    if self.get(name) == data:
                        return
                except BlobNotFound:
                    continue  # deleted in between: try again
                raise BlobExists(errno.EEXIST, "blob exists", self.where(name)) from None
            except StoreError as exc:
                # 409 ConditionalRequestConflict (AWS): a concurrent conditional write to the
                # key is in progress; retried, it ends in 412 or success.
                if "ConditionalRequestConflict" not in str(exc) or attempt == MAX_ATTEMPTS - 1:
                    raise
                time.sleep(0.1 * 2 ** attempt * random.random())

    def put_file(self, name: str, source: Path) -> int:
        size = os.stat(source).st_size
        if size > MULTIPART_FROM:
            with open(source, "rb") as src, self.writer(name) as out:
                while chunk := src.read(self.part_size):
                    out.write(chunk)
                out.commit()
        else:
            with open(source, "rb") as src:  # seekable: botocore rewinds it to retry
                self._request("PutObject", name, Key=self._key(name), Body=src)
        os.unlink(source)  # consumed, as the local backend's rename consumes it
        return size

    def writer(self, name: str) -> BlobWriter:
        return _S3Writer(self, name)

    # ---- reading ---------------------------------------------------------------------------

    def _fetch(self, name: str, start: int, end: int, etag: str | None = None,
               sink: Callable[[int, bytes], None] | None = None) -> tuple[list[bytes], int | None, str | None]:
        """Bytes start..end (inclusive) of the blob: (pieces, the blob's size, its ETag), or
        ([], None, None) if start is at or past its end. A body cut midway is asked again (the
        range, at most a part: botocore retries a request, not the reading of its body). With
        etag, the blob must still be that version (If-Match).
        With sink, pieces go to sink(offset, piece) instead of the list."""
        key = self._key(name)
        pieces: builtins.list[bytes] = []
        position, failures = start, 0
        total = None
        deadline = time.monotonic() + self.timeout  # the request and the reading of its body
        while position <= end:
            kwargs = {"Key": key, "Range": f"bytes={position}-{end}"}
            if etag:
                kwargs["IfMatch"] = etag
            try:
                response = self._request("GetObject", name, deadline, **kwargs)
            except _RangeNotSatisfiable:
                if position == start:
                    return [], None, None
                break
            except _PreconditionFailed:
                raise StoreError(f"{self.where(name)} changed while it was read",
                                 hint="blobs are immutable: another program wrote it; run `ckpt verify`") from None
            total = _total_size(response, position)
            etag = etag or response.get("ETag")
            body = response["Body"]
            try:
                # One read of the whole range (at most a part): reading it in chunks and joining
                # them was half as fast (380 against 720 MiB/s from a local server).
                piece = body.read()  # botocore raises IncompleteReadError if it is short
                if position + len(piece) <= min(end, total - 1):
                    raise IncompleteReadError(actual_bytes=len(piece), expected_bytes=end - position + 1)
                if sink is not None:
                    sink(position, piece)
                else:
                    pieces.append(piece)
                position += len(piece)
                break
            except _STREAM_ERRORS as exc:
                failures += 1
                time.sleep(self._pause_before_reading_again(name, exc, failures, deadline))
            finally:
                body.close()
        return pieces, total, etag

    def _pause_before_reading_again(self, name: str, exc: Exception, failures: int, deadline: float) -> float:
        """How long to wait before asking again for a body cut midway (random, growing), or the
        error to raise when that was the last try or the deadline would pass meanwhile."""
        pause = min(2.0, 0.05 * 2 ** failures) * random.random()
        if time.monotonic() + pause >= deadline and isinstance(exc, (ReadTimeoutError, TimeoutError)):
            raise self._not_answering("GetObject", name) from None
        if failures > STREAM_RETRIES or time.monotonic() + pause >= deadline:
            raise self._typed(exc if isinstance(exc, BotoCoreError) else ConnectionClosedError(
                endpoint_url=self.endpoint), "GetObject", self.where(name)) from None
        return pause

    def _read_ranges(self, name: str, offset: int, end: int | None,
                     sink: Callable[[int, bytes], None] | None = None,
                     part: int | None = None) -> tuple[list[bytes], int | None]:
        """Bytes offset..end (exclusive; None: to the blob's end) as pieces, the first range
        asked alone (its answer tells the size), the rest in parallel ranges of part (default:
        part_size). With sink, each range goes to sink(offset, bytes) instead, whole."""
        part = part or self.part_size
        first_end = offset + part if end is None else min(end, offset + part)
        pieces, total, etag = self._fetch(name, offset, first_end - 1, sink=sink)
        if total is None:
            return [], None
        end = total if end is None else min(end, total)
        done = offset + sum(len(p) for p in pieces) if sink is None else min(first_end, end)
        if done >= end:
            return pieces, total
        pool = self._executor()
        futures = [pool.submit(self._fetch, name, start, min(start + part, end) - 1, etag, sink)
                   for start in range(done, end, part)]
        try:
            for future in futures:
                pieces.extend(future.result()[0])
        except BaseException:
            # Every range has ended before this returns: a sink writing into a file must not
            # run after its caller closed the file.
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            raise
        return pieces, total

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is not None and length <= 0:
            self.stat(name)  # BlobNotFound as for any other read
            return b""
        pieces, _ = self._read_ranges(name, offset, None if length is None else offset + length)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def get_sized(self, name: str, offset: int, length: int) -> tuple[bytes, int]:
        pieces, total = self._read_ranges(name, offset, offset + length)
        if total is None:  # (offset at or past the end: no range tells the size)
            return b"", self.stat(name).size
        return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), total

    def get_parts(self, name: str, part: int, sink: Callable[[int, bytes], None], offset: int = 0) -> int:
        _, total = self._read_ranges(name, offset, None, sink=sink, part=part)
        return 0 if total is None else total - offset

    def get_file(self, name: str, dest: Path) -> None:
        with new_file(dest) as fd:
            self.get_parts(name, self.part_size, lambda offset, piece: pwrite_all(fd, piece, offset))

    def held_locally(self, name: str) -> bool:
        return False

    def stat(self, name: str) -> BlobInfo:
        response = self._request("HeadObject", name, Key=self._key(name))
        return BlobInfo(name, int(response["ContentLength"]), _epoch(response.get("LastModified")))

    def list(self, prefix: str, incomplete: bool = False) -> builtins.list[BlobInfo]:
        if incomplete:
            return self._list_uploads(prefix)
        return sorted(self._list_objects(prefix)[0], key=lambda info: info.name)

    def _list_objects(self, prefix: str) -> tuple[builtins.list[BlobInfo], float | None]:
        """The blobs under prefix, and the server's time of the last answer (by its Date)."""
        found, token, now = [], None, None
        while True:
            kwargs: dict[str, Any] = {"Prefix": self._root + prefix, "MaxKeys": self.page_size}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._request("ListObjectsV2", prefix or "/", **kwargs)
            now = _server_time(page)
            for item in page.get("Contents", []):
                name = item["Key"][len(self._root):]
                if _valid(name):  # not a "dir/" marker some tools create, nor a foreign key
                    found.append(BlobInfo(name, int(item["Size"]), _epoch(item.get("LastModified"))))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found, now

    def _list_uploads(self, prefix: str) -> builtins.list[BlobInfo]:
        found, key_marker, id_marker = [], None, None
        while True:
            kwargs: dict[str, Any] = {"Prefix": self._root + prefix, "MaxUploads": self.page_size}
            if key_marker:
                kwargs["KeyMarker"] = key_marker
                if id_marker:
                    kwargs["UploadIdMarker"] = id_marker
            page = self._request("ListMultipartUploads", prefix or "/", **kwargs)
            for upload in page.get("Uploads", []):
                name = upload["Key"][len(self._root):]
                if not _valid(name):
                    continue
                head, _, last = name.rpartition("/")
                encoded = base64.urlsafe_b64encode(upload["UploadId"].encode()).decode().rstrip("=")
                leftover = f"{head + '/' if head else ''}.{last}.{encoded}{_UPLOAD_SUFFIX}"
                found.append(BlobInfo(leftover, self._upload_size(name, upload["UploadId"]),
                                      _epoch(upload.get("Initiated"))))
            if not page.get("IsTruncated"):
                return sorted(found, key=lambda info: info.name)
            key_marker, id_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
            if not key_marker:
                return sorted(found, key=lambda info: info.name)

    def _upload_size(self, name: str, upload_id: str) -> int:
        size, marker = 0, 0
        while True:
            try:
                page = self._request("ListParts", name, Key=self._key(name), UploadId=upload_id,
                                     PartNumberMarker=marker)
            except BlobNotFound:  # completed or aborted since it was listed
                return size
            size += sum(int(part["Size"]) for part in page.get("Parts", []))
            if not page.get("IsTruncated"):
                return size
            marker = int(page.get("NextPartNumberMarker") or 0)
            if not marker:
                return size

    # ---- deleting --------------------------------------------------------------------------

    def delete(self, names: builtins.list[str]) -> None:
        keys = []
        for name in names:
            upload = _parse_upload(name)
            if upload is not None:
                blob, upload_id = upload
                try:
                    self._request("AbortMultipartUpload", blob, Key=self._key(blob), UploadId=upload_id)
                except BlobNotFound:
                    pass
            else:
                keys.append(self._key(name))
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            response = self._request("DeleteObjects", batch[0][len(self._root):],
                                     Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True})
            errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise self._typed(ClientError({"Error": {"Code": first.get("Code", "?"),
                                                         "Message": first.get("Message", "")},
                                               "ResponseMetadata": {"HTTPStatusCode": 400}}, "DeleteObjects"),
                                  "DeleteObjects", self.where(first.get("Key", "?")[len(self._root):]))

    # ---- locking ---------------------------------------------------------------------------

    @contextmanager
    def lock(self, exclusive: bool, timeout: float,
             on_wait: Callable[[builtins.list[LockOwner]], None] | None = None) -> Iterator[_HeldLock]:
        """Lock objects (see "Storage backends" in docs/design.md): write ours, then list the
        others; a conflicting live one means ours is deleted again and the attempt repeated
        after a random pause. Of two conflicting lockers the later writer always sees the
        earlier one's object (S3 lists are consistent after a write), so both cannot win."""
        mode = "exclusive" if exclusive else "shared"
        name = f"{LOCKS_PREFIX}{secrets.token_hex(8)}.json"
        record = _lock_record(mode, self.lock_ttl)
        data = json.dumps(record).encode()
        deadline = time.monotonic() + timeout
        pause, told = 0.1, False
        while True:
            self.put(name, data)
            conflicts = [live for _, live in self._lock_objects(besides=name) if exclusive or live.mode == "exclusive"]
            if not conflicts:
                break
            self._release(name)
            if not told and on_wait is not None:
                on_wait(conflicts)
                told = True
            left = deadline - time.monotonic()
            if left <= 0:
                who = ", ".join(owner.describe() for owner in conflicts)
                raise StoreBusy(f"the store at {self.url()} is locked by {who}",
                                hint=f"waited {timeout:.0f} s; try again later or raise CKPT_LOCK_TIMEOUT")
            time.sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(pause * 2, 2.0)
        held = _HeldLock(self, name, data)
        try:
            yield held
        finally:
            held.stop()
            self._release(name)

    def _release(self, name: str) -> None:
        try:
            self.delete([name])
        except CkptError:
            pass  # unreachable now: the object goes stale after lock_ttl

    def _lock_objects(self, besides: str | None = None) -> builtins.list[tuple[str, LockOwner]]:
        """The live lock objects (name, owner) but the one named besides (ours: not read, a
        request saved); stale ones are deleted on the way."""
        infos, now = self._list_objects(LOCKS_PREFIX)
        now = now if now is not None else time.time()
        live, stale = [], []
        for info in infos:
            if info.name == besides:
                continue
            try:
                record = json.loads(self.get(info.name))
                owner = LockOwner(pid=int(record["pid"]), host=str(record["host"]), command=str(record["command"]),
                                  since=str(record["since"]), mode=str(record["mode"]))
                ttl = float(record.get("ttl", LOCK_TTL))
            except BlobNotFound:
                continue  # released in between
            except (ValueError, KeyError, TypeError):
                record, owner, ttl = {}, None, LOCK_TTL  # not ours to read: judged by its age alone
            age = now - (info.modified or now)
            if age > ttl or _owner_gone(record):
                stale.append(info.name)
            elif owner is not None:
                live.append((info.name, owner))
        if stale:
            self.delete(stale)
        return live

    def lock_holders(self) -> builtins.list[LockOwner]:
        me = (socket.gethostname(), os.getpid())
        return [owner for _, owner in self._lock_objects() if (owner.host, owner.pid) != me]


class _HeldLock:
    """A held lock object, refreshed (written again: a new LastModified) every lock_ttl / 5 by a
    thread. lost is set when the object vanished (another locker found it stale and deleted
    it) or could not be refreshed for lock_ttl: the holder should then stop before its next
    commit point."""

    def __init__(self, backend: S3Backend, name: str, data: bytes):
        self._backend, self._name, self._data = backend, name, data
        self.refreshed = time.monotonic()
        self.lost = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="ckpt-s3-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        interval = self._backend.lock_ttl / 5
        while not self._stopped.wait(interval):
            try:
                if not self._backend.exists(self._name):
                    self.lost.set()
                    return
                self._backend.put(self._name, self._data)
                self.refreshed = time.monotonic()
            except CkptError:
                if time.monotonic() - self.refreshed > self._backend.lock_ttl:
                    self.lost.set()
                    return

    def still_held(self) -> bool:
        """Checked right before a commit point (a manifest, prune's deletions): the lock object
        is still ours and was refreshed well within its TTL, so no other locker can have taken
        it for stale. One HEAD request; a server that does not answer it is the command's
        failure (StoreUnreachable, exit 9), not a lost lock."""
        if self.lost.is_set() or time.monotonic() - self.refreshed > self._backend.lock_ttl * 0.8:
            return False
        try:
            return self._backend.exists(self._name)
        except StoreUnreachable:
            raise
        except CkptError:
            return False

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class _S3Writer(BufferedBlobWriter):
    """A multipart upload: each part is uploaded (in the backend's thread pool, at most
    `concurrency` at a time) as soon as it is complete; commit() uploads the rest and completes
    the upload, which makes the blob appear whole. A blob smaller than a part is one PUT."""

    def __init__(self, backend: S3Backend, name: str):
        super().__init__()
        self._backend = backend
        self._name = name
        self._key = backend._key(name)
        self._upload_id: str | None = None
        self._parts: dict[int, concurrent.futures.Future] = {}

    def _part_size(self) -> int:
        return self._backend.part_size << (len(self._parts) // PARTS_PER_SIZE)

    def write(self, data) -> None:
        if self._finished:
            raise ValueError("write to a finished blob writer")
        self._buffer += data
        self.written += len(data)
        while len(self._buffer) >= self._part_size():
            size = self._part_size()
            with memoryview(self._buffer) as view:
                part = bytes(view[:size])
            del self._buffer[:size]
            self._send(part)

    def _send(self, part: bytes) -> None:
        backend = self._backend
        if self._upload_id is None:
            self._upload_id = backend._request("CreateMultipartUpload", self._name, Key=self._key)["UploadId"]
        # Bounds the parts held in memory; surfaces a failed part at the next write.
        pending = {f for f in self._parts.values() if not f.done()}
        while len(pending) >= backend.concurrency:
            _, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in self._parts.values():
            if future.done() and (failure := future.exception()) is not None:
                raise failure
        number = len(self._parts) + 1
        self._parts[number] = backend._executor().submit(self._upload_part, number, part)

    def _upload_part(self, number: int, part: bytes) -> str:
        return self._backend._request("UploadPart", self._name, Key=self._key, UploadId=self._upload_id,
                                      PartNumber=number, Body=part)["ETag"]

    def _complete(self) -> None:
        if self._upload_id is None:
            self._backend._request("PutObject", self._name, Key=self._key, Body=bytes(self._buffer))
            return
        if self._buffer:
            self._send(bytes(self._buffer))
        parts = [{"PartNumber": number, "ETag": future.result()} for number, future in sorted(self._parts.items())]
        self._backend._request("CompleteMultipartUpload", self._name, Key=self._key,
                               UploadId=self._upload_id, MultipartUpload={"Parts": parts})

    def _drop(self) -> None:
        for future in self._parts.values():
            future.cancel()
        # Parts still uploading finish first: aborted before, they could leave parts behind.
        concurrent.futures.wait(list(self._parts.values()))
        if self._upload_id is not None:
            try:
                self._backend._request("AbortMultipartUpload", self._name, Key=self._key, UploadId=self._upload_id)
            except (CkptError, OSError):
                pass  # never raises (it runs on the way out of errors); prune removes the upload later


# ---- helpers -------------------------------------------------------------------------------

def _snake(operation: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", operation).lower()  # ListObjectsV2 -> list_objects_v2


def _code(exc: ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return str(error.get("Code") or status), int(status)


def _valid(name: str) -> bool:
    try:
        check_name(name)
    except ValueError:
        return False
    return True


def _parse_upload(name: str) -> tuple[str, str] | None:
    """(blob name, upload id) of a name list(incomplete=True) gave; None for a blob's name."""
    head, _, last = name.rpartition("/")
    if not (last.startswith(".") and last.endswith(_UPLOAD_SUFFIX)):
        return None
    blob, _, encoded = last[1:-len(_UPLOAD_SUFFIX)].rpartition(".")
    try:
        upload_id = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"invalid blob name {name!r}") from None
    blob = f"{head}/{blob}" if head else blob
    check_name(blob)
    return blob, upload_id


def _total_size(response: dict, start: int) -> int:
    content_range = response.get("ContentRange") or ""  # "bytes 0-99/1234"
    if "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rpartition("/")[2])
    return start + int(response.get("ContentLength") or 0)


def _epoch(when: datetime | None) -> float | None:
    return when.timestamp() if when is not None else None


def _server_time(response: dict) -> float | None:
    """The server's clock (its Date header): lock ages are measured by it, not by ours."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with
    the pid, it names a process, where a pid alone may have been reused."""
    try:
        return str(procfs.start_ticks(pid))
    except (OSError, ValueError, IndexError):
        return None


def _this_system() -> dict:
    """What tells whether a lock's pid can be checked here: the same host, boot and pid
    namespace (a container of the same name has its own pids)."""
    try:
        boot_id = procfs.boot_id()
    except OSError:
        boot_id = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "boot_id": boot_id, "pidns": pidns}


def _lock_record(mode: str, ttl: float) -> dict:
    owner = LockOwner(pid=os.getpid(), host=socket.gethostname(), command=" ".join(sys.argv[:3]) or "ckpt",
                      since=datetime.now(timezone.utc).isoformat(timespec="seconds"), mode=mode)
    system = _this_system()
    return {**owner.to_json(), "boot_id": system["boot_id"], "pidns": system["pidns"],
            "start": _process_start(os.getpid()), "ttl": ttl}


def _owner_gone(record: dict) -> bool:
    """True if the lock's process is known to be gone: it ran on this system (host, boot, pid
    namespace) and no process of its pid and start time runs now. Elsewhere, only the lock's
    age tells."""
    if not record or not record.get("boot_id") or not record.get("start"):
        return False
    system = _this_system()
    if (record.get("host"), record.get("boot_id"), record.get("pidns")) != \
            (system["host"], system["boot_id"], system["pidns"]):
        return False
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    return _process_start(pid) != record["start"]
