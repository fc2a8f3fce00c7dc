#!/usr/bin/env python3
"""Dump and restore time of a large process: ckpt next to raw `criu` on the same process and disk.

Prints a table of medians and ratios and writes JSON to bench-results/. Run as root after
`make setup`:  .venv/bin/python scripts/bench_dump_restore.py [--size-mib 500] [--runs 3]
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

TARGET = """
import os, sys, time
data = bytearray(os.urandom(int(sys.argv[1]) << 20))
open(sys.argv[2], "w").write("ready")
while True:
    time.sleep(0.1)
"""


def state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


def wait_gone(pid: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_gone(pid)


def timed(cmd: list[str], env=None) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def start_target(size_mib: int, work: Path) -> subprocess.Popen:
    flag = work / "ready"
    flag.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(size_mib), str(flag)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not flag.exists():
        time.sleep(0.05)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    args = parser.parse_args()
    criu = find_criu().path
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/var/tmp"))
    env = {**os.environ, "CKPT_STORE": str(work / "store")}
    ckpt = [sys.executable, "-m", "ckpt"]
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("ckpt_dump_s", "criu_dump_s", "ckpt_freeze_ms", "criu_freeze_ms",
                                     "ckpt_restore_s", "criu_restore_s")}
    stored = []
    try:
        for run in range(args.runs):
            target = start_target(args.size_mib, work)
            pid = target.pid
            raw_dir = work / f"raw-{run}"
            raw_dir.mkdir()
            order = ["ckpt", "criu"] if run % 2 == 0 else ["criu", "ckpt"]
            checkpoint = None
            for who in order:
                if who == "ckpt":
                    elapsed, out = timed(ckpt + ["dump", str(pid), "--json", "--compression", args.compression],
                                         env)
                    result = json.loads(out)
                    checkpoint = result["id"]
                    rows["ckpt_dump_s"].append(elapsed)
                    rows["ckpt_freeze_ms"].append(result["freeze_ms"])
                    stored.append(result["bytes_stored"])
                else:
                    elapsed, _ = timed([criu, "dump", "-t", str(pid), "-D", str(raw_dir), "--leave-running",
                                        "-o", "dump.log", "--network-lock", "nftables"])
                    rows["criu_dump_s"].append(elapsed)
                    stats = subprocess.run([sys.executable, "-c", (
                        "import sys, pycriu.images as i; e = i.load(open(sys.argv[1], 'rb'))['entries'][0]['dump'];"
                        "print(e['frozen_time'])"), str(raw_dir / "stats-dump")], capture_output=True, text=True)
                    rows["criu_freeze_ms"].append(int(stats.stdout) / 1000)
            target.kill()
            target.wait()
            for who in order:
                if who == "ckpt":
                    elapsed, out = timed(ckpt + ["restore", checkpoint, "--json"], env)
                    rows["ckpt_restore_s"].append(elapsed)
                    kill(json.loads(out)["pid"])
                else:
                    elapsed, _ = timed([criu, "restore", "-D", str(raw_dir), "-d", "-o", "restore.log"])
                    rows["criu_restore_s"].append(elapsed)
                    kill(pid)
            shutil.rmtree(raw_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "dump_wall": med["ckpt_dump_s"] / med["criu_dump_s"],
        "dump_freeze": med["ckpt_freeze_ms"] / med["criu_freeze_ms"],
        "restore_wall": med["ckpt_restore_s"] / med["criu_restore_s"],
    }
    print(f"process of {args.size_mib} MiB, {args.runs} runs, compression {args.compression}, medians:")
    print(f"{'':10} {'ckpt':>10} {'raw criu':>10} {'ratio':>7}")
    print(f"{'dump':10} {med['ckpt_dump_s']:9.2f}s {med['criu_dump_s']:9.2f}s {ratios['dump_wall']:7.2f}")
    print(f"{'freeze':10} {med['ckpt_freeze_ms']:8.0f}ms {med['criu_freeze_ms']:8.0f}ms {ratios['dump_freeze']:7.2f}")
    print(f"{'restore':10} {med['ckpt_restore_s']:9.2f}s {med['criu_restore_s']:9.2f}s {ratios['restore_wall']:7.2f}")
    print(f"stored per dump (median): {statistics.median(stored) / (1 << 20):.1f} MiB")
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"dump-restore-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"size_mib": args.size_mib, "runs": args.runs, "compression": args.compression,
                                "samples": rows, "medians": med, "ratios": ratios,
                                "bytes_stored": stored}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
