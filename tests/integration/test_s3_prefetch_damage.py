"""One damaged chunk of an encrypted pack in S3, verified through the prefetcher (ranges of
several segments): only the segment holding it is damaged (and recorded), not its whole range."""
from __future__ import annotations

import json

import pytest

from tests.conftest import S3_BUCKET
from tests.helpers import ckpt, ckpt_json, wait_until
from tests.integration import test_s3_store
from tests.integration.test_s3_store import sums

s3_store = test_s3_store.s3_store
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("s3_store")]


def test_one_damaged_chunk_is_reported_once(procs, tmp_path, s3_server, s3_url):
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 48)
    wait_until(lambda: sums(out), timeout=60, what="bigmem")
    dumped = ckpt_json("dump", big.pid)["id"]
    procs.kill_tree(big.pid)
    client = s3_server.client()
    prefix = s3_url[len(f"s3://{S3_BUCKET}/"):] + "/packs/"
    packs = [(o["Size"], o["Key"]) for p in client.get_paginator("list_objects_v2").paginate(
        Bucket=S3_BUCKET, Prefix=prefix) for o in p.get("Contents", [])]
    size, key = max(packs)
    body = bytearray(client.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read())
    body[size // 2] ^= 0xFF
    client.put_object(Bucket=S3_BUCKET, Key=key, Body=bytes(body))
    proc = ckpt("verify", dumped, "--json", check=False, env={"CKPT_CACHE": str(tmp_path / "fresh")})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    problems = [problem for checked in json.loads(proc.stdout) for problem in checked["problems"]]
    # One 256 KiB chunk lies in one segment (two at most, across a boundary); without the
    # segments fetched again one by one, the 8 MiB range's 8 segments were all damaged.
    assert len(problems) == 1 and "fails authentication" in problems[0], problems
    assert "more damaged segments" not in problems[0] or "(and 1 more damaged segments)" in problems[0], problems
