"""Stores in an S3 bucket (a real SeaweedFS server, tests/s3server.py): every command through
`--store s3://BUCKET/PREFIX`, restores on "another host" (a fresh cache, its own mount and UTS
namespaces, the first host's local side hidden), encryption seen from the bucket's side, damage,
concurrency and kill -9 mid-upload."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.phases import PAUSE_AT, PAUSE_FILE
from tests.conftest import S3_BUCKET
from tests.helpers import ROOT, alive, echo_server, ckpt, ckpt_json, read_lines, wait_until

pytestmark = pytest.mark.integration

PASSWORD = "correct horse battery staple"


@pytest.fixture
def s3_store(s3_url, monkeypatch):
    """An encrypted store at a fresh prefix of the test bucket, and CKPT_STORE naming it."""
    monkeypatch.setenv("CKPT_PASSWORD", PASSWORD)
    monkeypatch.setenv("CKPT_STORE", s3_url)
    created = ckpt_json("init", s3_url)
    assert created["store"] == s3_url and created["encrypted"] is True
    return s3_url


def bucket_objects(s3_server, url: str) -> dict[str, bytes]:
    """Every object under the store's prefix, read raw through the S3 API: {key: bytes}."""
    client = s3_server.client()
    prefix = url[len(f"s3://{S3_BUCKET}/"):] + "/"
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"]] = client.get_object(Bucket=S3_BUCKET, Key=item["Key"])["Body"].read()
    return found


def sums(path: Path) -> list[tuple[str, int]]:
    """bigmem's reports: (checksum, counter) per line."""
    return [(line.split()[0], int(line.split()[1])) for line in read_lines(path) if len(line.split()) == 2]


def report(pid: int, path: Path) -> tuple[str, int]:
    before = len(sums(path))
    os.kill(pid, signal.SIGUSR1)
    # (a tree restored lazily from S3 faults all its memory in to sum it: seconds, more under load)
    wait_until(lambda: len(sums(path)) > before, timeout=60, what="bigmem's report")
    return sums(path)[-1]


def on_another_host(args: list, cache: Path, hidden: Path, hostname: str = "other-host") -> subprocess.CompletedProcess:
    """`ckpt ARGS` as on another machine: its own mount and UTS namespaces (another hostname),
    an empty cache, and this host's cache (the local side of the remote store) hidden under an
    empty tmpfs."""
    script = (f"mount -t tmpfs -o mode=0700 none {hidden} && hostname {hostname} && "
              f"exec {sys.executable} -m ckpt \"$@\"")
    return subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script, "ckpt",
                           *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "CKPT_CACHE": str(cache)})


def test_a_checkpoint_in_s3_restores_on_another_host_with_an_empty_cache(s3_store, procs, tmp_path):
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 96)
    wait_until(lambda: sums(out), timeout=30, what="bigmem")
    first = ckpt_json("dump", big.pid, "--name", "big")
    before = report(big.pid, out)
    second = ckpt_json("dump", big.pid, "--name", "big")
    assert second["pages_new"] < second["pages"] / 10, "the next dump stored every page again"
    listed = [c["id"] for c in ckpt_json("list")]
    assert listed == [first["id"], second["id"]]
    procs.kill_tree(big.pid)

    restored = on_another_host(["restore", "big", "--json"], tmp_path / "cache-b", tmp_path / "cache")
    assert restored.returncode == 0, restored.stderr
    pid = json.loads(restored.stdout)["pid"]
    procs.adopt(pid)
    checksum, counter = report(pid, out)
    assert checksum == before[0], "the restored memory differs from the checkpoint's"
    assert counter >= before[1], "the counter started again"
    assert (tmp_path / "cache-b").is_dir() and os.stat(tmp_path / "cache-b").st_mode & 0o077 == 0


