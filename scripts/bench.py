#!/usr/bin/env python3
"""ckpt's benchmarks, measured side by side with raw CRIU in one run.

  store growth  a target holding --growth-mib of random data rewrites 1% of its pages (random
                positions) between checkpoints; what each checkpoint adds to the store
  dump/restore  ckpt dump (leave running) and ckpt restore of a --size-mib target next to raw
                `criu dump --leave-running` / `criu restore -d` of the same target, same disk;
                the restore (lazy by default at this size) also until its page server has put
                back the last page, and `ckpt restore --eager`
  scale         `ckpt list` with 1,000 checkpoints; `ckpt prune` of a store of 100 checkpoints
  s3            a store in S3 (SeaweedFS started here, tests/s3server.py; encrypted, as every
                store in S3 is): upload and download of --s3-mib of random bytes by ckpt's
                backend next to bare boto3's transfer manager; a --s3-target-mib target dumped
                there, then dumped again after rewriting 1% of its pages (bytes that reached
                the bucket); its restore from S3 with an empty cache next to raw
                `criu restore -d` of the same memory from local disk
  cadence       issue 17's goals: dumps --cadence-interval seconds apart (a first dump, then
                --cadence-dumps more) of a --cadence-mib target rewriting 1% of its pages, ckpt
                and raw CRIU on separate identical targets at the same time, half an interval
                apart, so that neither reuses memory the other freed; then dumps back to back;
                the freeze from CRIU's own stats-dump on both sides, the phases from its log;
                first and next dump wall time (raw also with a sync of its images), restores
                (lazy, --eager, raw `criu restore -d`); the machine's free page reporting
  group         a group checkpoint of two --group-mib targets next to single dumps of the
                same two trees: each member's freeze, how long each stayed frozen, the skew
  migrate       `ckpt migrate` of targets of --migrate-mib (1% of their memory rewritten per
                second) between two test hosts (tests/netns.py, B with PIDs of its own) next to
                raw `criu dump`, `cp -r`, `criu restore -d` in B: downtime, the pauses the
                target saw, rounds, total time (--migrate-runs runs; --migrate-eager adds
                `ckpt migrate --eager`)
  clones        `ckpt clone --copies N` (--clone-copies) of a --clone-mib checkpoint: time, the
                copies' Rss and Pss, the drop of MemAvailable; raw `criu restore -d` once
  recovery      issue 28's table: a --recovery-s3-mib target restored from an encrypted store in
                S3 with an empty cache (until it runs, until its last page is in) next to ckpt's
                own bulk download of the same blobs and raw `criu restore -d` from local disk,
                also after `ckpt cache warm` (where it exists); a --size-mib target restored
                lazily and --eager next to `criu restore -d`; trees of 1 + N processes
                (--recovery-tree-n) dumped with --stop and restored next to raw CRIU

Prints a table of medians and ratios (and every sample) and writes JSON to bench-results/. Run
as root after `make setup`:  .venv/bin/python scripts/bench.py [--size-mib 2048]
[--growth-mib 1024] [--runs 3] [--s3-mib 512] [--s3-target-mib 1024] [--cadence-mib 2048]
[--cadence-interval 30] [--cadence-dumps 5] [--cadence-series 3] [--group-mib 1024]
[--migrate-mib 1024,4096] [--migrate-runs 3] [--migrate-eager] [--clone-mib 1024]
[--clone-copies 1,4,16] [--clone-runs 1] [--recovery-s3-mib 1024] [--recovery-tree-n 25,100]
[--only growth|dump|scale|s3|cadence|group|migrate|clones|recovery]
"""

from __future__ import annotations

import argparse
import compileall
import filecmp
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckpt.criu.binary import find_criu  # noqa: E402
from ckpt.settings import Settings  # noqa: E402
from tests.s3server import LaggingProxy, WeedServer, weed_binary  # noqa: E402

TARGET = r"""
import os, random, signal, sys, time
size = int(sys.argv[1]) << 20
data = bytearray(size)
for off in range(0, size, 64 << 20):  # non-zero, non-repeating
    chunk = os.urandom(min(64 << 20, size - off))
    data[off:off + len(chunk)] = chunk
flag = sys.argv[2]
def rewrite(signum, frame):
    pages = size // 4096
    for p in random.sample(range(pages), pages // 100):
        data[p * 4096:(p + 1) * 4096] = os.urandom(4096)
    open(flag, "w").write("rewritten")
signal.signal(signal.SIGUSR1, rewrite)
open(flag, "w").write("ready")
while True:
    time.sleep(0.1)
"""
CKPT = [sys.executable, "-m", "ckpt"]


def state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 15
    while state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)


def settle() -> None:
    """Writes back what earlier steps left dirty in the page cache (raw CRIU does not fsync its
    images; ckpt does), so that no measured command pays for the one before it."""
    os.sync()
    time.sleep(0.5)


def timed(cmd: list[str], env=None, settled: bool = True) -> tuple[float, str]:
    if settled:
        settle()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


class Target:
    def __init__(self, size_mib: int, work: Path):
        self.flag = work / f"flag-{time.monotonic_ns()}"
        self.proc = subprocess.Popen([sys.executable, "-c", TARGET, str(size_mib), str(self.flag)],
                                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self._wait("ready")

    def _wait(self, word: str) -> None:
        while not (self.flag.exists() and self.flag.read_text() == word):
            if self.proc.poll() is not None:
                raise SystemExit("benchmark target died")
            time.sleep(0.05)

    def rewrite_one_percent(self) -> None:
        self.flag.write_text("")
        os.kill(self.proc.pid, signal.SIGUSR1)
        self._wait("rewritten")

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


def raw_freeze_ms(images: Path) -> float:
    out = subprocess.run([sys.executable, "-c", (
        "import sys, pycriu.images as i; print(i.load(open(sys.argv[1], 'rb'))['entries'][0]['dump']['frozen_time'])"),
        str(images / "stats-dump")], capture_output=True, text=True).stdout
    return int(out) / 1000


def bench_growth(size_mib: int, work: Path, checkpoints: int = 10) -> dict:
    env = {**os.environ, "CKPT_STORE": str(work / "growth-store")}
    target = Target(size_mib, work)
    added = []
    try:
        for k in range(checkpoints):
            if k:
                target.rewrite_one_percent()
            _, out = timed(CKPT + ["dump", str(target.proc.pid), "--json", "--name", "growth"], env)
            added.append(json.loads(out)["bytes_stored"])
    finally:
        target.end()
    later = [a / (size_mib << 20) * 100 for a in added[1:]]
    return {"size_mib": size_mib, "bytes_added": added, "later_percent": later, "max_later_percent": max(later)}


def bench_dump_restore(size_mib: int, runs: int, work: Path, criu: str) -> dict:
    env = {**os.environ, "CKPT_STORE": str(work / "dump-store")}
    rows: dict[str, list[float]] = {k: [] for k in ("ckpt_first_dump_s", "ckpt_next_dump_s", "criu_dump_s",
                                                    "ckpt_freeze_ms", "criu_freeze_ms", "ckpt_restore_s",
                                                    "ckpt_restore_all_memory_s", "ckpt_restore_eager_s",
                                                    "criu_restore_s")}
    for run in range(runs):
        target = Target(size_mib, work)
        pid = target.proc.pid
        raw_dir = work / f"raw-{run}"
        raw_dir.mkdir()
        order = ["ckpt", "criu"] if run % 2 == 0 else ["criu", "ckpt"]
        checkpoint = None
        for who in order:
            if who == "ckpt":
                elapsed, out = timed(CKPT + ["dump", str(pid), "--json", "--name", "bench"], env)
                rows["ckpt_first_dump_s"].append(elapsed)
                target.rewrite_one_percent()
                elapsed, out = timed(CKPT + ["dump", str(pid), "--json", "--name", "bench"], env)
                rows["ckpt_next_dump_s"].append(elapsed)
                result = json.loads(out)
                checkpoint = result["id"]
                rows["ckpt_freeze_ms"].append(result["freeze_ms"])
            else:
                # The network lock ckpt takes for this target, which has no TCP connections:
                # none (CRIU's default, iptables, is not installed here; nftables would add
                # 0.1-0.2 s of freeze that ckpt does not pay).
                elapsed, _ = timed([criu, "dump", "-t", str(pid), "-D", str(raw_dir), "--leave-running",
                                    "-o", "dump.log", "--network-lock", "skip"])
                rows["criu_dump_s"].append(elapsed)
                rows["criu_freeze_ms"].append(raw_freeze_ms(raw_dir))
        target.end()
        for who in order:
            if who == "ckpt":
                # Default (lazy for this size): the tree runs at once; then until the page
                # server has put back the last page.
                elapsed, out = timed(CKPT + ["restore", checkpoint, "--json"], env)
                rows["ckpt_restore_s"].append(elapsed)
                restored = json.loads(out)
                waited = time.perf_counter()
                if restored["lazy"]:
                    # (a zombie is done: this machine's init reaps orphans a second or two late)
                    while state(restored["lazy"]["server_pid"]) not in (None, "Z"):
                        time.sleep(0.01)
                rows["ckpt_restore_all_memory_s"].append(elapsed + time.perf_counter() - waited)
                kill(restored["pid"])
                elapsed, out = timed(CKPT + ["restore", checkpoint, "--eager", "--json"], env)
                rows["ckpt_restore_eager_s"].append(elapsed)
                kill(json.loads(out)["pid"])
            else:
                elapsed, _ = timed([criu, "restore", "-D", str(raw_dir), "-d", "-o", "restore.log"])
                rows["criu_restore_s"].append(elapsed)
                kill(pid)
        shutil.rmtree(raw_dir)
        # One name for every run: the store holds one earlier checkpoint when the next run starts.
        subprocess.run(CKPT + ["forget", "--keep-last", "1", "--prune", "--allow-remove-all", "-q"], env=env,
                       capture_output=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"size_mib": size_mib, "runs": runs, "samples": rows, "medians": med, "ratios": {
        "first_dump_wall": med["ckpt_first_dump_s"] / med["criu_dump_s"],
        "next_dump_wall": med["ckpt_next_dump_s"] / med["criu_dump_s"],
        "freeze": med["ckpt_freeze_ms"] / med["criu_freeze_ms"],
        "restore_wall": med["ckpt_restore_s"] / med["criu_restore_s"],
        "restore_all_memory": med["ckpt_restore_all_memory_s"] / med["criu_restore_s"],
        "restore_eager_wall": med["ckpt_restore_eager_s"] / med["criu_restore_s"]}}


def bench_scale(work: Path) -> dict:
    store = work / "scale-store"
    env = {**os.environ, "CKPT_STORE": str(store)}
    target = Target(16, work)
    try:
        for _ in range(100):
            target.rewrite_one_percent()
            timed(CKPT + ["dump", str(target.proc.pid), "-q"], env, settled=False)
    finally:
        target.end()
    manifests = sorted((store / "checkpoints").glob("*.json"))
    prune_env = env
    timed(CKPT + ["forget", "--keep-last", "10"], prune_env)
    prune_s, out = timed(CKPT + ["prune", "--json"], prune_env)
    freed = json.loads(out)["bytes_freed"]
    # 1,000 checkpoints: copies of a real manifest under new IDs (they share its data).
    from ckpt.store import ids

    template = json.loads(sorted((store / "checkpoints").glob("*.json"))[-1].read_text())
    for _ in range(1000 - 10):
        template["id"] = ids.new_id()
        (store / "checkpoints" / f"{template['id']}.json").write_text(json.dumps(template))
    list_s = statistics.median(timed(CKPT + ["list", "--json"], env)[0] for _ in range(3))
    count = len(json.loads(timed(CKPT + ["list", "--json"], env)[1]))
    return {"dumped": len(manifests), "prune_100_s": prune_s, "prune_bytes_freed": freed, "list_count": count,
            "list_s": list_s}


# ---- stores in S3 ----------------------------------------------------------------------------

S3_BUCKET = "bench"
S3_PASSWORD = "bench password"
# Freed memory goes back to the host about 2 s later on this machine, and faulting it in again
# costs more than reusing memory not yet given back: after every command that frees a large
# tree, both sides wait this long, so that neither restores into memory the other just freed.
RETURN_PAUSE = 3.0
DIRTY_TARGET = ROOT / "tests" / "fixtures" / "dirtymem.py"


def bucket_bytes(client, prefix: str) -> int:
    """The sum of the sizes of the bucket's objects under prefix, by the server's own listing."""
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix):
        total += sum(item["Size"] for item in page.get("Contents", []))
    return total


