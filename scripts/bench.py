#!/usr/bin/env python3
"""ckpt's benchmarks, measured side by side with raw CRIU in one run.

  store growth  a target holding --growth-mib of random data rewrites 1% of its pages (random
                positions) between checkpoints; what each checkpoint adds to the store
  dump/restore  ckpt dump (leave running) and ckpt restore of a --size-mib target next to raw
                `criu dump --leave-running` / `criu restore -d` of the same target, same disk;
                the restore (lazy by default at this size) also until its page server has put
                back the last page, and `ckpt restore --eager`
  scale         `ckpt list` with 1,000 checkpoints; `ckpt prune` of a store of 100 checkpoints

Prints a table of medians and ratios and writes JSON to bench-results/. Run as root after
`make setup`:  .venv/bin/python scripts/bench.py [--size-mib 2048] [--growth-mib 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckpt.criu.binary import find_criu  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--growth-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["growth", "dump", "scale"], action="append")
    args = parser.parse_args()
    only = set(args.only or ["growth", "dump", "scale"])
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
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
