"""Dumps running side by side: into one store, of one target, of a target someone else traces;
and the modes of what CRIU writes."""

import os
import subprocess
import sys
import time

from tests.helpers import ROOT, alive, ckpt, ckpt_json, read_lines, state, wait_until

ROUNDS, PARALLEL = 50, 6


def start_dump(*args):
    return subprocess.Popen([sys.executable, "-m", "ckpt", "dump", *map(str, args), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_parallel_dumps_into_one_store_never_disturb_each_other(procs, tmp_path, isolated_env):
    """300 dumps, six at a time: each removes the leftovers of dead dumps when it starts, and
    before the fix it took a just-created staging directory of another for one (7 of 300 failed)."""
    targets = [procs.start("counter.py", tmp_path / f"count-{k}.txt", "0.2") for k in range(PARALLEL)]
    for k in range(PARALLEL):
        wait_until(lambda: read_lines(tmp_path / f"count-{k}.txt"), what=f"counter {k}")
    failures = []
    deadline = time.monotonic() + 900
    for round_no in range(ROUNDS):
        assert time.monotonic() < deadline, f"only {round_no} rounds in 900 s"
        running = [start_dump(t.pid) for t in targets]
        for dump in running:
            out, err = dump.communicate(timeout=300)
            if dump.returncode != 0:
                failures.append((round_no, dump.returncode, err.strip().splitlines()[-1:]))
    assert failures == [], failures
    listed = ckpt_json("list")
    assert len(listed) == ROUNDS * PARALLEL
    assert not list((isolated_env / "tmp").iterdir()), "a dump left its staging directory"
    # The newest checkpoint of one counter restores and counts on from where it was dumped.
    newest = [c for c in listed if c["pid"] == targets[0].pid][-1]
    procs.kill_tree(targets[0].pid)
    out = tmp_path / "count-0.txt"
    last = int(read_lines(out)[-1])
    pid = int(ckpt("restore", newest["id"]).stdout)
    procs.adopt(pid)
    wait_until(lambda: len(read_lines(out)) > last + 2, what="the restored counter")
    values = [int(v) for v in read_lines(out)]
    resumed = values[values.index(last) + 1:] if last in values else []
    assert resumed and resumed[0] <= last + 1 and all(b == a + 1 for a, b in zip(resumed, resumed[1:], strict=False))


def test_two_dumps_of_one_target_at_once_both_succeed_one_after_the_other(procs, tmp_path, isolated_env):
    """Before: the later CRIU failed with "Unable to detach from PID: No such process" (exit 5)."""
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, "256")
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem")
    for _ in range(3):
        first, second = start_dump(target.pid), start_dump(target.pid)
        results = [(d.wait(timeout=300), d.stderr.read()) for d in (first, second)]
        assert [code for code, _ in results] == [0, 0], results
    assert len(ckpt_json("list")) == 6
    assert alive(target.pid) and state(target.pid) not in ("T", "t")


def test_a_target_someone_else_traces_is_refused_before_anything_is_frozen(procs, tmp_path, isolated_env):
    out = tmp_path / "count.txt"
    target = procs.start("counter.py", out, "0.05")
    wait_until(lambda: read_lines(out), what="counter")
    tracer = procs.start_program([sys.executable, "-c", (
        "import ctypes, sys, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"assert libc.ptrace(0x4206, {target.pid}, 0, 0) == 0, ctypes.get_errno()  # PTRACE_SEIZE\n"
        "print('seized', flush=True)\n"
        "time.sleep(120)\n")], "tracer")
    wait_until(lambda: "seized" in (tmp_path / "tracer.1.stdio").read_text(), what="the tracer")
    proc = ckpt("dump", target.pid, check=False)
    assert proc.returncode == 7 and "Traceback" not in proc.stderr, proc.stderr
    assert f"being traced by PID {tracer.pid}" in proc.stderr
    count = len(read_lines(out))
    wait_until(lambda: len(read_lines(out)) > count + 3, what="the counter to go on")
    procs.kill_tree(tracer.pid)


def test_what_criu_writes_is_owner_only_and_a_restored_tree_keeps_its_umask(procs, tmp_path, isolated_env):
    out = tmp_path / "count.txt"
    target = procs.start_program(["/bin/sh", "-c", f"umask 0027; exec {sys.executable} "
                                  f"{ROOT / 'tests/fixtures/counter.py'} {out} 0.05"], "counter")
    wait_until(lambda: read_lines(out), what="counter")
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    pid = int(ckpt("restore", dumped["id"]).stdout)
    procs.adopt(pid)
    umask = next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("Umask:"))
    assert umask == "0027"
    loose = []
    for root, dirs, files in os.walk(isolated_env):
        for name in dirs + files:
            mode = os.lstat(os.path.join(root, name)).st_mode
            if mode & 0o077:
                loose.append((os.path.relpath(os.path.join(root, name), isolated_env), oct(mode)))
    assert loose == [], loose