class DirtyTarget:
    """tests/fixtures/dirtymem.py: random data in one page-aligned mapping (no huge pages), of
    which SIGUSR2 rewrites one byte in each of 1% of the 4 KiB pages, chosen at random."""

    def __init__(self, size_mib: int, work: Path):
        self.out = work / f"dirty-{time.monotonic_ns()}"
        self.pages = (size_mib << 20) // 4096 // 100
        self.proc = subprocess.Popen([sys.executable, str(DIRTY_TARGET), str(self.out), str(size_mib), "off",
                                      str(self.pages)], start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.rounds = 0
        self._wait("ready")

    def _wait(self, line: str) -> None:
        deadline = time.monotonic() + 120
        while not (self.out.exists() and line in self.out.read_text().splitlines()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("benchmark target died or hung")
            time.sleep(0.05)

    def rewrite_one_percent(self) -> None:
        self.rounds += 1
        os.kill(self.proc.pid, signal.SIGUSR2)
        self._wait(f"dirtied {self.rounds}")

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


def timed_call(action, settled: bool = True) -> float:
    if settled:
        settle()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def bench_s3_throughput(server: WeedServer, work: Path, mib: int, runs: int) -> dict:
    """Whole blobs of mib random bytes, up and down: ckpt's encrypted backend (what dump and
    restore use: EncryptedBackend over S3Backend; put_file and get_file), the same unencrypted
    (for reference), and bare boto3's transfer manager (upload_file / download_file: parallel
    multipart and ranged GETs, its fastest) with its default settings and with ckpt's part
    size and concurrency (16 MiB, 4): the ratio is against the faster boto3. The order of the
    four rotates from run to run."""
    from boto3.s3.transfer import TransferConfig

    from ckpt.store import keys
    from ckpt.store.backends import s3

    client = server.client()
    data = work / "s3-data"
    with open(data, "wb") as out:
        for _ in range(mib):
            out.write(os.urandom(1 << 20))
    dest = work / "s3-dest"
    encrypted, _ = keys.initialize(s3.S3Backend(S3_BUCKET, "throughput-encrypted"), S3_PASSWORD.encode())
    plain = s3.S3Backend(S3_BUCKET, "throughput-plain")

    def boto3_way(config):
        return (lambda key: client.upload_file(str(data), S3_BUCKET, key, Config=config),
                lambda key: client.download_file(S3_BUCKET, key, str(dest), Config=config))

    def ckpt_way(backend):
        def put(name):
            staged = work / "s3-staged"
            os.link(data, staged)  # put_file consumes its file
            backend.put_file(name, staged)
        return put, lambda name: backend.get_file(name, dest)

    ways = {"ckpt encrypted": ckpt_way(encrypted),
            "boto3 transfer manager, default (8 MiB x 10)": boto3_way(TransferConfig()),
            "ckpt unencrypted S3Backend": ckpt_way(plain),
            "boto3 transfer manager, 16 MiB x 4": boto3_way(TransferConfig(multipart_chunksize=s3.PART_SIZE,
                                                                           max_concurrency=s3.CONCURRENCY))}
    samples: dict[str, dict[str, list[float]]] = {label: {"up_s": [], "down_s": []} for label in ways}
    labels = list(ways)
    for run in range(runs):
        for label in labels[run % len(labels):] + labels[:run % len(labels)]:
            put, get = ways[label]
            name = f"packs/bench-{run}"
            samples[label]["up_s"].append(timed_call(lambda put=put, name=name: put(name)))
            samples[label]["down_s"].append(timed_call(lambda get=get, name=name: get(name)))
            if run == 0 and not filecmp.cmp(data, dest, shallow=False):
                raise SystemExit(f"{label}: the bytes downloaded differ from those uploaded")
            dest.unlink()
    encrypted.close()
    plain.close()
    data.unlink()
    speed = {label: {way: mib / statistics.median(times) for way, times in rows.items()}
             for label, rows in samples.items()}
    best = {way: max(value[way] for label, value in speed.items() if label.startswith("boto3"))
            for way in ("up_s", "down_s")}
    return {"mib": mib, "runs": runs, "samples_s": samples, "mib_per_s": speed,
            "ratios": {"upload": speed["ckpt encrypted"]["up_s"] / best["up_s"],
                       "download": speed["ckpt encrypted"]["down_s"] / best["down_s"]}}


def bench_s3_dumps(server: WeedServer, work: Path, criu: str, size_mib: int, runs: int) -> dict:
    """A size_mib target dumped into an encrypted store in S3 (host A: one cache throughout),
    then `runs` times: 1% of its pages rewritten and dumped again, counting what reached the
    bucket. Raw CRIU then dumps the same memory to local disk. The target gone, the last
    checkpoint is restored `runs` times from S3 with an empty cache (host B: a fresh
    CKPT_CACHE each time) alternately with raw `criu restore -d` of the local images, each
    after RETURN_PAUSE."""
    client = server.client()
    prefix = "store"
    env = {**os.environ, **server.environment(), "CKPT_STORE": f"s3://{S3_BUCKET}/{prefix}",
           "CKPT_PASSWORD": S3_PASSWORD, "CKPT_CACHE": str(work / "cache-host-a")}
    timed(CKPT + ["init", "-q"], env)
    target = DirtyTarget(size_mib, work)
    pid = target.proc.pid
    raw_dir = work / "s3-raw"
    raw_dir.mkdir()
    uploaded: list[int] = []
    dump_s: list[float] = []
    stored: list[int] = []
    try:
        for k in range(runs + 1):
            if k:
                target.rewrite_one_percent()
            before = bucket_bytes(client, f"{prefix}/")
            elapsed, out = timed(CKPT + ["dump", str(pid), "--json", "--name", "s3"], env)
            uploaded.append(bucket_bytes(client, f"{prefix}/") - before)
            dump_s.append(elapsed)
            stored.append(json.loads(out)["bytes_stored"])
            checkpoint = json.loads(out)["id"]
        raw_dump_s, _ = timed([criu, "dump", "-t", str(pid), "-D", str(raw_dir), "--leave-running",
                               "-o", "dump.log", "--network-lock", "skip"])
    finally:
        target.end()
    time.sleep(RETURN_PAUSE)
    rows: dict[str, list[float]] = {"ckpt_restore_s": [], "ckpt_restore_all_memory_s": [], "criu_restore_s": []}
    for run in range(runs):
        for who in (["ckpt", "criu"] if run % 2 == 0 else ["criu", "ckpt"]):
            if who == "ckpt":
                cache = work / f"cache-host-b-{run}"
                elapsed, out = timed(CKPT + ["restore", checkpoint, "--json"], {**env, "CKPT_CACHE": str(cache)})
                restored = json.loads(out)
                waited = time.perf_counter()
                if restored["lazy"]:
                    # (a zombie is done: this machine's init reaps orphans a second or two late)
                    while state(restored["lazy"]["server_pid"]) not in (None, "Z"):
                        time.sleep(0.01)
                rows["ckpt_restore_s"].append(elapsed)
                rows["ckpt_restore_all_memory_s"].append(elapsed + time.perf_counter() - waited)
                kill(restored["pid"])
                shutil.rmtree(cache)
            else:
                elapsed, _ = timed([criu, "restore", "-D", str(raw_dir), "-d", "-o", "restore.log"])
                rows["criu_restore_s"].append(elapsed)
                kill(pid)
            time.sleep(RETURN_PAUSE)
    shutil.rmtree(raw_dir)
    size = size_mib << 20
    next_uploaded = uploaded[1:]
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"size_mib": size_mib, "runs": runs, "rewritten_pages": target.pages,
            "bytes_uploaded": uploaded, "bytes_stored_reported": stored, "dump_s": dump_s,
            "raw_criu_dump_s": raw_dump_s,
            "next_uploaded_percent": [b / size * 100 for b in next_uploaded],
            "max_next_uploaded_percent": max(next_uploaded) / size * 100,
            "restore_samples": rows, "restore_medians": med,
            "ratios": {"restore_wall": med["ckpt_restore_s"] / med["criu_restore_s"],
                       "restore_all_memory": med["ckpt_restore_all_memory_s"] / med["criu_restore_s"]}}


def bench_s3(work: Path, criu: str, mib: int, target_mib: int, runs: int) -> dict:
    server_dir = work / "weed"
    server_dir.mkdir()
    server = WeedServer(server_dir).start()
    try:
        server.client().create_bucket(Bucket=S3_BUCKET)
        with _environment(server.environment()):
            throughput = bench_s3_throughput(server, work, mib, runs)
        return {"server": "SeaweedFS " + subprocess.run([weed_binary(), "version"], capture_output=True,
                                                        text=True).stdout.split("\n")[0].strip(),
                "throughput": throughput, "dumps": bench_s3_dumps(server, work, criu, target_mib, runs)}
    finally:
        server.stop()


@contextmanager
def _environment(values: dict[str, str]):
    """The S3 server's address and keys for the backends made in this process."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- dumps at a cadence ----------------------------------------------------------------------

# virtio-balloon feature bits (virtio spec 5.5.3): free page reporting is what hands freed
# memory back to the host, and what makes memory freed and allocated again slow to touch.
BALLOON_FEATURES = {0: "MUST_TELL_HOST", 1: "STATS_VQ", 2: "DEFLATE_ON_OOM", 3: "FREE_PAGE_HINT",
                    4: "PAGE_POISON", 5: "REPORTING"}


def free_page_reporting() -> dict:
    """The machine's free page reporting: the balloon devices bound to virtio_balloon and their
    features, and the page_reporting module's parameters (some kernels add counters there,
    such as reported_kib), so that figures from other machines can be compared."""
    driver = Path("/sys/bus/virtio/drivers/virtio_balloon")
    balloons = {}
    for device in sorted(driver.glob("virtio*")) if driver.is_dir() else []:
        try:
            bits = (device / "features").read_text().strip()
        except OSError:
            bits = ""
        # Bits 24 and above belong to the transport (VERSION_1 and the like), not the balloon.
        balloons[device.name] = [BALLOON_FEATURES.get(bit, f"bit {bit}") for bit in range(min(len(bits), 24))
                                 if bits[bit] == "1"]
    params = {}
    for param in sorted(Path("/sys/module/page_reporting/parameters").glob("*")):
        try:
            params[param.name] = param.read_text().strip()
        except OSError:
            params[param.name] = "?"
    # Free memory is what a dump's page cache comes from, and what the host may have taken back;
    # the kernel reclaims page cache only once it runs short.
    meminfo = {line.split(":")[0]: int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text()
               .splitlines() if line.split(":")[0] in ("MemTotal", "MemFree", "Cached")}
    return {"virtio_balloon": balloons, "page_reporting": params, "meminfo_mib": meminfo,
            "reporting": any("REPORTING" in features for features in balloons.values())}


def criu_stats(directory: Path) -> dict:
    """CRIU's own stats-dump image (in the images directory of a raw dump, in the store's
    logs/<id>/ for ckpt): the freeze is freezing_time (seizing the tree) + frozen_time (until
    CRIU let it run again)."""
    import pycriu.images

    with open(directory / "stats-dump", "rb") as f:
        entry = pycriu.images.load(f)["entries"][0]["dump"]
    freezing, frozen = int(entry.get("freezing_time", 0)) / 1000, int(entry.get("frozen_time", 0)) / 1000
    return {"freeze_ms": freezing + frozen, "freezing_ms": freezing, "frozen_ms": frozen,
            "memdump_ms": int(entry.get("memdump_time", 0)) / 1000,
            "memwrite_ms": int(entry.get("memwrite_time", 0)) / 1000,
            "pages_written": int(entry.get("pages_written", 0))}


def dump_log_phases(log: Path) -> dict:
    """Seconds from CRIU's start, read from the timestamps of its dump log (level 3 or more):
    the tree seized, its pages dumped (pagemap generation and the writes into the pages image
    interleave: CRIU writes whenever its page pipes are full), the last pagemap line and the
    next line (the pages written), the tree let run again."""
    marks: dict[str, float] = {}
    after_pagemap = False
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("(") or ")" not in line:
            continue
        try:
            at = float(line[1:line.index(")")])
        except ValueError:
            continue
        text = line[line.index(")") + 1:].strip()
        if after_pagemap and not text.startswith("Pagemap generated"):
            marks["pages_written"] = at
            after_pagemap = False
        if text.startswith("Seized task"):
            marks.setdefault("seized", at)
        elif text.startswith("Dumping pages"):
            marks.setdefault("pages_start", at)
        elif text.startswith("Pagemap generated"):
            marks["pagemap_done"] = at
            after_pagemap = True
        elif text.startswith("Unfreezing tasks"):
            marks["unfrozen"] = at
        marks["end"] = at
    return marks


class CadenceSide:
    """One side of the cadence: its own target, its own dumps, every sample."""

    def __init__(self, who: str, size_mib: int, work: Path, criu: str, env: dict):
        self.who, self.work, self.criu, self.env = who, work, criu, env
        self.target = DirtyTarget(size_mib, work)
        self.samples: list[dict] = []
        self.raw_dirs: list[Path] = []
        self.last_checkpoint: str | None = None

    def dump(self, phase: str, late_s: float = 0.0) -> dict:
        pid = self.target.proc.pid
        if self.who == "ckpt":
            wall, out = timed(CKPT + ["dump", str(pid), "--json", "--name", "cadence"], self.env, settled=False)
            result = json.loads(out)
            self.last_checkpoint = result["id"]
            logs = Path(self.env["CKPT_STORE"]) / "logs" / result["id"]
            sample = {"wall_s": wall, "reported_freeze_ms": result["freeze_ms"],
                      "bytes_stored": result["bytes_stored"], **criu_stats(logs),
                      "log": dump_log_phases(logs / "dump.log")}
        else:
            images = self.work / f"cadence-raw-{len(self.raw_dirs)}"
            images.mkdir()
            # The network lock ckpt takes for this target (no TCP connections): none; CRIU's log
            # level ckpt uses (3), so that both logs cost the same and both show the phases.
            wall, _ = timed([self.criu, "dump", "-t", str(pid), "-D", str(images), "--leave-running", "-o",
                             "dump.log", "-v3", "--network-lock", "skip"], settled=False)
            # ckpt's dump is durable when it returns; this is what the same costs raw CRIU. It
            # also keeps the kernel's write-back of these images out of the other side's dump.
            sync_s = timed_call(lambda: _fsync_tree(images), settled=False)
            sample = {"wall_s": wall, "sync_s": sync_s, **criu_stats(images),
                      "log": dump_log_phases(images / "dump.log")}
            # Raw CRIU keeps its newest images, as ckpt keeps its checkpoints: the older ones go.
            self.raw_dirs.append(images)
            if len(self.raw_dirs) > 1:
                shutil.rmtree(self.raw_dirs[-2])
        sample.update(phase=phase, late_s=late_s)
        self.samples.append(sample)
        self.target.rewrite_one_percent()
        return sample

    def of(self, phase: str, key: str) -> list[float]:
        return [s[key] for s in self.samples if s["phase"] == phase]


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_cadence(size_mib: int, interval: float, dumps: int, series: int, runs: int, work: Path,  # noqa: PLR0913
                  criu: str) -> dict:
    """Dumps `interval` seconds apart, as a schedule takes them: a first dump, then `dumps`
    more, 1% of the pages rewritten after each. ckpt and raw CRIU dump separate but identical
    targets (tests/fixtures/dirtymem.py) that run at the same time; each side keeps its own
    cadence, raw CRIU's half an interval after ckpt's, so that whatever one side frees has
    gone back to the host (about 2 s here) long before the other side dumps: neither inherits
    memory the other freed. Then `series` dumps back to back on each side, one side after
    the other (RETURN_PAUSE between): from the second on, a dump reuses the memory its own
    previous dump freed. Then the targets end and the last checkpoints are restored `runs`
    times, alternately: ckpt's default (lazy) restore, `ckpt restore --eager`, raw
    `criu restore -d`, each after RETURN_PAUSE."""
    env = {**os.environ, "CKPT_STORE": str(work / "cadence-store")}
    reporting_before = free_page_reporting()
    sides = {"ckpt": CadenceSide("ckpt", size_mib, work, criu, env),
             "criu": CadenceSide("criu", size_mib, work, criu, env)}
    load_before = os.getloadavg()
    try:
        start = time.monotonic() + 2
        events = sorted([(start + k * interval, "ckpt", k) for k in range(dumps + 1)]
                        + [(start + k * interval + interval / 2, "criu", k) for k in range(dumps + 1)])
        for at, who, k in events:
            # What other work left dirty is written back before, not during, the dump.
            if at - time.monotonic() > 1.5:
                time.sleep(at - time.monotonic() - 1.5)
                os.sync()
            late = time.monotonic() - at
            if late < 0:
                time.sleep(-late)
            sample = sides[who].dump("first" if k == 0 else "cadence", max(late, 0.0))
            print(f"  cadence {who:4} dump {k}: wall {sample['wall_s']:.2f} s, freeze {sample['freeze_ms']:.0f} ms"
                  + (f" (late {late:.1f} s)" if late > 0.5 else ""), file=sys.stderr)
        for who in ("ckpt", "criu"):
            time.sleep(RETURN_PAUSE)
            settle()
            for _ in range(series):
                sides[who].dump("back-to-back")
    finally:
        for side in sides.values():
            side.target.end()
    load_after = os.getloadavg()
    reporting_after = free_page_reporting()
    restores: dict[str, list[float]] = {"ckpt_restore_s": [], "ckpt_restore_all_memory_s": [],
                                        "ckpt_restore_eager_s": [], "criu_restore_s": []}
    checkpoint, raw_images = sides["ckpt"].last_checkpoint, sides["criu"].raw_dirs[-1]
    for run in range(runs):
        for who in (["ckpt", "criu"] if run % 2 == 0 else ["criu", "ckpt"]):
            time.sleep(RETURN_PAUSE)
            if who == "ckpt":
                elapsed, out = timed(CKPT + ["restore", checkpoint, "--json"], env)
                restored = json.loads(out)
                waited = time.perf_counter()
                if restored["lazy"]:
                    deadline = time.monotonic() + 300
                    # (a zombie is done: this machine's init reaps orphans a second or two late)
                    while state(restored["lazy"]["server_pid"]) not in (None, "Z") and time.monotonic() < deadline:
                        time.sleep(0.01)
                restores["ckpt_restore_s"].append(elapsed)
                restores["ckpt_restore_all_memory_s"].append(elapsed + time.perf_counter() - waited)
                kill(restored["pid"])
                time.sleep(RETURN_PAUSE)
                elapsed, out = timed(CKPT + ["restore", checkpoint, "--eager", "--json"], env)
                restores["ckpt_restore_eager_s"].append(elapsed)
                kill(json.loads(out)["pid"])
            else:
                elapsed, _ = timed([criu, "restore", "-D", str(raw_images), "-d", "-o", "restore.log"])
                restores["criu_restore_s"].append(elapsed)
                kill(sides["criu"].target.proc.pid)
    ckpt, raw = sides["ckpt"], sides["criu"]
    med = statistics.median
    # From the second dump of each back-to-back series on (the first follows a pause).
    b2b = {who: [s["freeze_ms"] for s in side.samples if s["phase"] == "back-to-back"][1:]
           for who, side in sides.items()}
    first_raw_durable = raw.of("first", "wall_s")[0] + raw.of("first", "sync_s")[0]
    medians = {
        "ckpt_freeze_ms": med(ckpt.of("cadence", "freeze_ms")), "criu_freeze_ms": med(raw.of("cadence", "freeze_ms")),
        "ckpt_b2b_freeze_ms": med(b2b["ckpt"]) if b2b["ckpt"] else None,
        "criu_b2b_freeze_ms": med(b2b["criu"]) if b2b["criu"] else None,
        "ckpt_first_dump_s": ckpt.of("first", "wall_s")[0], "criu_first_dump_s": raw.of("first", "wall_s")[0],
        "criu_first_dump_sync_s": first_raw_durable,
        "ckpt_next_dump_s": med(ckpt.of("cadence", "wall_s")), "criu_next_dump_s": med(raw.of("cadence", "wall_s")),
        "criu_next_dump_sync_s": med([w + s for w, s in zip(raw.of("cadence", "wall_s"), raw.of("cadence", "sync_s"),
                                                             strict=True)]),
        **{k: med(v) for k, v in restores.items()}}
    m = medians
    goals = [
        {"goal": f"1. freeze, dumps every {interval:g}s (median)", "ratio": m["ckpt_freeze_ms"] / m["criu_freeze_ms"],
         "limit": 0.5},
        {"goal": "1. freeze, back to back (median)", "limit": 1.0,
         "ratio": m["ckpt_b2b_freeze_ms"] / m["criu_b2b_freeze_ms"] if b2b["ckpt"] and b2b["criu"] else None},
        {"goal": "2. first dump wall / raw dump + sync", "ratio": m["ckpt_first_dump_s"] / first_raw_durable,
         "limit": 1.5},
        {"goal": "3. restore --eager / raw restore -d", "ratio": m["ckpt_restore_eager_s"] / m["criu_restore_s"],
         "limit": 2.0},
        {"goal": "3. lazy restore keeps its lead", "ratio": m["ckpt_restore_s"] / m["criu_restore_s"], "limit": 1.0},
        {"goal": "4. next dump wall / raw dump (cadence)", "ratio": m["ckpt_next_dump_s"] / m["criu_next_dump_s"],
         "limit": 1.5}]
    for goal in goals:
        goal["met"] = goal["ratio"] is not None and goal["ratio"] <= goal["limit"]
    reported = {}
    for key in ("reported_kib", "passes"):
        try:
            reported[key] = (int(reporting_after["page_reporting"][key])
                             - int(reporting_before["page_reporting"][key]))
        except (KeyError, ValueError):
            pass
    return {"size_mib": size_mib, "interval_s": interval, "dumps": dumps, "series": series, "runs": runs,
            "free_page_reporting": reporting_before, "page_reporting_during": reported,
            "load_average": {"before": load_before, "after": load_after},
            "samples": {who: side.samples for who, side in sides.items()}, "restore_samples": restores,
            "medians": medians, "goals": goals}


def print_cadence(r: dict) -> None:
    fpr = r["free_page_reporting"]
    balloons = "; ".join(f"{dev}: {', '.join(features) or 'no features'}"
                         for dev, features in fpr["virtio_balloon"].items()) or "no virtio_balloon device"
    print(f"dumps at a cadence, {r['size_mib']} MiB target (dirtymem, 1% of pages rewritten after each dump), "
          f"a first dump then {r['dumps']} every {r['interval_s']:g} s per side, raw CRIU half an interval after "
          f"ckpt on its own identical target; then {r['series']} back to back per side; {r['runs']} restores")
    mem = fpr["meminfo_mib"]
    print(f"  free page reporting: {'on' if fpr['reporting'] else 'off'} ({balloons}); memory before the "
          f"targets: {mem.get('MemTotal')} MiB, free {mem.get('MemFree')} MiB, page cache {mem.get('Cached')} MiB")
    if fpr["page_reporting"]:
        print("    page_reporting: " + ", ".join(f"{k}={v}" for k, v in fpr["page_reporting"].items()))
    if r["page_reporting_during"]:
        print("    during the dumps: " + ", ".join(f"{k} +{v}" for k, v in r["page_reporting_during"].items()))
    load = r["load_average"]
    print(f"  load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after the dumps")
    print("  every dump (freeze = CRIU's stats-dump freezing_time + frozen_time; log: seconds from CRIU's start "
          "to the tree seized / pages dumped and written / tree running):")
    for who, samples in r["samples"].items():
        for i, s in enumerate(samples):
            log = s["log"]
            pages = log.get("pages_written", 0) - log.get("pages_start", 0)
            extra = (f", sync {s['sync_s']:.2f} s" if "sync_s" in s
                     else f", ckpt said {s['reported_freeze_ms']} ms, stored {s['bytes_stored'] / 2**20:.1f} MiB")
            print(f"    {who:4} {i:2} {s['phase']:12} wall {s['wall_s']:6.2f} s  freeze {s['freeze_ms']:7.0f} ms "
                  f"(freezing {s['freezing_ms']:.0f}, frozen {s['frozen_ms']:.0f}; memdump {s['memdump_ms']:.0f}, "
                  f"memwrite {s['memwrite_ms']:.0f})  log: seized {log.get('seized', 0):.2f}, pages "
                  f"{log.get('pages_start', 0):.2f}-{log.get('pagemap_done', 0):.2f}/{log.get('pages_written', 0):.2f}"
                  f" ({pages:.2f} s), running {log.get('unfrozen', 0):.2f}{extra}"
                  + (f", late {s['late_s']:.1f} s" if s["late_s"] > 0.5 else ""))
    rs = r["restore_samples"]
    print(f"  restores: lazy (tree runs) {_samples(rs['ckpt_restore_s'])} s, all memory back "
          f"{_samples(rs['ckpt_restore_all_memory_s'])} s; --eager {_samples(rs['ckpt_restore_eager_s'])} s; "
          f"raw criu restore -d {_samples(rs['criu_restore_s'])} s")
    m = r["medians"]
    print(f"  medians                           {'ckpt':>9} {'raw criu':>9}")
    rows = [("freeze at the cadence", m["ckpt_freeze_ms"] / 1000, m["criu_freeze_ms"] / 1000),
            ("freeze back to back", (m["ckpt_b2b_freeze_ms"] or 0) / 1000, (m["criu_b2b_freeze_ms"] or 0) / 1000),
            ("first dump", m["ckpt_first_dump_s"], m["criu_first_dump_s"]),
            ("  raw + sync of its images", m["ckpt_first_dump_s"], m["criu_first_dump_sync_s"]),
            ("next dump at the cadence", m["ckpt_next_dump_s"], m["criu_next_dump_s"]),
            ("  raw + sync of its images", m["ckpt_next_dump_s"], m["criu_next_dump_sync_s"]),
            ("restore (lazy, default)", m["ckpt_restore_s"], m["criu_restore_s"]),
            ("  ... until all memory in", m["ckpt_restore_all_memory_s"], m["criu_restore_s"]),
            ("restore --eager", m["ckpt_restore_eager_s"], m["criu_restore_s"])]
    for label, a, b in rows:
        print(f"    {label:30} {a:8.2f}s {b:8.2f}s")
    print(f"  issue 17's goals                         {'ratio':>6} {'goal':>7}  met")
    for g in r["goals"]:
        ratio = "   n/a" if g["ratio"] is None else f"{g['ratio']:6.2f}"
        print(f"    {g['goal']:38} {ratio}  <= {g['limit']:<4g} {'yes' if g['met'] else 'NO'}")


def _samples(values: list[float], fmt: str = "%.2f") -> str:
    return ", ".join(fmt % v for v in values)


def print_s3(r: dict) -> None:
    t, d = r["throughput"], r["dumps"]
    print(f"stores in S3 ({r['server']} on 127.0.0.1; ckpt's store encrypted), {t['runs']} runs, medians:")
    print(f"  {t['mib']} MiB of random bytes, MiB/s    {'upload':>8} {'download':>9}")
    for label, speed in t["mib_per_s"].items():
        print(f"    {label:44} {speed['up_s']:8.1f} {speed['down_s']:9.1f}")
    print(f"    {'ckpt encrypted / faster boto3':44} {t['ratios']['upload']:8.2f} {t['ratios']['download']:9.2f}"
          "   goal >= 0.8")
    for label, rows in t["samples_s"].items():
        print(f"    samples, {label}: up {_samples(rows['up_s'])} s; down {_samples(rows['down_s'])} s")
    mib = 2 ** 20
    print(f"  {d['size_mib']} MiB target, bytes that reached the bucket: first dump "
          f"{d['bytes_uploaded'][0] / mib:.1f} MiB; after rewriting 1% of its pages ({d['rewritten_pages']}), "
          f"each next dump: {_samples([b / mib for b in d['bytes_uploaded'][1:]], '%.1f')} MiB "
          f"(max {d['max_next_uploaded_percent']:.2f}% of the target, goal <= 3%)")
    print(f"    dumps into S3 took {_samples(d['dump_s'])} s (first, then next); raw criu dump to local disk "
          f"{d['raw_criu_dump_s']:.2f} s")
    m, q, s = d["restore_medians"], d["ratios"], d["restore_samples"]
    print(f"  restore of it, from S3 with an empty cache  {'ckpt':>9} {'raw criu':>9} {'ratio':>6}   "
          "(raw: criu restore -d from local disk)")
    print(f"    {'the tree runs (lazy, default)':42} {m['ckpt_restore_s']:8.2f}s {m['criu_restore_s']:8.2f}s "
          f"{q['restore_wall']:6.2f}")
    print(f"    {'... until its last page is back':42} {m['ckpt_restore_all_memory_s']:8.2f}s "
          f"{m['criu_restore_s']:8.2f}s {q['restore_all_memory']:6.2f}")
    print(f"    samples: runs {_samples(s['ckpt_restore_s'])} s, all memory {_samples(s['ckpt_restore_all_memory_s'])}"
          f" s; raw {_samples(s['criu_restore_s'])} s")


# ---- a group checkpoint ------------------------------------------------------------------------

def bench_group(size_mib: int, runs: int, work: Path) -> dict:
    """Two --group-mib targets (DirtyTarget), each rewriting 1% of its pages before every
    measured dump: single dumps of each (one after the other) next to one group checkpoint of
    both, alternating which comes first. Per member: CRIU's freeze and, in the group, how long
    it was frozen (from its freeze to its thaw, which waits for the other member); the group's
    skew (first freeze to last) and span (first freeze to last thaw); wall times."""
    env = {**os.environ, "CKPT_STORE": str(work / "group-store")}
    targets = [DirtyTarget(size_mib, work), DirtyTarget(size_mib, work)]
    rows: dict[str, list[float]] = {k: [] for k in (
        "single_freeze_a_ms", "single_freeze_b_ms", "single_wall_s", "group_freeze_a_ms", "group_freeze_b_ms",
        "group_frozen_a_ms", "group_frozen_b_ms", "group_skew_ms", "group_span_ms", "group_wall_s")}
    try:
        for target in targets:  # the first dumps store every page: not measured
            timed(CKPT + ["dump", str(target.proc.pid), "-q"], env)
        for run in range(runs):
            for kind in (("single", "group") if run % 2 == 0 else ("group", "single")):
                for target in targets:
                    target.rewrite_one_percent()
                if kind == "single":
                    wall = 0.0
                    for letter, target in zip("ab", targets, strict=True):
                        elapsed, out = timed(CKPT + ["dump", str(target.proc.pid), "--json"], env)
                        wall += elapsed
                        rows[f"single_freeze_{letter}_ms"].append(json.loads(out)["freeze_ms"])
                    rows["single_wall_s"].append(wall)
                    continue
                elapsed, out = timed(CKPT + ["dump", "--group", "bench", "--json"]
                                     + [str(t.proc.pid) for t in targets], env)
                group = json.loads(out)
                rows["group_wall_s"].append(elapsed)
                by_pid = {m["pid"]: m for m in group["members"]}
                for letter, target in zip("ab", targets, strict=True):
                    member = by_pid[target.proc.pid]
                    rows[f"group_freeze_{letter}_ms"].append(member["freeze_ms"])
                    rows[f"group_frozen_{letter}_ms"].append((member["thawed_at"] - member["frozen_at"]) * 1000)
                rows["group_skew_ms"].append(group["stats"]["freeze_skew_ms"])
                rows["group_span_ms"].append(group["stats"]["span_ms"])
    finally:
        for target in targets:
            target.end()
    return {"size_mib": size_mib, "runs": runs, "samples": rows,
            "medians": {k: statistics.median(v) for k, v in rows.items()}}


def print_group(r: dict) -> None:
    m, s = r["medians"], r["samples"]
    print(f"group checkpoint of 2 x {r['size_mib']} MiB targets (1% of pages rewritten before each dump), "
          f"{r['runs']} runs, medians:")
    print(f"  {'':38} {'single dumps':>12} {'group':>9} {'ratio':>6}")
    for letter in "ab":
        single, grouped = m[f"single_freeze_{letter}_ms"], m[f"group_freeze_{letter}_ms"]
        print(f"  {'member ' + letter.upper() + ': freeze (CRIU)':38} {single:10.0f}ms {grouped:7.0f}ms "
              f"{grouped / single:6.2f}")
        frozen = m[f"group_frozen_{letter}_ms"]
        print(f"  {'member ' + letter.upper() + ': frozen until thawed':38} {single:10.0f}ms {frozen:7.0f}ms "
              f"{frozen / single:6.2f}")
    print(f"  {'freeze skew (first freeze to last)':38} {'-':>12} {m['group_skew_ms']:7.0f}ms")
    print(f"  {'span (first freeze to last thaw)':38} {'-':>12} {m['group_span_ms']:7.0f}ms")
    print(f"  {'wall (both trees)':38} {m['single_wall_s']:11.2f}s {m['group_wall_s']:8.2f}s "
          f"{m['group_wall_s'] / m['single_wall_s']:6.2f}")
    print(f"    samples: skew {_samples(s['group_skew_ms'], '%.0f')} ms, "
          f"span {_samples(s['group_span_ms'], '%.0f')} ms")


# ---- migration and clones (issue 27) -----------------------------------------------------------

CHURN_TARGET = ROOT / "tests" / "fixtures" / "churnmem.py"
TICK_S = 0.05  # churnmem.py's pace: a line every 50 ms while it runs
PAUSE_S = 0.1  # a gap between two of its lines longer than this is a pause


def ckpt_lacks(command: str) -> str | None:
    """None when this tree's ckpt has the command; otherwise why not, in one line."""
    done = subprocess.run(CKPT + command.split() + ["--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if done.returncode == 0:
        return None
    said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return f"`ckpt {command}` is not in this tree ({said}): its half of the benchmark is not measured"


def run_checked(cmd: list, what: str, env=None, timeout: float = 1800) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}): {' '.join(map(str, cmd))}\n{done.stderr[-3000:]}")
    return done


