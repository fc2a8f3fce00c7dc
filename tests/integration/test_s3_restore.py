"""Lazy restores from a store in S3 (a real SeaweedFS server) on another host, with an empty
cache: the page server fetches the tree's segments ahead in large parallel requests
(ckpt/store/blocks/prefetch.py), each once; the tree checks its own memory; a server stopped
for 10 s mid-fetch is waited for, a killed one ends the tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.restore.lazy import page_server_stats
from ckpt.settings import Settings
from tests.helpers import ROOT, alive, ckpt, ckpt_json, wait_until
from tests.integration import test_s3_store
from tests.integration.test_s3_store import on_another_host, report, sums

s3_store = test_s3_store.s3_store  # the fixture: an encrypted store at a fresh prefix, CKPT_STORE naming it
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("s3_store")]

PAGE = 4096
# Of the random memory, what may come down with the layout rather than the page server or the
# copy: a segment or two that also hold pages CRIU restores before the tree runs.
LAID_OUT_MIB = 2
LAZY_DIR = Settings().lazy_dir


def dumped_bigmem(procs, tmp_path: Path, mib: int) -> tuple[str, str, Path]:
    """A bigmem of mib MiB of random memory dumped and killed: (checkpoint id, its checksum, its report file)."""
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, mib)
    wait_until(lambda: sums(out), timeout=60, what="bigmem")
    checksum = sums(out)[-1][0]
    dumped = ckpt_json("dump", big.pid)["id"]
    procs.kill_tree(big.pid)
    return dumped, checksum, out


def final_stats(restored: dict) -> dict:
    lazy = restored["lazy"]
    work_dir = Path(lazy["log"]).parent
    # (the final figures, with "fetches", are written once the server is done)
    wait_until(lambda: "fetches" in (page_server_stats(lazy["server_pid"], work_dir, LAZY_DIR) or {}),
               timeout=120, what="the page server to end")
    stats = page_server_stats(lazy["server_pid"], work_dir, LAZY_DIR)
    assert stats is not None and "fetches" in stats, stats
    return stats


def test_a_256_mib_tree_from_s3_gets_its_segments_once_in_large_requests(procs, tmp_path):
    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 256)
    restored = on_another_host(["restore", dumped, "--lazy", "--json"], tmp_path / "cache-b", tmp_path / "cache")
    assert restored.returncode == 0, restored.stderr
    result = json.loads(restored.stdout)
    procs.adopt(result["pid"])
    assert report(result["pid"], out)[0] == checksum, "the restored memory differs from the checkpoint's"

    stats = final_stats(result)
    assert stats["status"] == "done" and stats["pages_served"] == stats["pages_total"] >= (200 << 20) // PAGE
    fetches = stats["fetches"]
    assert stats["store_requests"] == len(fetches) and stats["bytes_fetched"] == sum(f[2] for f in fetches)
    # The random memory is stored as it is (the rest compressed): every byte of it came down
    # once, through the page server but for a segment that also holds pages restored before the
    # tree runs (fetched with the layout, as 1 MiB of the image's first 2 MiB was in one run).
    assert (256 - LAID_OUT_MIB) << 20 <= stats["bytes_fetched"] <= stats["pages_total"] * PAGE
    by_pack: dict[str, list[tuple[int, int]]] = {}
    for pack, offset, length, segments in fetches:
        by_pack.setdefault(pack, []).append((offset, offset + length))
        assert length > PAGE or (segments == 1 and length <= PAGE), (pack, offset, length, segments)
    for pack, spans in by_pack.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, f"pack {pack}: bytes {start}..{end} fetched twice"
    # Coalesced: far fewer requests than 1 MiB segments.
    assert len(fetches) <= stats["bytes_fetched"] / (2 << 20) + 4, len(fetches)
    assert stats["last_page_s"] is not None and stats["all_fetched_s"] is not None

    # The spooled packs were made whole and kept in that host's cache: a next restore there
    # downloads no page.
    procs.kill_tree(result["pid"])
    again = on_another_host(["restore", dumped, "--lazy", "--json"], tmp_path / "cache-b", tmp_path / "cache")
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    procs.adopt(second["pid"])
    assert report(second["pid"], out)[0] == checksum
    assert final_stats(second)["store_requests"] == 0


def restore_while(action, procs, tmp_path: Path, dumped: str) -> tuple[subprocess.Popen, dict]:
    """`ckpt restore --lazy` on another host, and action() called as soon as its page server's
    record appears (the prefetch starting); returns the command and the live figures read
    2 s after action()."""
    script = (f"mount -t tmpfs -o mode=0700 none {tmp_path / 'cache'} && hostname other-host && "
              f"exec {sys.executable} -m ckpt restore {dumped} --lazy --json")
    command = subprocess.Popen(["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script],
                               cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "CKPT_CACHE": str(tmp_path / "cache-b")})

    def record() -> dict | None:
        for path in LAZY_DIR.glob("*.json") if LAZY_DIR.is_dir() else []:
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if found.get("checkpoint") == dumped:
                return found
        return None

    wait_until(lambda: record() is not None or command.poll() is not None, timeout=60, interval=0.01,
               what="the page server")
    assert command.poll() is None, command.communicate()
    action()
    time.sleep(2)
    live = (record() or {}).get("stats") or {}
    return command, live


def test_a_server_stopped_for_10_s_mid_fetch_is_waited_for(s3_server, procs, tmp_path):
    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 256)
    server = s3_server.process.pid
    try:
        command, live = restore_while(lambda: os.kill(server, signal.SIGSTOP), procs, tmp_path, dumped)
        assert "pages_total" in live and live["bytes_fetched"] < live["pages_total"] * PAGE, f"not mid-fetch: {live}"
        time.sleep(8)
    finally:
        os.kill(server, signal.SIGCONT)
    stdout, stderr = command.communicate(timeout=120)
    assert command.returncode == 0, stderr
    result = json.loads(stdout)
    procs.adopt(result["pid"])
    assert report(result["pid"], out)[0] == checksum, "the restored memory differs from the checkpoint's"
    assert final_stats(result)["status"] == "done"


def test_a_server_killed_mid_fetch_ends_the_tree_and_the_failure_is_recorded(s3_server, procs, tmp_path):
    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 256)
    try:
        command, live = restore_while(s3_server.stop, procs, tmp_path, dumped)
        assert "pages_total" in live and live["bytes_fetched"] < live["pages_total"] * PAGE, f"not mid-fetch: {live}"
        stdout, stderr = command.communicate(timeout=120)
        if command.returncode == 0:  # the tree ran before the page server gave up: it must be ended
            pid = json.loads(stdout)["pid"]
            procs.adopt(pid)
            os.kill(pid, signal.SIGUSR1)  # it sums its memory: faults in every page
            wait_until(lambda: not alive(pid), timeout=60, what="the tree to be ended")
        else:
            assert "Traceback" not in stderr, stderr
        assert all(line[0] == checksum for line in sums(out)), "the tree ran on memory never filled in"
    finally:
        s3_server.restart()
    listed = ckpt("list", "--json", env={"CKPT_CACHE": str(tmp_path / "cache-b")})
    assert [row["lazy_restore_failures"] for row in json.loads(listed.stdout)] == [1], listed.stdout


def test_an_eager_restore_from_s3_fetches_ahead_and_copies_every_page_in(procs, tmp_path):
    """A full restore from S3 (--eager: the memory copied in through userfaultfd before the tree
    runs) fetches the segments ahead in large requests, as a lazy one does."""
    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 64)
    restored = on_another_host(["restore", dumped, "--eager", "--json"], tmp_path / "cache-b", tmp_path / "cache")
    assert restored.returncode == 0, restored.stderr
    result = json.loads(restored.stdout)
    procs.adopt(result["pid"])
    filled = result["filled"]
    assert result["lazy"] is None and filled is not None and filled["pages"] >= (64 << 20) // PAGE, result
    assert (64 - LAID_OUT_MIB) << 20 <= filled["bytes_fetched"]  # (see the 256 MiB test)
    assert 0 < filled["store_requests"] <= filled["bytes_fetched"] / (1 << 20)
    assert report(result["pid"], out)[0] == checksum, "the restored memory differs from the checkpoint's"


def test_a_tree_restored_in_full_from_s3_downloads_its_pack_whole_once_then_copies_every_page_in(procs, tmp_path,
                                                                                               s3_server):
    """A worker pool restored from S3 (in full: its children share their parent's memory)
    reads many segments of its pack while it lays out the pages images (the root's, whole):
    the pack comes down whole into the cache first, in large parallel parts, each byte asked
    for once (counted by a relay in front of the server), its small images and page lists in
    one request (the bundle its dump wrote), then the pages images are written
    and the rest copied into the tree from that copy: nothing more is fetched for the copy.
    Every child comes back with its memory intact and counts on."""
    import itertools
    import re
    from urllib.parse import urlsplit

    from tests.integration import test_many_processes as pool
    from tests.s3count import CountingRelay

    root, out, pids = pool.start_pool(procs, tmp_path)
    before = pool.reports(out, root.pid)
    dumped = pool.dump_and_end(root.pid, pids, popen=root)["id"]
    upstream = urlsplit(s3_server.endpoint)
    relay = CountingRelay((upstream.hostname, upstream.port))
    try:
        restored = ckpt("restore", dumped, "--eager", "--json",
                        env={"AWS_ENDPOINT_URL": relay.endpoint, "CKPT_CACHE": str(tmp_path / "cache-b")})
    finally:
        relay.stop()
    assert restored.returncode == 0, restored.stderr
    result = json.loads(restored.stdout)
    procs.adopt(result["pid"])
    assert re.search(r"download(ing|ed) \d+ pack\(s\) of the checkpoint whole", restored.stderr), restored.stderr
    filled = result["filled"]
    assert result["lazy"] is None and filled is not None and filled["pages"] >= pool.CHILDREN * (pool.MIB << 20) // PAGE
    assert filled["bytes_fetched"] == 0 and filled["store_requests"] == 0, filled
    assert relay.unparsed == 0
    # Its hundred-odd small images and page lists came in one request: the dump's bundle.
    assert re.search(r"read \d+ of the checkpoint's small images in one request", restored.stderr), restored.stderr
    gets = [r.path for r in relay.requests if r.method == "GET"]
    assert len([path for path in gets if "/bundles/" in path]) == 1, gets
    assert len([path for path in gets if "/objects/" in path]) <= 2, gets
    asked: dict[str, list[tuple[int, int]]] = {}
    for request in relay.requests:
        if request.method == "GET" and "/packs/" in request.path:
            match = re.fullmatch(r"bytes=(\d+)-(\d+)", request.range or "")
            assert match, request
            asked.setdefault(request.path, []).append((int(match[1]), int(match[2]) + 1))
    assert sum(end - start for ranges in asked.values() for start, end in ranges) >= pool.CHILDREN * pool.MIB << 20
    for pack, ranges in asked.items():
        ranges.sort()
        assert ranges[0][0] == 0, (pack, ranges)
        # (the first request asks for one byte more than it keeps: whether the blob goes on)
        assert all(end <= start + 1 for (_, end), (start, _) in itertools.pairwise(ranges)), f"asked twice: {ranges}"
        # Large parts (16 MiB): a few per pack, not a request per segment.
        assert len(ranges) <= 2 + ranges[-1][1] // (16 << 20), (pack, ranges)
    pool.check_restored(result, out, pids, before)


def test_copy_and_verify_of_an_s3_store_fetch_ahead_in_large_requests(procs, tmp_path, s3_server):
    """`ckpt copy` out of S3 and `ckpt verify` of it read the segments through the prefetcher:
    a few large range requests, counted by a relay in front of the server."""
    from urllib.parse import urlsplit

    from tests.s3count import CountingRelay

    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 48)
    upstream = urlsplit(s3_server.endpoint)
    relay = CountingRelay((upstream.hostname, upstream.port))
    copied_to = tmp_path / "local"
    try:
        env = {"AWS_ENDPOINT_URL": relay.endpoint, "CKPT_CACHE": str(tmp_path / "fresh-cache")}
        assert ckpt("verify", dumped, env=env).returncode == 0
        verified = [r for r in relay.requests if r.method == "GET" and "/packs/" in r.path]
        assert ckpt("copy", dumped, "--to", copied_to, env={**env, "CKPT_CACHE": str(tmp_path / "cache-2")}
                    ).returncode == 0
        copied = [r for r in relay.requests if r.method == "GET" and "/packs/" in r.path][len(verified):]
    finally:
        relay.stop()
    assert relay.unparsed == 0
    for requests in (verified, copied):
        # 48 MiB of segments of 1 MiB or less: coalesced into ranges of several MiB.
        assert 0 < len(requests) <= 16, requests
    restored = ckpt_json("restore", dumped, "--store", copied_to, "--eager")
    procs.adopt(restored["pid"])
    assert report(restored["pid"], out)[0] == checksum



def test_a_restore_from_s3_asks_for_what_it_reads_once(procs, tmp_path, s3_server):
    """Opening the store and finding the checkpoint, counted by a relay in front of the server:
    the key files are listed once, the manifest read once (resolving its ID and loading it), the
    store's page-id key read without asking whether it exists, and the command's own lock
    object not read back. On a cloud store each request is tens of milliseconds."""
    from urllib.parse import urlsplit

    from tests.s3count import CountingRelay

    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 8)
    upstream = urlsplit(s3_server.endpoint)
    relay = CountingRelay((upstream.hostname, upstream.port))
    try:
        restored = ckpt_json("restore", dumped, "--eager",
                             env={"AWS_ENDPOINT_URL": relay.endpoint, "CKPT_CACHE": str(tmp_path / "fresh-cache")})
        procs.adopt(restored["pid"])
    finally:
        relay.stop()
    assert relay.unparsed == 0
    requests = relay.requests
    listings = [r.query for r in requests if r.method == "GET" and "list-type=2" in r.query]
    assert sum("keys%2F" in query for query in listings) == 1, listings
    assert len([r for r in requests if r.method == "GET" and "/checkpoints/" in r.path]) == 1, requests
    assert not [r for r in requests if r.method == "HEAD" and r.path.endswith("/key")], requests
    assert not [r for r in requests if r.method == "GET" and "/locks/" in r.path], requests
    assert report(restored["pid"], out)[0] == checksum


def test_the_tree_forks_at_once_while_the_store_is_stopped_mid_fetch(s3_server, procs, tmp_path):
    """ckpt's lazy-pages daemon reads a process's fork only while no copy into it is under way:
    a copying thread waiting for a segment's download must not hold that up (it held the
    tree's fork until the store answered again). Only the big region is lazy: the fork
    itself touches no page still to fetch."""
    dumped, checksum, out = dumped_bigmem(procs, tmp_path, 512)
    command, _ = restore_while(lambda: None, procs, tmp_path, dumped)
    stdout, stderr = command.communicate(timeout=60)
    assert command.returncode == 0, stderr
    restored = json.loads(stdout)
    pid, server = restored["pid"], s3_server.process.pid
    procs.adopt(pid)
    os.kill(server, signal.SIGSTOP)
    try:
        time.sleep(0.3)  # (the requests under way when it stopped are not answered)
        live = page_server_stats(restored["lazy"]["server_pid"], Path(restored["lazy"]["log"]).parent, LAZY_DIR)
        assert live and live["bytes_fetched"] < live["pages_total"] * PAGE, f"not mid-fetch: {live}"
        os.kill(pid, signal.SIGUSR2)
        forked = wait_until(lambda: [line for line in out.read_text().splitlines() if line.startswith("forked")],
                            timeout=5, interval=0.05, what="the tree's fork with the store stopped")
        assert float(forked[0].split()[1]) < 2.0, forked
    finally:
        os.kill(server, signal.SIGCONT)
    assert report(pid, out)[0] == checksum, "the restored memory differs from the checkpoint's"
    assert final_stats(restored)["status"] == "done"
