"""A warm standby (`ckpt cache warm`, ckpt/commands/cache_warm.py): a fresh cache warmed from a
real S3 server (SeaweedFS) serves a whole restore, lazy page server included, without one
download of content from the bucket, counted by a relay in front of the server
(tests/s3count.py); warming again downloads nothing; a cap too small is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests import jsonshape
from tests.helpers import alive, ckpt, ckpt_json, wait_until
from tests.integration.test_s3_store import report, s3_store, sums  # noqa: F401 - s3_store: a fixture
from tests.s3count import CountingRelay

pytestmark = pytest.mark.integration

MiB = 1 << 20
CONTENT = ("packs", "objects", "index")


def blobs_in(cache: Path, kind: str) -> list[Path]:
    """The copies of that kind (packs, objects, index) in a cache directory, temp files aside."""
    return [p for p in cache.glob(f"stores/*/blobs/{kind}/**/*") if p.is_file() and not p.name.startswith(".")]


def test_a_warmed_standby_restores_without_downloading_content(s3_store, s3_server, procs, tmp_path):  # noqa: F811
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 72)  # lazy by default (64 MiB and more): the page server reads too
    wait_until(lambda: sums(out), timeout=30, what="bigmem")
    before = report(big.pid, out)  # then dumped: the restored counter goes on from at least there
    first = ckpt_json("dump", big.pid, "--name", "big")

    # A cap too small: one line, exit 2, no pack downloaded.
    small = tmp_path / "small-cache"
    refused = ckpt("cache", "warm", "big", "-q", check=False, env={"CKPT_CACHE": str(small), "CKPT_CACHE_SIZE": "16M"})
    assert refused.returncode == 2, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "CKPT_CACHE_SIZE" in refused.stderr, refused.stderr
    assert blobs_in(small, "packs") == []

    standby = {"CKPT_CACHE": str(tmp_path / "standby-cache")}
    warmed = ckpt_json("cache", "warm", "big", env=standby)
    jsonshape.assert_shape(warmed, "cache warm")
    assert [c["id"] for c in warmed["checkpoints"]] == [first["id"]]
    assert warmed["fetched_blobs"] == warmed["blobs"] > 0 and warmed["cached_blobs"] == 0
    assert warmed["fetched_bytes"] == warmed["bytes"] >= 72 * MiB  # random memory: stored as it is
    assert blobs_in(tmp_path / "standby-cache", "packs")

    # The next checkpoint (its memory unchanged): only what it added comes down, then nothing.
    second = ckpt_json("dump", big.pid, "--name", "big")
    procs.kill_tree(big.pid)
    newer = ckpt_json("cache", "warm", "big", env=standby)
    assert [c["id"] for c in newer["checkpoints"]] == [second["id"]]
    assert 0 < newer["fetched_bytes"] < MiB and newer["cached_bytes"] >= 72 * MiB, newer
    again = ckpt_json("cache", "warm", "big", env=standby)
    assert again["fetched_blobs"] == again["fetched_bytes"] == 0
    assert again["cached_blobs"] == again["blobs"] == newer["blobs"] and again["bytes"] == newer["bytes"]

    # The failover: restore on the standby, every request to the bucket counted.
    upstream = urlsplit(s3_server.endpoint)
    relay = CountingRelay((upstream.hostname, upstream.port))
    try:
        restored = ckpt("restore", "big", "--json", env={**standby, "AWS_ENDPOINT_URL": relay.endpoint})
        result = json.loads(restored.stdout)
        procs.adopt(result["pid"])
        assert result["lazy"] is not None, "restored eagerly: the page server's reads go untested"
        checksum, counter = report(result["pid"], out)  # the tree sums all its memory: every page is in
        server = result["lazy"]["server_pid"]
        wait_until(lambda: not alive(server), timeout=60, what="the page server to finish")
    finally:
        relay.stop()
    assert checksum == before[0], "the restored memory differs from the checkpoint's"
    assert counter >= before[1], "the counter started again"
    assert relay.unparsed == 0 and relay.requests, "the relay did not see the restore's requests whole"
    downloads = [r for r in relay.requests if r.method == "GET" and any(f"/{kind}/" in r.path for kind in CONTENT)]
    assert downloads == [], f"the restore downloaded content from the bucket: {downloads[:5]}"


def test_bad_references_and_a_cache_turned_off_are_one_line(s3_store, tmp_path):  # noqa: F811
    missing = ckpt("cache", "warm", "nosuch", check=False)
    assert missing.returncode == 3 and "nosuch" in missing.stderr, missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    off = ckpt("cache", "warm", "latest", check=False, env={"CKPT_CACHE_SIZE": "0"})
    assert off.returncode == 2 and "CKPT_CACHE_SIZE=0" in off.stderr, off.stderr
    assert len(off.stderr.strip().splitlines()) == 1, off.stderr
    assert not os.path.exists(tmp_path / "cache" / "stores" / "blobs")