class ChurnTarget:
    """tests/fixtures/churnmem.py started on a test host (its own session, stdio to a file):
    size_mib of random data, 1% of its pages rewritten per second, a timed line every 50 ms."""

    def __init__(self, host, processes, size_mib: int, work: Path):
        self.out = work / f"churn-{time.monotonic_ns()}"
        self.started = host.start(processes, [sys.executable, CHURN_TARGET, self.out, size_mib], "churn")
        self.pid = self.started.pid
        deadline = time.monotonic() + 300
        while len(self.ticks()) < 20:  # filled, and a second of churn
            if self.started.popen.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the churn target died or hung")
            time.sleep(0.1)

    def ticks(self) -> list[float]:
        try:
            lines = self.out.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [float(line.split()[1]) for line in lines[:-1] if line != "ready"]  # the last may be half-written

    def counting_after(self, moment: float, timeout: float = 120) -> float:
        """Waits until it has ticked twice after moment (wall clock): it runs (where it is now)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [t for t in self.ticks() if t > moment]
            if len(later) >= 2:
                return later[0]
            time.sleep(0.05)
        raise SystemExit(f"the moved target (PID {self.pid}) does not count on")

    def pauses(self, start: float, end: float) -> tuple[float, float]:
        """(longest gap between its lines, total time in gaps longer than PAUSE_S beyond one
        tick) from start to end, wall clock: how long it did not run, as it saw it."""
        ticks = [t for t in self.ticks() if start - 1 <= t <= end + 1]
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        return max(gaps, default=0.0), sum(g - TICK_S for g in gaps if g > PAUSE_S)


def migrate_with_ckpt(hosts, target: ChurnTarget, store: Path, eager: bool) -> dict:
    """`ckpt migrate PID --to host-b --json --store STORE` run on host A (the source)."""
    env = {**os.environ, "CKPT_CACHE": str(hosts.a.workdir / "cache"), "PYTHONPATH": str(ROOT),
           "CKPT_SSH": hosts.ssh(), "CKPT_REMOTE_CKPT": hosts.remote_ckpt()}
    run_checked(hosts.a.command(*CKPT, "init", store, "-q"), "ckpt init", env)
    cmd = hosts.a.command(*CKPT, "migrate", target.pid, "--to", hosts.b.alias, "--json", "--store", store,
                          *(["--eager"] if eager else []))
    settle()
    started = time.time()
    begin = time.perf_counter()
    done = run_checked(cmd, "ckpt migrate", env)
    wall = time.perf_counter() - begin
    ended = time.time()
    result = json.loads(done.stdout)
    moved = result["destination"]["pid"]
    target.started.popen.wait(30)  # the source: ended by the migration
    if not hosts.b.is_running(moved):
        raise SystemExit(f"ckpt migrate said PID {moved} runs on host-b; it does not")
    target.counting_after(ended)
    longest, paused = target.pauses(started, time.time())
    hosts.b.kill(moved)
    rounds = result["rounds"]
    return {"downtime_s": result["downtime_ms"] / 1000, "wall_s": wall, "longest_pause_s": longest,
            "paused_s": paused, "rounds": len(rounds), "round_pages": [r["pages"] for r in rounds],
            "round_new_pages": [r["new_pages"] for r in rounds], "round_frozen_ms": [r["frozen_ms"] for r in rounds],
            "final_pages": result["final"]["pages"], "final_new_pages": result["final"]["new_pages"],
            "final_frozen_ms": result["final"]["frozen_ms"], "lazy": bool(result["lazy"]),
            "reported_duration_s": result["duration_ms"] / 1000}


def migrate_with_criu(hosts, target: ChurnTarget, criu: str, work: Path) -> dict:
    """By hand: `criu dump` (freezes the tree, dumps it, ends it) on host A, `cp -r` of the
    images, `criu restore -d` of the copy inside host B's namespaces (nsenter); the PID is free
    there anyway (and the original is gone). Downtime: from the dump's start until the
    restore returned."""
    images, copy = work / "raw-images", work / "raw-copy"
    images.mkdir()
    settle()
    started = time.time()
    begin = time.perf_counter()
    run_checked(hosts.a.command(criu, "dump", "-t", target.pid, "-D", images, "-o", "dump.log",
                                "--network-lock", "skip"), "criu dump")
    dumped = time.perf_counter()
    run_checked(["cp", "-r", images, copy], "cp -r")
    copied = time.perf_counter()
    run_checked(hosts.b.command(criu, "restore", "-d", "-D", copy, "-o", "restore.log"), "criu restore")
    restored = time.perf_counter()
    ended = time.time()
    target.started.popen.wait(30)  # ended by criu dump
    if not hosts.b.is_running(target.pid):
        raise SystemExit(f"criu restore -d returned but PID {target.pid} does not run on host-b")
    target.counting_after(ended)
    longest, paused = target.pauses(started, time.time())
    hosts.b.kill(target.pid)
    freeze = raw_freeze_ms(images)
    shutil.rmtree(images)
    shutil.rmtree(copy)
    return {"downtime_s": restored - begin, "wall_s": restored - begin, "longest_pause_s": longest,
            "paused_s": paused, "dump_s": dumped - begin, "copy_s": copied - dumped, "restore_s": restored - copied,
            "freeze_ms": freeze}


def bench_migrate(sizes: list[int], runs: int, work: Path, criu: str, eager: bool) -> dict:
    """For each size, `runs` runs; in each, every side moves a fresh ChurnTarget started on
    host A to host B (tests/netns.py's TwoHosts, B with PIDs of its own), the order of the
    sides alternating from run to run. Before each side's target is started, RETURN_PAUSE
    after the last side's memory and files were freed: no side reuses memory another just
    freed (each reuses what its own steps free: the source's memory, its images)."""
    from tests.helpers import Processes
    from tests.netns import TwoHosts

    missing = ckpt_lacks("migrate")
    sides = ["raw criu"] if missing else ["ckpt", *(["ckpt --eager"] if eager else []), "raw criu"]
    if missing:
        print(f"migration: {missing}", file=sys.stderr)
    hosts_dir = work / "hosts"
    hosts_dir.mkdir()
    processes = Processes(hosts_dir)
    results: dict = {"sizes": sizes, "runs": runs, "sides": sides, "missing": missing, "by_size": {},
                     "load_average": {"before": os.getloadavg()}, "reported_kib_before": reported_kib()}
    try:
        with TwoHosts(hosts_dir / "net", processes, own_pids=True, s3=False) as hosts:
            for size in sizes:
                samples: dict[str, list[dict]] = {side: [] for side in sides}
                for run in range(runs):
                    for side in (sides if run % 2 == 0 else sides[::-1]):
                        time.sleep(RETURN_PAUSE)
                        target = ChurnTarget(hosts.a, processes, size, work)
                        try:
                            if side == "raw criu":
                                samples[side].append(migrate_with_criu(hosts, target, criu, work))
                            else:
                                store = work / "migrate-store"
                                samples[side].append(migrate_with_ckpt(hosts, target, store, side.endswith("eager")))
                                shutil.rmtree(store)
                        finally:
                            if target.started.popen.poll() is None:
                                processes.kill_tree(target.started.popen.pid)
                            target.out.unlink(missing_ok=True)
                results["by_size"][size] = {"samples": samples, "medians": {
                    side: {key: statistics.median(s[key] for s in rows) for key in rows[0]
                           if isinstance(rows[0][key], (int, float))} for side, rows in samples.items()}}
    finally:
        processes.cleanup()
    results["load_average"]["after"] = os.getloadavg()
    results["reported_kib_after"] = reported_kib()
    return results


def reported_kib() -> int | None:
    """Free memory this machine has handed back to its host so far (page_reporting's counter,
    where the kernel has it): how much of what the sides freed went back during a section."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text())
    except (OSError, ValueError):
        return None


def print_migrate(r: dict) -> None:
    print(f"migration of a target rewriting 1% of its memory per second (churnmem.py) from host-a to host-b "
          f"(network namespaces; B with PIDs of its own), local-directory store; {r['runs']} runs, medians; "
          f"raw criu: criu dump, cp -r, criu restore -d inside B")
    if r["missing"]:
        print(f"  {r['missing']}")
    load = r["load_average"]
    before, after = r["reported_kib_before"], r["reported_kib_after"]
    handed = f"{(after - before) >> 10} MiB" if before is not None and after is not None else "unknown"
    print(f"  load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after; memory handed back "
          f"to the host meanwhile (page_reporting reported_kib): {handed}")
    sides = r["sides"]
    for size, by in r["by_size"].items():
        m = by["medians"]
        print(f"  {size} MiB      " + "".join(f"{side:>13}" for side in sides)
              + ("   ratio ckpt / raw" if "ckpt" in sides else ""))
        for key, label in (("downtime_s", "downtime (s)"), ("longest_pause_s", "longest pause seen (s)"),
                           ("paused_s", "paused in all (s)"), ("wall_s", "total time (s)")):
            ratio = f"   {m['ckpt'][key] / m['raw criu'][key]:6.2f}" if "ckpt" in sides and m["raw criu"][key] else ""
            print(f"    {label:24}" + "".join(f"{m[side][key]:13.2f}" for side in sides) + ratio)
        raw = by["samples"]["raw criu"]
        print(f"    raw criu steps: dump {_samples([s['dump_s'] for s in raw])} s (frozen "
              f"{_samples([s['freeze_ms'] for s in raw], '%.0f')} ms), cp {_samples([s['copy_s'] for s in raw])} s, "
              f"restore {_samples([s['restore_s'] for s in raw])} s")
        for side in sides:
            if side == "raw criu":
                continue
            for i, s in enumerate(by["samples"][side]):
                rounds = "; ".join(f"{p} pages, {n} new, frozen {f:.0f} ms" for p, n, f in
                                   zip(s["round_pages"], s["round_new_pages"], s["round_frozen_ms"], strict=True))
                print(f"    {side} run {i}: {s['rounds']} rounds ({rounds}); final {s['final_pages']} pages, "
                      f"{s['final_new_pages']} new, frozen {s['final_frozen_ms']:.0f} ms; lazy {s['lazy']}")
        for side in sides:
            print(f"    samples, {side}: downtime {_samples([s['downtime_s'] for s in by['samples'][side]])} s, "
                  f"longest pause {_samples([s['longest_pause_s'] for s in by['samples'][side]])} s")


def meminfo_kib(field: str = "MemAvailable") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"no {field} in /proc/meminfo")


def tree_memory_kib(root: int) -> tuple[int, int]:
    """(Rss, Pss) summed over root and its descendants, from /proc/PID/smaps_rollup."""
    from tests.helpers import tree_pids

    rss = pss = 0
    for pid in tree_pids(root):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        for line in rollup:
            if line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif line.startswith("Pss:"):
                pss += int(line.split()[1])
    return rss, pss


def settled_memory(roots: list[int], timeout: float = 120) -> tuple[int, int, float]:
    """(Rss, Pss) of the trees once their Rss stops growing (a lazy restore fills memory in the
    background: two readings 0.5 s apart within 0.5%), and how long that took."""
    began = time.perf_counter()
    last = -1
    while True:
        rss, pss = map(sum, zip(*(tree_memory_kib(root) for root in roots), strict=True))
        if abs(rss - last) <= 0.005 * rss or time.perf_counter() - began > timeout:
            return rss, pss, time.perf_counter() - began
        last = rss
        time.sleep(0.5)


def end_trees(roots: list[int]) -> None:
    from tests.helpers import tree_pids

    for root in roots:
        for pid in tree_pids(root):
            kill(pid)


def bench_clones(size_mib: int, counts: list[int], runs: int, work: Path, criu: str) -> dict:
    """A size_mib DirtyTarget (random data: distinct, non-zero pages) dumped once by ckpt and
    once by raw CRIU (--leave-running), then ended. Raw `criu restore -d` of its images once,
    for reference; then `ckpt clone ID --copies N --json` for each N (order alternating from
    run to run). Each measured: wall time; MemAvailable before it and once the copies' memory
    stopped growing; Rss and Pss of every copy's tree (its init included). RETURN_PAUSE after
    each is ended: none reuses memory another just freed."""
    missing = ckpt_lacks("clone")
    if missing:
        print(f"clones: {missing}", file=sys.stderr)
    env = {**os.environ, "CKPT_STORE": str(work / "clone-store"), "CKPT_CACHE": str(work / "clone-cache"),
           "CKPT_COPIES_DIR": str(work / "copies")}
    raw_dir = work / "clone-raw"
    raw_dir.mkdir()
    target = DirtyTarget(size_mib, work)
    pid = target.proc.pid
    try:
        checkpoint = None if missing else json.loads(timed(CKPT + ["dump", str(pid), "--json"], env)[1])["id"]
        timed([criu, "dump", "-t", str(pid), "-D", str(raw_dir), "--leave-running", "-o", "dump.log",
               "--network-lock", "skip"])
    finally:
        target.end()
    time.sleep(RETURN_PAUSE)
    settle()
    before = meminfo_kib()
    elapsed, _ = timed([criu, "restore", "-d", "-D", str(raw_dir), "-o", "restore.log"], settled=False)
    rss, pss, waited = settled_memory([pid])
    raw = {"wall_s": elapsed, "rss_kib": rss, "pss_kib": pss, "available_drop_kib": before - meminfo_kib()}
    end_trees([pid])
    shutil.rmtree(raw_dir)
    time.sleep(RETURN_PAUSE)
    samples: dict[int, list[dict]] = {n: [] for n in counts}
    skipped: dict[int, str] = {}
    for run in range(0 if missing else runs):
        for n in (counts if run % 2 == 0 else counts[::-1]):
            available = meminfo_kib()
            if n * (size_mib << 10) > available - (2 << 20):
                skipped[n] = (f"{n} private copies of {size_mib} MiB would not fit in the "
                              f"{available >> 10} MiB available (less 2 GiB)")
                continue
            settle()
            before = meminfo_kib()
            elapsed, out = timed(CKPT + ["clone", checkpoint, "--copies", str(n), "--json"], env, settled=False)
            result = json.loads(out)
            copies = result["copies"]
            roots = [c["init_pid"] for c in copies]
            try:  # the copies are ended whatever happens here (a bench that stops must leave none)
                rss, pss, waited = settled_memory(roots)
                samples[n].append({"wall_s": elapsed, "reported_s": result["duration_ms"] / 1000,
                                   "copy_s": [r.get("duration_ms", 0) / 1000 for r in result.get("restores", [])],
                                   "rss_kib": rss, "pss_kib": pss,
                                   "available_drop_kib": before - meminfo_kib(), "memory_settled_s": waited,
                                   "running": sum(1 for c in copies if state(c["pid"]) not in (None, "Z"))})
            finally:
                end_trees(roots)
            for c in copies:
                if c.get("netns"):
                    subprocess.run(["ip", "netns", "del", c["netns"]], capture_output=True)
            time.sleep(RETURN_PAUSE)
    return {"size_mib": size_mib, "counts": counts, "runs": runs, "missing": missing, "raw": raw,
            "skipped": skipped, "samples": samples,
            "medians": {n: {key: statistics.median(s[key] for s in rows) for key in rows[0] if key != "copy_s"}
                        for n, rows in samples.items() if rows}}


def print_clones(r: dict) -> None:
    mib = 1024
    raw = r["raw"]
    print(f"clones of a {r['size_mib']} MiB checkpoint (random data), {r['runs']} run(s), medians; memory once the "
          f"copies' Rss stopped growing: Rss and Pss summed over the copies' trees, drop of MemAvailable")
    print(f"  {'':22} {'wall':>8} {'per copy':>9} {'Rss':>10} {'Pss':>10} {'MemAvail drop':>14}"
          f" {'wall / raw':>10} {'drop / raw':>10}")
    print(f"  {'raw criu restore -d':22} {raw['wall_s']:7.2f}s {raw['wall_s']:8.2f}s {raw['rss_kib'] / mib:7.0f}MiB "
          f"{raw['pss_kib'] / mib:7.0f}MiB {raw['available_drop_kib'] / mib:11.0f}MiB")
    if r["missing"]:
        print(f"  {r['missing']}")
    for n in r["counts"]:
        if n in r["skipped"]:
            print(f"  {'ckpt clone, ' + str(n) + ' copies':22} skipped: {r['skipped'][n]}")
            continue
        m = r["medians"].get(n)
        if not m:
            continue
        print(f"  {'ckpt clone, ' + str(n) + ' copies':22} {m['wall_s']:7.2f}s {m['wall_s'] / n:8.2f}s "
              f"{m['rss_kib'] / mib:7.0f}MiB {m['pss_kib'] / mib:7.0f}MiB {m['available_drop_kib'] / mib:11.0f}MiB "
              f"{m['wall_s'] / raw['wall_s']:10.2f} {m['available_drop_kib'] / raw['available_drop_kib']:10.2f}")


# ---- recovery time (issue 28) ------------------------------------------------------------------

BENCH_TREE = ROOT / "tests" / "fixtures" / "bench_tree.py"
TREE_CHILD_MIB = 2
LAST_PAGE_POLL_S = 0.005
LAST_PAGE_TIMEOUT_S = 600.0
RECOVERY_PREFIX = "recovery"
RECOVERY_WORKERS = 4  # blobs downloaded at once by the bulk download (each get_file: 4 ranges at once)
RECOVERY_TREE_PREFIX = "recovery-tree"
# Half the round trip to "a bucket in the cloud" (tests/fixtures/lag_proxy.py): 20 ms, as from a
# host to S3 in a neighbouring region, or to a server of another provider.
LAG_MS = 10.0


def last_page_in(lazy: dict | None, timeout: float = LAST_PAGE_TIMEOUT_S) -> dict:
    """Seconds from now until a lazy restore's page server has put back the last page: its
    figures (ckpt.restore.lazy.page_server_stats: the live record it rewrites 4 times a
    second, then its final figures) say "done" once every page is in, before it keeps the
    packs it fetched ahead in the cache. Polled every 5 ms, bounded by timeout; a server that
    ends without saying so fails the wait. A restore that was not lazy: 0 s."""
    if not lazy:
        return {"wait_s": 0.0}
    from ckpt.restore.lazy import page_server_stats

    started = time.perf_counter()
    server = lazy["server_pid"]
    work_dir = Path(lazy["log"]).parent
    records = Settings.from_environment().lazy_dir
    deadline = time.monotonic() + timeout
    while True:
        figures = page_server_stats(server, work_dir, records) or {}
        status = str(figures.get("status", ""))
        if status == "done" or status.startswith("failed"):
            break
        if state(server) in (None, "Z") and not page_server_stats(server, work_dir, records):
            raise SystemExit(f"the page server {server} of a lazy restore ended without its figures")
        if time.monotonic() > deadline:
            raise SystemExit(f"the page server {server} of a lazy restore was not done after {timeout:.0f} s")
        time.sleep(LAST_PAGE_POLL_S)
    waited = time.perf_counter() - started
    if status != "done":
        raise SystemExit(f"the page server {server} of a lazy restore failed: {status}")
    return {"wait_s": waited, "pages_served": figures.get("pages_served"), "pages": figures.get("pages_total"),
            "server_s": figures.get("last_page_s"), "all_fetched_s": figures.get("all_fetched_s"),
            "bytes_fetched": figures.get("bytes_fetched"), "store_requests": figures.get("store_requests")}


def ckpt_restore_timed(args: list[str], env: dict) -> dict:
    """`ckpt restore ARGS --json`: seconds until the tree runs (the command returned) and until
    its last page is in (the same for an eager restore); the tree is ended whatever happens."""
    elapsed, out = timed(CKPT + ["restore", *args, "--json"], env)
    restored = json.loads(out)
    try:
        filled = last_page_in(restored.get("lazy"))
    finally:
        end_tree(restored["pid"])
        if restored.get("lazy"):
            # Once done, the page server goes on keeping the packs it fetched in the cache:
            # the next step (removing that cache, a measured step) waits until it has ended.
            gone([restored["lazy"]["server_pid"]])
    # (the restore's own account of a lazy restore, as it says it: pages, bytes, and what later code adds)
    return {"running_s": elapsed, "last_page_s": elapsed + filled.pop("wait_s"), "lazy": bool(restored.get("lazy")),
            **filled, "reported": restored.get("lazy") or {}}


def criu_restore_timed(criu: str, images: Path, root: int) -> float:
    """Raw `criu restore -d` of images (the tree's memory is all in when it returns); the
    tree (root and its descendants) is ended afterwards."""
    try:
        elapsed, _ = timed([criu, "restore", "-D", str(images), "-d", "-o", "restore.log"])
    finally:
        end_tree(root)
    return elapsed


def raw_dump(criu: str, pid: int, images: Path, leave_running: bool = True) -> float:
    """Raw `criu dump` into images (made here), with the network lock ckpt takes for a target
    without TCP connections: none."""
    images.mkdir()
    return timed([criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--network-lock", "skip"]
                 + (["--leave-running"] if leave_running else []))[0]


def end_tree(root: int, reap=None) -> None:
    """SIGKILL to root and every descendant at once, then a wait until all are gone (reap:
    how this process reaps the root, if it is its child): end_trees waits for each in turn,
    and this machine's init reaps each orphan a second or two late (a tree of 100 took
    minutes)."""
    from tests.helpers import tree_pids

    pids = tree_pids(root)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if reap:
        reap()
    gone(pids)


def gone(pids: list[int], timeout: float = 60) -> None:
    """Waits until none of pids is left, not even a zombie (init reaps orphans late here):
    a restore needs them free."""
    deadline = time.monotonic() + timeout
    while any(state(pid) is not None for pid in pids):
        if time.monotonic() > deadline:
            raise SystemExit(f"processes {[p for p in pids if state(p) is not None][:5]} did not go away")
        time.sleep(0.02)


def rotated(items: list, run: int) -> list:
    """The order of the sides in this run: each comes first in turn."""
    k = run % len(items)
    return items[k:] + items[:k]


def pause() -> None:
    """Before each measured step: whatever the step before freed has gone back to the host,
    so that every side faults in memory the host took back and none reuses memory another
    just freed (timed() then writes back the page cache)."""
    time.sleep(RETURN_PAUSE)


def download_directory(work: Path, needed: int) -> Path:
    """Where the bulk download writes its files: a tmpfs (/dev/shm) with room for them, else
    work. On this machine, the first write of a file on ext4 into memory the host took back
    costs 11-14 s per GiB (perf: 98% in copy_folio_from_iter_atomic; 0.35 s when the memory
    was just freed), while tmpfs and anonymous memory cost 0.3-0.5 s either way: into ext4 the
    reference would measure that, not the download. The restore it is set against puts its
    pages into anonymous memory."""
    shm = Path("/dev/shm")
    try:
        room = os.statvfs(shm)
    except OSError:
        return work
    if room.f_bavail * room.f_frsize < needed + (256 << 20) or not os.access(shm, os.W_OK):
        return work
    return shm


def bulk_download(backend, names: list[str], dest: Path) -> float:
    """Seconds to download the blobs into files in dest (made here, removed afterwards) by the
    backend's get_file, RECOVERY_WORKERS blobs at once; the page cache is written back before."""
    dest.mkdir(mode=0o700)
    try:
        settle()
        began = time.perf_counter()
        with ThreadPoolExecutor(RECOVERY_WORKERS) as pool:
            list(pool.map(lambda name: backend.get_file(name, dest / name.replace("/", "-")), names))
        return time.perf_counter() - began
    finally:
        shutil.rmtree(dest)


def bench_recovery_s3(server: WeedServer, work: Path, criu: str, size_mib: int, runs: int) -> dict:
    """A size_mib DirtyTarget dumped once (the store's only checkpoint) into an encrypted store
    in S3, and by raw CRIU to local disk; the target then ends. Each run, in rotated order,
    each step RETURN_PAUSE after the one before: `ckpt restore` on "another host" (a fresh
    empty CKPT_CACHE): until the tree runs, until its last page is in; the bulk download of
    the same objects (every blob under packs/, objects/, index/: the checkpoint's bytes) by
    ckpt's encrypted S3 backend, get_file of RECOVERY_WORKERS blobs at once, into local
    files; raw `criu restore -d` of the local images; and, where `ckpt cache warm` exists, a
    restore after warming another fresh cache with it (the warm itself timed too)."""
    from ckpt.store import keys
    from ckpt.store.backends import s3

    url = f"s3://{S3_BUCKET}/{RECOVERY_PREFIX}"
    env = {**os.environ, **server.environment(), "CKPT_STORE": url, "CKPT_PASSWORD": S3_PASSWORD,
           "CKPT_CACHE": str(work / "recovery-cache-host-a")}
    warm_missing = ckpt_lacks("cache warm")
    timed(CKPT + ["init", "-q"], env)
    target = DirtyTarget(size_mib, work)
    pid = target.proc.pid
    raw_images = work / "recovery-s3-raw"
    try:
        dump_s, out = timed(CKPT + ["dump", str(pid), "--json", "--name", "recovery"], env)
        checkpoint = json.loads(out)["id"]
        raw_dump_s = raw_dump(criu, pid, raw_images)
    finally:
        target.end()
    with _environment(server.environment()):
        backend = keys.unlock(s3.S3Backend(S3_BUCKET, RECOVERY_PREFIX), S3_PASSWORD.encode())
        blobs = [info for kind in ("packs/", "objects/", "index/") for info in backend.list(kind)]
    names = [info.name for info in blobs]
    download_to = download_directory(work, sum(info.size for info in blobs))
    steps = ["ckpt", "download", "criu"] + ([] if warm_missing else ["warm"])
    rows: dict[str, list] = {"ckpt_running_s": [], "ckpt_last_page_s": [], "ckpt_serving": [], "download_s": [],
                             "criu_restore_s": [], "warm_s": [], "warm_running_s": [], "warm_last_page_s": [],
                             "warm_serving": []}
    try:
        for run in range(runs):
            for step in rotated(steps, run):
                pause()
                if step == "ckpt":
                    cache = work / f"recovery-cache-host-b-{run}"
                    r = ckpt_restore_timed([checkpoint], {**env, "CKPT_CACHE": str(cache)})
                    rows["ckpt_running_s"].append(r["running_s"])
                    rows["ckpt_last_page_s"].append(r["last_page_s"])
                    rows["ckpt_serving"].append({k: v for k, v in r.items() if k not in ("running_s", "last_page_s")})
                    shutil.rmtree(cache)
                elif step == "download":
                    with _environment(server.environment()):
                        dest = download_to / f"ckpt-bench-{os.getpid()}"
                        rows["download_s"].append(bulk_download(backend, names, dest))
                elif step == "criu":
                    rows["criu_restore_s"].append(criu_restore_timed(criu, raw_images, pid))
                elif not warm_missing:
                    cache = work / f"recovery-cache-standby-{run}"
                    standby = {**env, "CKPT_CACHE": str(cache)}
                    try:
                        rows["warm_s"].append(timed(CKPT + ["cache", "warm", "recovery", "--store", url],
                                                    standby)[0])
                    except SystemExit as failed:  # a command still being written: its row says why, the rest goes on
                        warm_missing = f"`ckpt cache warm` failed: {str(failed).strip().splitlines()[-1]}"
                        shutil.rmtree(cache, ignore_errors=True)
                        continue
                    pause()
                    r = ckpt_restore_timed([checkpoint], standby)
                    rows["warm_running_s"].append(r["running_s"])
                    rows["warm_last_page_s"].append(r["last_page_s"])
                    rows["warm_serving"].append({k: v for k, v in r.items() if k not in ("running_s", "last_page_s")})
                    shutil.rmtree(cache)
    finally:
        backend.close()
        shutil.rmtree(raw_images, ignore_errors=True)
    return {"size_mib": size_mib, "runs": runs, "checkpoint": checkpoint, "dump_s": dump_s, "raw_dump_s": raw_dump_s,
            "blobs": len(blobs), "blob_bytes": sum(info.size for info in blobs), "download_workers": RECOVERY_WORKERS,
            "download_to": str(download_to),
            "warm_missing": warm_missing, "samples": rows,
            "medians": {k: statistics.median(v) for k, v in rows.items() if v and not isinstance(v[0], dict)}}


def _tree_dumped(count: int, work: Path, env: dict) -> tuple[str, float]:
    """A BenchTree of 1 + count processes dumped with `--stop` into a store made first:
    (checkpoint id, seconds of the dump)."""
    timed(CKPT + ["init", "-q"], env)
    tree = BenchTree(count, work)
    try:
        dump_s, out = timed(CKPT + ["dump", str(tree.proc.pid), "--stop", "--json", "--name", f"tree-{count}"], env)
        tree.dumped()
    finally:
        if state(tree.proc.pid) not in (None, "Z"):
            tree.end()
    return json.loads(out)["id"], dump_s


def bench_recovery_tree_s3(server: WeedServer, work: Path, count: int, runs: int) -> dict:
    """A tree of 1 + count processes dumped once (`--stop`) into an encrypted store in S3. Each
    run, in rotated order, RETURN_PAUSE before each step: `ckpt restore --eager` into a fresh
    empty CKPT_CACHE (another host) and the bulk download of the same blobs (see
    bench_recovery_s3), each from the server directly and through a LaggingProxy that puts it
    a round trip of 2 x LAG_MS away (as a bucket in the cloud is: its hundreds of small
    images are requests that mostly wait); and the bulk download of only what the restore
    reads (_blobs_a_restore_reads: its bundle instead of the objects it holds copies of)."""
    from ckpt.store import keys
    from ckpt.store.backends import s3

    url = f"s3://{S3_BUCKET}/{RECOVERY_TREE_PREFIX}"
    env = {**os.environ, "CKPT_STORE": url, "CKPT_PASSWORD": S3_PASSWORD,
           "CKPT_CACHE": str(work / "recovery-tree-s3-cache-a")}
    checkpoint, dump_s = _tree_dumped(count, work, {**env, **server.environment()})
    proxy = LaggingProxy(server, LAG_MS).start()
    places = {"near": server.environment(), "far": proxy.environment()}
    backends = {}
    rows: dict[str, list] = {f"{place}_{what}": [] for place in places
                             for what in ("restore_s", "download_s", "needed_s")}
    try:
        for place, place_env in places.items():
            with _environment(place_env):
                backends[place] = keys.unlock(s3.S3Backend(S3_BUCKET, RECOVERY_TREE_PREFIX), S3_PASSWORD.encode())
        blobs = [info for kind in ("packs/", "objects/", "index/") for info in backends["near"].list(kind)]
        needed = _blobs_a_restore_reads(backends["near"], checkpoint)
        download_to = download_directory(work, sum(info.size for info in blobs))
        for run in range(runs):
            for place, what in rotated([(p, w) for p in places for w in ("restore", "download", "needed")], run):
                pause()
                if what == "restore":
                    cache = work / f"recovery-tree-s3-cache-{place}-{run}"
                    try:
                        r = ckpt_restore_timed([checkpoint, "--eager"],
                                               {**env, **places[place], "CKPT_CACHE": str(cache)})
                    finally:
                        shutil.rmtree(cache, ignore_errors=True)
                    rows[f"{place}_restore_s"].append(r["last_page_s"])
                else:
                    chosen = blobs if what == "download" else needed
                    with _environment(places[place]):
                        rows[f"{place}_{what}_s"].append(bulk_download(
                            backends[place], [info.name for info in chosen], download_to / f"ckpt-bench-{os.getpid()}"))
    finally:
        for backend in backends.values():
            backend.close()
        proxy.stop()
    return {"count": count, "runs": runs, "lag_ms": LAG_MS, "dump_s": dump_s, "blobs": len(blobs),
            "blob_bytes": sum(info.size for info in blobs), "needed_blobs": len(needed),
            "needed_bytes": sum(info.size for info in needed), "samples": rows,
            "medians": {k: statistics.median(v) for k, v in rows.items() if v}}


def _blobs_a_restore_reads(backend, checkpoint: str) -> list:
    """What a restore of the checkpoint downloads: every pack and index file, the checkpoint's
    bundle (ckpt/store/bundles.py), and the objects it names that the bundle holds no copy of."""
    from ckpt.store.objects import codecs_from, object_name
    from ckpt.store.repository import Store

    manifest = json.loads(backend.get(Store.manifest_name(checkpoint)))
    bundle = manifest.get("bundle") or {}
    spans = bundle.get("spans", {})
    found = [info for kind in ("packs/", "index/") for info in backend.list(kind)]
    found += [info for info in backend.list("bundles/") if info.name == bundle.get("blob")]
    names = {object_name(entry["hash"], codecs_from(entry["codec"])[0]) for entry in manifest["files"]
             if entry["hash"] not in spans}
    return found + [backend.stat(name) for name in sorted(names)]


def bench_recovery_local(work: Path, criu: str, size_mib: int, runs: int) -> dict:
    """A size_mib DirtyTarget dumped once by ckpt (local store) and once by raw CRIU
    (--leave-running, its own directory), then ended. Each run, in rotated order,
    RETURN_PAUSE before each: `ckpt restore` (lazy, the default: until the tree runs and
    until its last page is in), `ckpt restore --eager`, raw `criu restore -d`."""
    env = {**os.environ, "CKPT_STORE": str(work / "recovery-store"), "CKPT_CACHE": str(work / "recovery-cache")}
    target = DirtyTarget(size_mib, work)
    pid = target.proc.pid
    raw_images = work / "recovery-local-raw"
    try:
        checkpoint = json.loads(timed(CKPT + ["dump", str(pid), "--json", "--name", "recovery"], env)[1])["id"]
        raw_dump(criu, pid, raw_images)
    finally:
        target.end()
    rows: dict[str, list] = {"lazy_running_s": [], "lazy_last_page_s": [], "lazy_serving": [], "eager_s": [],
                             "criu_restore_s": []}
    try:
        for run in range(runs):
            for step in rotated(["lazy", "eager", "criu"], run):
                pause()
                if step == "lazy":
                    r = ckpt_restore_timed([checkpoint], env)
                    rows["lazy_running_s"].append(r["running_s"])
                    rows["lazy_last_page_s"].append(r["last_page_s"])
                    rows["lazy_serving"].append({k: v for k, v in r.items() if k not in ("running_s", "last_page_s")})
                elif step == "eager":
                    rows["eager_s"].append(ckpt_restore_timed([checkpoint, "--eager"], env)["running_s"])
                else:
                    rows["criu_restore_s"].append(criu_restore_timed(criu, raw_images, pid))
    finally:
        shutil.rmtree(raw_images, ignore_errors=True)
    return {"size_mib": size_mib, "runs": runs, "checkpoint": checkpoint, "samples": rows,
            "medians": {k: statistics.median(v) for k, v in rows.items() if not isinstance(v[0], dict)}}


class BenchTree:
    """tests/fixtures/bench_tree.py: one parent and `count` children holding TREE_CHILD_MIB of
    random data each, in a session of its own."""

    def __init__(self, count: int, work: Path):
        self.out = work / f"tree-{time.monotonic_ns()}"
        self.proc = subprocess.Popen([sys.executable, str(BENCH_TREE), str(self.out), str(count), str(TREE_CHILD_MIB)],
                                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        words: list[str] = []
        while not words:
            text = self.out.read_text() if self.out.exists() else ""
            words = text.split() if text.endswith("\n") else []  # a whole line, not one being written
            if (not words and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.end()
                raise SystemExit("the benchmark's process tree died or hung")
            time.sleep(0.05)
        self.pids = [self.proc.pid, *map(int, words[1:])]
        if words[0] != "ready":
            self.end()
            raise SystemExit("a child of the benchmark's process tree died")

    def dumped(self) -> None:
        """After a dump that ended the tree: the parent reaped, every PID free again."""
        self.proc.wait(timeout=60)
        gone(self.pids)

    def end(self) -> None:
        end_tree(self.proc.pid, reap=lambda: self.proc.wait(timeout=60))


def bench_recovery_tree(work: Path, criu: str, counts: list[int], runs: int) -> dict:
    """After a first dump of a small tree by each side (not measured), for each N: each run, a
    fresh tree of 1 + N processes dumped by `ckpt dump --stop` and another by raw
    `criu dump` (which ends the tree too), in rotated order; then, rotated,
    `ckpt restore --eager`, `ckpt restore` (the default: lazy at this size where possible;
    until it runs and until its last page is in) and raw `criu restore -d` of those two
    dumps; RETURN_PAUSE before each step."""
    env = {**os.environ, "CKPT_STORE": str(work / "recovery-tree-store"),
           "CKPT_CACHE": str(work / "recovery-tree-cache")}
    # Not measured: a first dump of a small tree by each side, so that no measured dump pays
    # for creating the store (or for reading either side's code from disk).
    for who in ("ckpt", "criu"):
        tree = BenchTree(1, work)
        try:
            if who == "ckpt":
                timed(CKPT + ["dump", str(tree.proc.pid), "--stop", "-q"], env)
            else:
                raw_dump(criu, tree.proc.pid, work / "recovery-tree-first", leave_running=False)
                shutil.rmtree(work / "recovery-tree-first")
            tree.dumped()
        finally:
            if state(tree.proc.pid) not in (None, "Z"):
                tree.end()
    by_count = {}
    for count in counts:
        rows: dict[str, list] = {"ckpt_dump_s": [], "criu_dump_s": [], "eager_s": [], "default_running_s": [],
                                 "default_last_page_s": [], "default_lazy": [], "criu_restore_s": []}
        for run in range(runs):
            raw_images = work / f"recovery-tree-raw-{count}-{run}"
            checkpoint, raw_root = None, None
            for who in rotated(["ckpt", "criu"], run):
                pause()
                tree = BenchTree(count, work)
                try:
                    if who == "ckpt":
                        elapsed, out = timed(CKPT + ["dump", str(tree.proc.pid), "--stop", "--json", "--name",
                                                     f"tree-{count}"], env)
                        checkpoint = json.loads(out)["id"]
                        rows["ckpt_dump_s"].append(elapsed)
                    else:
                        rows["criu_dump_s"].append(raw_dump(criu, tree.proc.pid, raw_images, leave_running=False))
                        raw_root = tree.proc.pid
                    tree.dumped()
                finally:
                    if state(tree.proc.pid) not in (None, "Z"):
                        tree.end()
            try:
                for step in rotated(["eager", "default", "criu"], run):
                    pause()
                    if step == "eager":
                        rows["eager_s"].append(ckpt_restore_timed([checkpoint, "--eager"], env)["running_s"])
                    elif step == "default":
                        r = ckpt_restore_timed([checkpoint], env)
                        rows["default_running_s"].append(r["running_s"])
                        rows["default_last_page_s"].append(r["last_page_s"])
                        rows["default_lazy"].append(r["lazy"])
                    else:
                        rows["criu_restore_s"].append(criu_restore_timed(criu, raw_images, raw_root))
            finally:
                shutil.rmtree(raw_images, ignore_errors=True)
        by_count[count] = {"samples": rows, "medians": {k: statistics.median(v) for k, v in rows.items()
                                                        if k != "default_lazy"}}
    return {"child_mib": TREE_CHILD_MIB, "counts": counts, "runs": runs, "by_count": by_count}


def bench_recovery(work: Path, criu: str, s3_mib: int, local_mib: int, tree_counts: list[int], runs: int) -> dict:
    load_before = os.getloadavg()
    reporting = free_page_reporting()
    server_dir = work / "recovery-weed"
    server_dir.mkdir()
    began = time.monotonic()
    server = WeedServer(server_dir).start()
    try:
        server.client().create_bucket(Bucket=S3_BUCKET)
        from_s3 = bench_recovery_s3(server, work, criu, s3_mib, runs)
        took = {"s3": time.monotonic() - began}
        tree_s3 = bench_recovery_tree_s3(server, work, max(tree_counts), runs)
        took["tree from s3"] = time.monotonic() - began - took["s3"]
    finally:
        server.stop()
    local = bench_recovery_local(work, criu, local_mib, runs)
    took["local"] = time.monotonic() - began - sum(took.values())
    tree = bench_recovery_tree(work, criu, tree_counts, runs)
    took["tree"] = time.monotonic() - began - sum(took.values())
    result = {"return_pause_s": RETURN_PAUSE, "free_page_reporting": reporting["reporting"],
              "load_average": {"before": load_before, "after": os.getloadavg()}, "took_s": took,
              "s3": from_s3, "tree_s3": tree_s3, "local": local, "tree": tree}
    result["table"] = recovery_table(result)
    return result


def recovery_table(r: dict) -> list[dict]:
    """The rows of issue 28's table: what, ckpt, the reference and what it is, the ratio, the goal
    (a limit the ratio must stay under, or at most), and whether it was met."""
    rows = []

    def row(what: str, ckpt: float | None, reference: float | None, ref_what: str, limit: float | None = None,
            strict: bool = False, note: str = "") -> None:
        ratio = ckpt / reference if ckpt is not None and reference else None
        met = None if limit is None or ratio is None else (ratio < limit if strict else ratio <= limit)
        rows.append({"what": what, "ckpt_s": ckpt, "reference_s": reference, "reference": ref_what, "ratio": ratio,
                     "goal": None if limit is None else f"{'<' if strict else '<='} {limit:g}", "met": met,
                     "note": note})

    s, m = r["s3"], r["s3"]["medians"]
    raw = "criu restore -d, local disk"
    row(f"{s['size_mib']} MiB from S3, empty cache (another host): the tree runs", m["ckpt_running_s"],
        m["criu_restore_s"], raw)
    row("  ... until its last page is back", m["ckpt_last_page_s"], m["download_s"],
        f"bulk download, {s['blobs']} blobs, {s['blob_bytes'] / 2**20:.0f} MiB", 1.5)
    if s["warm_missing"] or not s["samples"]["warm_running_s"]:
        row("from S3 after `ckpt cache warm`", None, None, "", note=s["warm_missing"])
    else:
        row("from S3 after `ckpt cache warm`: the tree runs", m["warm_running_s"], m["criu_restore_s"], raw, 1.0,
            strict=True, note=f"warm took {m['warm_s']:.2f} s")
        row("  ... until its last page is back", m["warm_last_page_s"], m["criu_restore_s"], raw, 1.5)
    ts3 = r.get("tree_s3")
    if ts3:
        tm3 = ts3["medians"]
        bulk = f"bulk download, {ts3['blobs']} blobs, {ts3['blob_bytes'] / 2**20:.0f} MiB"
        row(f"1 + {ts3['count']} processes from S3, empty cache: `ckpt restore --eager`", tm3["near_restore_s"],
            tm3["near_download_s"], bulk, 1.5)
        row(f"  ... the bucket {2 * ts3['lag_ms']:g} ms away", tm3["far_restore_s"], tm3["far_download_s"],
            bulk + ", as far", 1.5)
        if tm3.get("near_needed_s"):
            needed = (f"bulk download of what it reads, {ts3['needed_blobs']} blobs, "
                      f"{ts3['needed_bytes'] / 2**20:.0f} MiB")
            row("  ... against only what the restore reads", tm3["near_restore_s"], tm3["near_needed_s"], needed, 1.5)
            row(f"  ... the bucket {2 * ts3['lag_ms']:g} ms away", tm3["far_restore_s"], tm3["far_needed_s"],
                needed + ", as far", 1.5)
    loc, lm = r["local"], r["local"]["medians"]
    row(f"{loc['size_mib']} MiB local, lazy (the default): the tree runs", lm["lazy_running_s"], lm["criu_restore_s"],
        "criu restore -d", 1.0, strict=True)
    row("  ... until its last page is back", lm["lazy_last_page_s"], lm["criu_restore_s"], "criu restore -d", 1.5)
    row("  `ckpt restore --eager`", lm["eager_s"], lm["criu_restore_s"], "criu restore -d", 1.5)
    tree = r["tree"]
    last = max(tree["counts"])
    for count in tree["counts"]:
        tm = tree["by_count"][count]["medians"]
        limit = 1.5 if count == last and count >= 100 else None
        lazy = "lazy" if all(tree["by_count"][count]["samples"]["default_lazy"]) else "eager"
        row(f"1 + {count} processes ({tree['child_mib']} MiB each): `ckpt dump --stop`", tm["ckpt_dump_s"],
            tm["criu_dump_s"], "criu dump", limit)
        row("  `ckpt restore --eager`", tm["eager_s"], tm["criu_restore_s"], "criu restore -d", limit)
        row(f"  `ckpt restore` (default, {lazy}): the tree runs", tm["default_running_s"], tm["criu_restore_s"],
            "criu restore -d")
        row("  ... until its last page is back", tm["default_last_page_s"], tm["criu_restore_s"], "criu restore -d")
    return rows


def print_recovery(r: dict) -> None:
    s, loc, tree = r["s3"], r["local"], r["tree"]
    load = r["load_average"]
    print(f"recovery time (issue 28), {s['runs']} runs, medians; each measured step starts {r['return_pause_s']:g} s "
          f"after the step before freed its memory, once the page cache is written back (sync): every side faults "
          f"in memory the host took back (free page reporting {'on' if r['free_page_reporting'] else 'off'}), none "
          f"reuses memory another just freed; the order of the sides rotates from run to run; load average (1 min) "
          f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after; took "
          + ", ".join(f"{part} {seconds:.0f} s" for part, seconds in r["took_s"].items()))
    print(f"  from S3: an encrypted store in SeaweedFS on 127.0.0.1 holding one checkpoint of a {s['size_mib']} MiB "
          f"target (dirtymem, random data; dump {s['dump_s']:.2f} s, raw criu dump to local disk "
          f"{s['raw_dump_s']:.2f} s); another host is a fresh empty CKPT_CACHE; the bulk download is get_file of "
          f"ckpt's encrypted S3 backend, {s['download_workers']} blobs at once, of every blob under packs/, "
          f"objects/, index/, into files in {s.get('download_to', 'the work directory')}; the last page is in "
          f"when the page server's figures say done (its live record /run/ckpt/lazy/<pid>.json, polled every "
          f"5 ms)")
    print(f"  local: a {loc['size_mib']} MiB target dumped by ckpt and by raw criu (--leave-running, its own "
          f"directory); trees: one parent and N children of {tree['child_mib']} MiB (tests/fixtures/bench_tree.py), "
          f"each side dumping a fresh tree")
    print(f"  {'what':64} {'ckpt':>8} {'reference':>10}  {'ratio':>6} {'goal':>7}  met  reference is")
    for row in r["table"]:
        if row["ckpt_s"] is None:
            print(f"  {row['what']:64} skipped: {row['note']}")
            continue
        ratio = "" if row["ratio"] is None else f"{row['ratio']:6.2f}"
        met = "" if row["met"] is None else ("yes" if row["met"] else "NO")
        print(f"  {row['what']:64} {row['ckpt_s']:7.2f}s {row['reference_s']:9.2f}s  {ratio:>6} "
              f"{row['goal'] or '':>7}  {met:3}  {row['reference']}" + (f" ({row['note']})" if row["note"] else ""))
    ss = s["samples"]
    print(f"  samples, from S3: runs {_samples(ss['ckpt_running_s'])} s, last page {_samples(ss['ckpt_last_page_s'])}"
          f" s; bulk download {_samples(ss['download_s'])} s; raw restore {_samples(ss['criu_restore_s'])} s"
          + ("" if not ss["warm_running_s"] else f"; warm {_samples(ss['warm_s'])} s, then runs "
             f"{_samples(ss['warm_running_s'])} s, last page {_samples(ss['warm_last_page_s'])} s"))
    for label, serving in (("from S3", ss["ckpt_serving"]), ("from S3, warmed cache", ss["warm_serving"]),
                           ("local", loc["samples"]["lazy_serving"])):
        for sv in serving:
            if sv.get("server_s") is not None:
                fetched = ("" if not sv.get("store_requests") else
                           f"; {sv['bytes_fetched'] / (1 << 20):.0f} MiB fetched in {sv['store_requests']} requests, "
                           f"the last {sv['all_fetched_s']:.2f} s after it started")
                print(f"    page server, {label}: {sv['pages_served']} pages in of {sv['pages']}, the last "
                      f"{sv['server_s']:.2f} s after it started" + fetched)
    if r.get("tree_s3"):
        ts = r["tree_s3"]["samples"]
        print(f"  samples, 1 + {r['tree_s3']['count']} processes from S3 (dumped in {r['tree_s3']['dump_s']:.2f} s): "
              f"--eager {_samples(ts['near_restore_s'])} s, bulk download {_samples(ts['near_download_s'])} s; "
              f"{2 * r['tree_s3']['lag_ms']:g} ms away (tests/fixtures/lag_proxy.py) --eager "
              f"{_samples(ts['far_restore_s'])} s, bulk download {_samples(ts['far_download_s'])} s"
              + (f"; bulk download of what the restore reads {_samples(ts['near_needed_s'])} s, "
                 f"{_samples(ts['far_needed_s'])} s as far" if ts.get("near_needed_s") else ""))
    ls = loc["samples"]
    print(f"  samples, local: lazy runs {_samples(ls['lazy_running_s'])} s, last page "
          f"{_samples(ls['lazy_last_page_s'])} s; --eager {_samples(ls['eager_s'])} s; raw restore "
          f"{_samples(ls['criu_restore_s'])} s")
    for count in tree["counts"]:
        ts = tree["by_count"][count]["samples"]
        print(f"  samples, 1 + {count} processes: ckpt dump --stop {_samples(ts['ckpt_dump_s'])} s, criu dump "
              f"{_samples(ts['criu_dump_s'])} s; --eager {_samples(ts['eager_s'])} s; default runs "
              f"{_samples(ts['default_running_s'])} s, last page {_samples(ts['default_last_page_s'])} s; raw "
              f"restore {_samples(ts['criu_restore_s'])} s")


SECTIONS = ["growth", "dump", "scale", "s3", "cadence", "group", "migrate", "clones", "recovery"]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--growth-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--s3-mib", type=int, default=512, help="bytes up and down S3, in MiB")
    parser.add_argument("--s3-target-mib", type=int, default=1024, help="the target dumped into S3 and restored")
    parser.add_argument("--cadence-mib", type=int, default=2048, help="each cadence target, in MiB")
    parser.add_argument("--cadence-interval", type=float, default=30.0, help="seconds between a side's dumps")
    parser.add_argument("--cadence-dumps", type=int, default=5, help="dumps at the cadence after the first")
    parser.add_argument("--cadence-series", type=int, default=3, help="dumps back to back per side")
    parser.add_argument("--group-mib", type=int, default=1024, help="each of the group's two targets, in MiB")
    parser.add_argument("--migrate-mib", type=_mib_list, default=[1024, 4096],
                        help="the migrated targets' sizes, in MiB, comma-separated")
    parser.add_argument("--migrate-runs", type=int, default=3, help="runs of each side per migrated size")
    parser.add_argument("--migrate-eager", action="store_true", help="also measure `ckpt migrate --eager`")
    parser.add_argument("--clone-mib", type=int, default=1024, help="the cloned checkpoint's target, in MiB")
    parser.add_argument("--clone-copies", type=_mib_list, default=[1, 4, 16], help="copies per clone, comma-separated")
    parser.add_argument("--clone-runs", type=int, default=1, help="runs of each number of copies")
    parser.add_argument("--recovery-s3-mib", type=int, default=1024,
                        help="the recovery section's target restored from S3, in MiB (its local one: --size-mib)")
    parser.add_argument("--recovery-tree-n", type=_mib_list, default=[25, 100],
                        help="children of the recovery section's process trees, comma-separated")
    parser.add_argument("--only", choices=SECTIONS, action="append")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    only = set(args.only or SECTIONS)
    # The bytecode of the ckpt measured, as an installed ckpt has it (`make bench` compiles it
    # through `make setup`): run straight from a fresh clone with PYTHONDONTWRITEBYTECODE set,
    # every `ckpt` command compiled its modules again, time no installed ckpt spends
    # (`ckpt --version` 0.41-0.45 s against 0.24 s; a 100-process `dump --stop` about 0.08 s).
    compileall.compile_dir(ROOT / "ckpt", quiet=1, workers=0)
    criu = find_criu(Settings.from_environment()).path
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/var/tmp"))
    results: dict = {}
    try:
        if "growth" in only:
            g = results["growth"] = bench_growth(args.growth_mib, work)
            print(f"store growth, {g['size_mib']} MiB target rewriting 1% of its pages between checkpoints:")
            later = ", ".join(f"{a / 2**20:.1f}" for a in g["bytes_added"][1:])
            print(f"  added by checkpoint 1: {g['bytes_added'][0] / 2**20:.1f} MiB; checkpoints 2-10: {later} MiB "
                  f"(max {g['max_later_percent']:.2f}% of the target, goal <= 3%)")
        if "dump" in only:
            d = results["dump"] = bench_dump_restore(args.size_mib, args.runs, work, criu)
            m, r = d["medians"], d["ratios"]
            print(f"dump and restore, {d['size_mib']} MiB target, {d['runs']} runs, medians:")
            print(f"  {'':26} {'ckpt':>9} {'raw criu':>9} {'ratio':>6}")
            print(f"  {'first dump (all new)':26} {m['ckpt_first_dump_s']:8.2f}s {m['criu_dump_s']:8.2f}s "
                  f"{r['first_dump_wall']:6.2f}")
            print(f"  {'next dump (1% changed)':26} {m['ckpt_next_dump_s']:8.2f}s {m['criu_dump_s']:8.2f}s "
                  f"{r['next_dump_wall']:6.2f}   goal <= 1.3")
            print(f"  {'freeze':26} {m['ckpt_freeze_ms']:7.0f}ms {m['criu_freeze_ms']:7.0f}ms {r['freeze']:6.2f}   "
                  f"goal <= 1.1")
            print(f"  {'restore (lazy, default)':26} {m['ckpt_restore_s']:8.2f}s {m['criu_restore_s']:8.2f}s "
                  f"{r['restore_wall']:6.2f}   goal <= 1.5")
            print(f"  {'  ... until all memory in':26} {m['ckpt_restore_all_memory_s']:8.2f}s "
                  f"{m['criu_restore_s']:8.2f}s {r['restore_all_memory']:6.2f}")
            print(f"  {'restore --eager':26} {m['ckpt_restore_eager_s']:8.2f}s {m['criu_restore_s']:8.2f}s "
                  f"{r['restore_eager_wall']:6.2f}")
        if "scale" in only:
            s = results["scale"] = bench_scale(work)
            print(f"scale: ckpt list of {s['list_count']} checkpoints {s['list_s']:.2f}s (goal < 1 s); "
                  f"ckpt prune of a store of {s['dumped']} checkpoints (90 forgotten) {s['prune_100_s']:.2f}s, "
                  f"freed {s['prune_bytes_freed'] / 2**20:.1f} MiB")
        if "s3" in only:
            print_s3(results.setdefault("s3", bench_s3(work, criu, args.s3_mib, args.s3_target_mib, args.runs)))
        if "cadence" in only:
            print_cadence(results.setdefault("cadence", bench_cadence(
                args.cadence_mib, args.cadence_interval, args.cadence_dumps, args.cadence_series, args.runs, work,
                criu)))
        if "group" in only:
            print_group(results.setdefault("group", bench_group(args.group_mib, args.runs, work)))
        if "migrate" in only:
            print_migrate(results.setdefault("migrate", bench_migrate(args.migrate_mib, args.migrate_runs, work,
                                                                      criu, args.migrate_eager)))
        if "clones" in only:
            print_clones(results.setdefault("clones", bench_clones(args.clone_mib, args.clone_copies,
                                                                   args.clone_runs, work, criu)))
        if "recovery" in only:
            print_recovery(results.setdefault("recovery", bench_recovery(
                work, criu, args.recovery_s3_mib, args.size_mib, args.recovery_tree_n, args.runs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")
    missing = [r["missing"] for r in results.values() if isinstance(r, dict) and r.get("missing")]
    if missing:
        raise SystemExit("Error: " + "; ".join(missing))


def _mib_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    main()