def test_a_server_restored_from_s3_on_another_host_accepts_again(s3_store, procs, tmp_path):
    server, port, log = echo_server(procs, tmp_path)
    dumped = ckpt_json("dump", server.pid)
    procs.kill_tree(server.pid)
    restored = on_another_host(["restore", dumped["id"], "--json"], tmp_path / "cache-b", tmp_path / "cache")
    assert restored.returncode == 0, restored.stderr
    procs.adopt(json.loads(restored.stdout)["pid"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"after\n")
        assert s.makefile().readline() == "after\n"


def test_nothing_in_the_bucket_shows_the_memory_and_tampering_is_refused(s3_store, s3_server, procs, tmp_path):
    marker = "ckpt-marker-" + os.urandom(8).hex()
    holder = procs.start_program([sys.executable, "-c",
                                  f"import time\nsecret = {marker!r} * 1000\nwhile True: time.sleep(0.1)"], "holder")
    time.sleep(0.5)
    dumped = ckpt_json("dump", holder.pid)
    raw = bucket_objects(s3_server, s3_store)
    assert any(key.split("/")[-2] == "packs" or "/packs/" in key for key in raw), sorted(raw)
    for key, data in raw.items():
        assert marker.encode() not in data, f"{key} holds the marker in clear"
        assert dumped["id"] not in key and "checkpoints/" + dumped["id"] not in key

    wrong = ckpt("list", check=False, env={"CKPT_PASSWORD": "not the password"})
    assert wrong.returncode == 4 and "password" in wrong.stderr.lower(), wrong.stderr
    assert "Traceback" not in wrong.stderr and len(wrong.stderr.strip().splitlines()) <= 2

    # One byte flipped in the largest pack: verify names the damage, restore refuses.
    client = s3_server.client()
    pack = max((key for key in raw if "/packs/" in key), key=lambda key: len(raw[key]))
    damaged = bytearray(raw[pack])
    damaged[len(damaged) // 2] ^= 0x40
    client.put_object(Bucket=S3_BUCKET, Key=pack, Body=bytes(damaged))
    verified = ckpt("verify", dumped["id"], check=False, env={"CKPT_CACHE": str(tmp_path / "fresh-cache")})
    assert verified.returncode == 6, verified.stdout + verified.stderr
    procs.kill_tree(holder.pid)
    refused = ckpt("restore", dumped["id"], "--eager", check=False, env={"CKPT_CACHE": str(tmp_path / "fresh-cache2")})
    assert refused.returncode == 6, refused.stderr
    assert not alive(holder.pid)


def test_two_dumps_at_once_and_a_prune_during_a_dump_lose_nothing(s3_store, procs, tmp_path):
    outs = [tmp_path / f"big{k}.txt" for k in range(2)]
    bigs = [procs.start("bigmem.py", out, 32) for out in outs]
    for out in outs:
        wait_until(lambda out=out: sums(out), timeout=30, what="bigmem")
    runs = [subprocess.Popen([sys.executable, "-m", "ckpt", "dump", str(big.pid), "--json", "--name", f"b{k}"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k, big in enumerate(bigs)]
    pruned = ckpt("prune", check=False)
    results = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in results]
    assert pruned.returncode == 0, pruned.stderr
    expected = {k: report(big.pid, outs[k])[0] for k, big in enumerate(bigs)}
    ckpt("prune")
    for k, big in enumerate(bigs):
        procs.kill_tree(big.pid)
        restored = ckpt_json("restore", f"b{k}", "--eager")
        procs.adopt(restored["pid"])
        assert report(restored["pid"], outs[k])[0] == expected[k]


def test_kill_9_mid_upload_shows_no_checkpoint_and_the_next_prune_cleans_up(s3_store, s3_server, procs, tmp_path):
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 64)
    wait_until(lambda: sums(out), timeout=30, what="bigmem")
    pause = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", "dump", str(big.pid)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, PAUSE_AT: "dump.before-commit", PAUSE_FILE: str(pause)})
    wait_until(pause.exists, timeout=120, what="the dump to reach its commit")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert alive(big.pid) and open(f"/proc/{big.pid}/stat").read().split()[2] != "T"
    assert ckpt_json("list") == []
    assert not [key for key in bucket_objects(s3_server, s3_store) if "/checkpoints/" in key]
    # What the killed dump uploaded is no checkpoint's: the next dump and prune go on.
    dumped = ckpt_json("dump", big.pid)
    ckpt("prune")
    expected = report(big.pid, out)[0]
    procs.kill_tree(big.pid)
    restored = ckpt_json("restore", dumped["id"], "--eager")
    procs.adopt(restored["pid"])
    assert report(restored["pid"], out)[0] == expected


def test_bad_remote_stores_get_one_line_and_their_exit_code(s3_env, s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_PASSWORD", PASSWORD)
    missing = ckpt("list", "--store", s3_url, check=False)
    assert missing.returncode == 3 and "ckpt init" in missing.stderr, missing.stderr
    no_bucket = ckpt("list", "--store", "s3://no-such-bucket-here/x", check=False)
    assert no_bucket.returncode == 3 and "no bucket" in no_bucket.stderr, no_bucket.stderr
    denied = ckpt("list", "--store", s3_url, check=False, env={"AWS_SECRET_ACCESS_KEY": "wrong"})
    assert denied.returncode == 4, denied.stderr
    unreachable = ckpt("list", "--store", s3_url, check=False, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                       timeout=120)
    assert unreachable.returncode == 9, unreachable.stderr
    ckpt("init", s3_url)
    again = ckpt("init", s3_url, check=False)
    assert again.returncode == 2 and "already" in again.stderr
    no_password = ckpt("list", "--store", s3_url, check=False, env={"CKPT_PASSWORD": ""})
    assert no_password.returncode == 4 and "CKPT_PASSWORD" in no_password.stderr
    for result in (missing, no_bucket, denied, unreachable, again, no_password):
        assert "Traceback" not in result.stderr


def test_a_store_whose_only_key_file_was_deleted_says_so_not_unencrypted(s3_store, s3_server):
    """Issue 23: with its one key file deleted, an encrypted store was called "not encrypted";
    its store.json (an encrypted blob) tells it from a store that is not encrypted."""
    from ckpt.errors import StoreError
    from ckpt.store import keys
    from ckpt.store.backends.s3 import S3Backend

    client = s3_server.client()
    key_files = [key for key in bucket_objects(s3_server, s3_store) if "/keys/" in key]
    assert len(key_files) == 1
    client.delete_object(Bucket=S3_BUCKET, Key=key_files[0])
    proc = ckpt("list", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "key files are missing" in proc.stderr and "not encrypted" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    with pytest.raises(StoreError, match="key files are missing"):
        keys.unlock(S3Backend.from_url(s3_store), PASSWORD.encode())
    # A store.json in plain text, without key files: a store that is not encrypted.
    prefix = s3_store[len(f"s3://{S3_BUCKET}/"):]
    client.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/store.json", Body=b'{"format": 2}')
    plain = ckpt("list", check=False)
    assert plain.returncode == 1 and "is not encrypted" in plain.stderr, plain.stderr


def test_a_schedule_on_an_s3_store_runs_from_crons_bare_environment(s3_url, procs, tmp_path, monkeypatch):
    """cron runs the line with only the variables of the cron file: they must find the server,
    the credentials (a file, never in the world-readable cron file) and the password (a file)."""
    monkeypatch.setenv("CKPT_CRON_DIR", str(tmp_path / "cron.d"))
    credentials = Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"])
    credentials.write_text(f"[default]\naws_access_key_id = {os.environ['AWS_ACCESS_KEY_ID']}\n"
                           f"aws_secret_access_key = {os.environ['AWS_SECRET_ACCESS_KEY']}\n")
    password = tmp_path / "password"
    password.write_text(PASSWORD + "\n")
    password.chmod(0o600)
    monkeypatch.setenv("CKPT_PASSWORD", PASSWORD)
    ckpt("init", s3_url)
    target = procs.start("counter.py", tmp_path / "c.txt")
    refused = ckpt("schedule", "add", "agent", "--pid", target.pid, "--every", "5m", "--store", s3_url, check=False)
    assert refused.returncode == 2 and "password" in refused.stderr and "file" in refused.stderr, refused.stderr
    ckpt("schedule", "add", "agent", "--pid", target.pid, "--every", "5m", "--store", s3_url,
         "--password-file", password)
    text = (tmp_path / "cron.d" / "ckpt-agent").read_text()
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in text and PASSWORD not in text
    environment = dict(line.split("=", 1) for line in text.splitlines()
                       if "=" in line and not line.startswith("#") and " root " not in line)
    assert environment["CKPT_PASSWORD_FILE"] == str(password)
    command = [line for line in text.splitlines() if " root " in line][0].split(" root ", 1)[1]
    ran = subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in environment.items()), "sh", "-c", command],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert ran.returncode == 0, ran.stderr
    checkpoints = ckpt_json("list", "--store", s3_url)
    assert [c["name"] for c in checkpoints] == ["agent"] and checkpoints[0]["pid"] == target.pid
    assert ckpt_json("schedule", "list", "--store", s3_url)[0]["last"]["outcome"] == "ok"


def test_copy_to_s3_survives_the_server_going_away_mid_upload(procs, tmp_path, monkeypatch):
    """Dumps stay local; --copy-to sends each off the host. The server is killed while a copy
    uploads: the dump is kept, its pending record stays, and once the server is back the next
    run finishes the copy; the copied checkpoint restores from the bucket on another host."""
    from tests.s3server import WeedServer

    server = WeedServer(tmp_path / "weed").start()
    try:
        for key, value in server.environment().items():
            monkeypatch.setenv(key, value)
        server.client().create_bucket(Bucket="offsite")
        url = "s3://offsite/host-a"
        monkeypatch.setenv("CKPT_PASSWORD", PASSWORD)
        password = tmp_path / "password"
        password.write_text(PASSWORD + "\n")
        password.chmod(0o600)
        monkeypatch.setenv("CKPT_PASSWORD_FILE", str(password))
        monkeypatch.setenv("CKPT_CRON_DIR", str(tmp_path / "cron.d"))
        ckpt("init", url)
        out = tmp_path / "big.txt"
        big = procs.start("bigmem.py", out, 192)
        wait_until(lambda: sums(out), timeout=30, what="bigmem")
        ckpt("schedule", "add", "agent", "--pid", big.pid, "--every", "5m", "--copy-to", url)

        run = subprocess.Popen([sys.executable, "-m", "ckpt", "schedule", "run", "agent", "--json"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client = server.client()
        wait_until(lambda: client.list_multipart_uploads(Bucket="offsite").get("Uploads") or run.poll() is not None,
                   timeout=120, interval=0.02, what="the copy's upload to start")
        assert run.poll() is None, "the copy finished before the server could be stopped"
        server.stop()
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr  # the dump itself succeeded
        outcome = json.loads(stdout)
        assert outcome["outcome"] == "ok" and outcome.get("copy_error"), outcome
        first = outcome["id"]
        assert alive(big.pid) and open(f"/proc/{big.pid}/stat").read().split()[2] != "T"
        assert [c["id"] for c in ckpt_json("list")] == [first]  # kept locally
        pending_dir = tmp_path / "store" / "copy-pending"
        assert [p.name for p in pending_dir.iterdir()] == [f"{first}.json"]

        server.restart()
        expected = report(big.pid, out)[0]
        second = ckpt_json("schedule", "run", "agent")
        assert not second.get("copy_error"), second
        assert list(pending_dir.iterdir()) == []
        copied = [c["id"] for c in ckpt_json("list", "--store", url)]
        assert copied == [first, second["id"]]
        procs.kill_tree(big.pid)
        restored = on_another_host(["restore", first, "--store", url, "--json"], tmp_path / "cache-b",
                                   tmp_path / "cache")
        assert restored.returncode == 0, restored.stderr
        pid = json.loads(restored.stdout)["pid"]
        procs.adopt(pid)
        assert report(pid, out)[0] == expected
    finally:
        server.stop()


def rot_cached_packs(cache: Path) -> int:
    """Flips a byte every 64 KiB of every pack copied in the cache (bit rot on this host's
    disk); returns how many copies it damaged."""
    copies = [path for path in cache.rglob("*") if path.is_file() and not path.name.startswith(".")
              and "packs" in path.relative_to(cache).parts]
    for path in copies:
        data = bytearray(path.read_bytes())
        for at in range(0, len(data), 64 << 10):
            data[at] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(copies)


# Holds 24 MiB of random data; SIGUSR2 rewrites its first half (whole segments of its first
# checkpoint's pack go dead once that checkpoint is removed: prune repacks the pack), SIGUSR1
# reports its checksum.
HALF_REWRITER = """
import hashlib, os, signal, sys, time
out, data = sys.argv[1], bytearray(os.urandom(24 << 20))
def write(line):
    with open(out, "a") as f:
        f.write(line + "\\n")
def rewrite(*_):
    data[:12 << 20] = os.urandom(12 << 20)
    write("rewrote")
signal.signal(signal.SIGUSR1, lambda *_: write("sum " + hashlib.blake2b(data).hexdigest()))
signal.signal(signal.SIGUSR2, rewrite)
write("ready")
while True:
    time.sleep(0.05)
"""


def test_damaged_cache_copies_never_reach_the_bucket_nor_fail_a_command(s3_store, s3_server, procs, tmp_path,
                                                                        monkeypatch):
    """Issue 23, 1-2: with every cached pack rotten, rm, forget --prune and prune (rm repacks
    the first checkpoint's pack: copies its live segments out, then deletes it) write nothing
    damaged and delete no intact original: the bucket verifies clean from an empty cache and
    the checkpoints left restore whole. restore and copy succeed at the first attempt and
    say why."""
    monkeypatch.setenv("CKPT_LOCK_TTL", "1")  # prune's safety margin for young blobs: 2 s
    cache, out = tmp_path / "cache", tmp_path / "mem.txt"
    mem = procs.start_program([sys.executable, "-c", HALF_REWRITER, str(out)], "half-rewriter")
    wait_until(lambda: "ready" in read_lines(out), timeout=30, what="the half rewriter")

    def count(what: str) -> int:
        return sum(line.startswith(what) for line in read_lines(out))

    def checksum(pid: int) -> str:
        before = count("sum")
        os.kill(pid, signal.SIGUSR1)
        wait_until(lambda: count("sum") > before, timeout=60, what="a checksum")
        return [line.split()[1] for line in read_lines(out) if line.startswith("sum")][-1]

    ids, sums = [], []
    for round_ in range(4):
        if round_:
            os.kill(mem.pid, signal.SIGUSR2)
            wait_until(lambda round_=round_: count("rewrote") == round_, timeout=30, what="a rewrite")
        sums.append(checksum(mem.pid))
        ids.append(ckpt_json("dump", mem.pid, "--name", "rot")["id"])
    procs.kill_tree(mem.pid)
    time.sleep(2.5)  # past the safety margin

    def packs() -> set[str]:
        return {key for key in bucket_objects(s3_server, s3_store) if "/packs/" in key}

    before = packs()
    assert rot_cached_packs(cache) >= 1
    removed = ckpt("rm", ids[0])
    assert "fetched again from the store" in removed.stderr, removed.stderr
    after = packs()
    assert before - after and after - before, "rm repacked nothing: the test lost its point"
    rot_cached_packs(cache)
    time.sleep(2.5)
    assert ckpt("forget", "--name", "rot", "--keep-last", "2", "--prune").returncode == 0
    rot_cached_packs(cache)
    assert ckpt("prune").returncode == 0
    assert [c["id"] for c in ckpt_json("list")] == ids[2:]

    verified = ckpt("verify", "--all", check=False, env={"CKPT_CACHE": str(tmp_path / "fresh-cache")})
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert not [key for key in bucket_objects(s3_server, s3_store) if "/damaged/" in key]

    assert rot_cached_packs(cache) >= 1
    restored = ckpt("restore", ids[2], "--eager", "--json")
    assert "fetched again from the store" in restored.stderr, restored.stderr
    procs.adopt(json.loads(restored.stdout)["pid"])
    assert checksum(json.loads(restored.stdout)["pid"]) == sums[2]

    rot_cached_packs(cache)
    copied = ckpt("copy", ids[3], "--to", str(tmp_path / "backup"))
    assert "fetched again from the store" in copied.stderr, copied.stderr
    assert ckpt("verify", "--all", "--store", str(tmp_path / "backup")).returncode == 0


S3_TIMEOUT = 2  # CKPT_S3_TIMEOUT of the hung-server tests: each request's budget
WITHIN = 30  # what a command facing a hung server may take in all (a few budgets, and the rest)


class Hung:
    """The S3 server SIGSTOPped (a frozen VM, a black-holed network: connections are accepted
    by the kernel, nothing answers), and let go again by SIGCONT whatever happens."""

    def __init__(self, server):
        self.pid = server.process.pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def paused_ckpt(args: list, tmp_path: Path, at: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """`ckpt ARGS` started to pause at phase `at` (ckpt/phases.py); it goes on once the
    returned file is deleted."""
    pause = tmp_path / f"paused-{at}"
    pause.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {}), PAUSE_AT: at, PAUSE_FILE: str(pause)})
    wait_until(lambda: pause.exists() or proc.poll() is not None, timeout=120, what=f"phase {at}")
    assert proc.poll() is None, proc.communicate()
    return proc, pause


def ended_unreachable(proc: subprocess.Popen, started: float) -> str:
    """Waits for a command facing the hung server: exit 9 and one line, within WITHIN s."""
    _, stderr = proc.communicate(timeout=WITHIN + 30)
    took = time.monotonic() - started
    assert proc.returncode == 9, stderr
    assert "did not answer" in stderr and "CKPT_S3_TIMEOUT" in stderr and "Traceback" not in stderr, stderr
    assert took < WITHIN, f"took {took:.0f} s"
    return stderr


def test_a_hung_server_ends_each_command_within_its_budget(s3_store, s3_server, procs, tmp_path, monkeypatch):
    """Issue 23, 3: the S3 server SIGSTOPped before list and prune, and in the middle of a dump
    (storing its pages), a copy (packing) and an eager restore: each ends with exit 9 within
    its budget, the target running, nothing half-visible; each succeeds once the server goes on."""
    monkeypatch.setenv("CKPT_S3_TIMEOUT", str(S3_TIMEOUT))
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 32)
    wait_until(lambda: sums(out), timeout=30, what="bigmem")
    first = ckpt_json("dump", big.pid, "--name", "big")["id"]

    for args in (["list"], ["prune"]):
        with Hung(s3_server):
            ended_unreachable(subprocess.Popen([sys.executable, "-m", "ckpt", *args], cwd=ROOT, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE), time.monotonic())
        assert ckpt(*args).returncode == 0

    dump, pause = paused_ckpt(["dump", big.pid, "--name", "big"], tmp_path, "dump.ingest")
    with Hung(s3_server):
        started = time.monotonic()
        pause.unlink()
        ended_unreachable(dump, started)
        assert alive(big.pid) and open(f"/proc/{big.pid}/stat").read().split()[2] not in "Tt"
    assert [c["id"] for c in ckpt_json("list")] == [first], "a half-written checkpoint is visible"
    expected = report(big.pid, out)[0]
    second = ckpt_json("dump", big.pid, "--name", "big")["id"]

    backup = tmp_path / "backup"
    copy, pause = paused_ckpt(["copy", first, second, "--to", backup], tmp_path, "copy.packing",
                              env={"CKPT_CACHE": str(tmp_path / "empty-cache")})
    with Hung(s3_server):
        started = time.monotonic()
        pause.unlink()
        ended_unreachable(copy, started)
    assert not backup.exists() or ckpt_json("list", "--store", backup) == []
    ckpt("copy", first, second, "--to", backup)

    procs.kill_tree(big.pid)
    with Hung(s3_server):
        ended_unreachable(subprocess.Popen([sys.executable, "-m", "ckpt", "restore", second, "--eager"], cwd=ROOT,
                                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           env={**os.environ, "CKPT_CACHE": str(tmp_path / "empty-cache-2")}),
                          time.monotonic())
        assert not alive(big.pid), "a tree was restored"
    restored = ckpt_json("restore", second, "--eager", env={"CKPT_CACHE": str(tmp_path / "empty-cache-2")})
    procs.adopt(restored["pid"])
    assert report(restored["pid"], out)[0] == expected


def test_a_lazy_restore_facing_a_hung_server_ends_the_tree_and_says_so(s3_store, s3_server, procs, tmp_path,
                                                                       monkeypatch):
    """Issue 23, 3: the tree restored lazily on another host (an empty cache: every page from
    the bucket) while the server hangs waits for its pages; once the page server's budget is
    spent the tree is killed (never run on memory not filled in) and the failure recorded."""
    monkeypatch.setenv("CKPT_S3_TIMEOUT", str(S3_TIMEOUT))
    out = tmp_path / "big.txt"
    big = procs.start("bigmem.py", out, 96)
    wait_until(lambda: sums(out), timeout=30, what="bigmem")
    dumped = ckpt_json("dump", big.pid)["id"]
    procs.kill_tree(big.pid)
    cache = {"CKPT_CACHE": str(tmp_path / "empty-cache")}
    restore, pause = paused_ckpt(["restore", dumped, "--lazy", "--json"], tmp_path, "restore.before-criu", env=cache)
    with Hung(s3_server):
        pause.unlink()
        stdout, stderr = restore.communicate(timeout=WITHIN + 30)
        if restore.returncode == 0:  # the page server held its own lock on the store before the hang
            pid = json.loads(stdout)["pid"]  # the tree runs, waiting for its pages
            procs.adopt(pid)
            wait_until(lambda: not alive(pid), timeout=WITHIN, what="the tree to be ended")
            recorded = [1]  # its failure came after the command: recorded for `ckpt list`
        else:  # the server asked for its lock during the hang: the restore fails before the tree
            # runs (CRIU ends it in its post-restore notification), and says why
            assert restore.returncode == 5 and "Traceback" not in stderr, stderr
            assert "could not lock the store" in stderr and "did not answer" in stderr, stderr
            wait_until(lambda: not alive(big.pid), timeout=WITHIN, what="the restored tree to be ended")
            recorded = [0]  # the command said it
    listed = ckpt("list", "--json", env=cache)
    assert [row["lazy_restore_failures"] for row in json.loads(listed.stdout)] == recorded, listed.stdout
    restored = ckpt_json("restore", dumped, "--eager")
    procs.adopt(restored["pid"])
    assert report(restored["pid"], out)[0] == sums(out)[0][0]
