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

Prints a table of medians and ratios (and every sample) and writes JSON to bench-results/. Run
as root after `make setup`:  .venv/bin/python scripts/bench.py [--size-mib 2048]
[--growth-mib 1024] [--runs 3] [--s3-mib 512] [--s3-target-mib 1024] [--only growth|dump|scale|s3]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckpt.criu.binary import find_criu  # noqa: E402
from tests.s3server import WeedServer, weed_binary  # noqa: E402

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
                elapsed, _ = timed([find_criu().path, "dump", "-t", str(pid), "-D", str(raw_dir), "--leave-running",
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


def timed_call(action) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--growth-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--s3-mib", type=int, default=512, help="bytes up and down S3, in MiB")
    parser.add_argument("--s3-target-mib", type=int, default=1024, help="the target dumped into S3 and restored")
    parser.add_argument("--only", choices=["growth", "dump", "scale", "s3"], action="append")
    args = parser.parse_args()
    only = set(args.only or ["growth", "dump", "scale", "s3"])
    criu = find_criu().path
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/var/tmp"))
    results: dict = {}
    try:
        if "growth" in only:
            g = results["growth"] = bench_growth(args.growth_mib, work)
            print(f"store growth, {g['size_mib']} MiB target rewriting 1% of its pages between checkpoints:")
            print("  added by checkpoint 1: %.1f MiB; checkpoints 2-10: %s (max %.2f%% of the target, goal <= 3%%)"
                  % (g["bytes_added"][0] / 2**20, ", ".join("%.1f" % (a / 2**20) for a in g["bytes_added"][1:]) + " MiB",
                     g["max_later_percent"]))
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
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
