"""Bad input and failures: one clear line, a documented exit code, no traceback, nothing lost."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, alive, ckpt, ckpt_json, read_lines, state, wait_until


def assert_clean_error(proc, code: int, *words: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error_lines) == 1, proc.stderr
    for word in words:
        assert word in error_lines[0], proc.stderr
    assert proc.stdout == ""


def assert_no_checkpoint(store: Path) -> None:
    listed = ckpt("list", "--json", check=False)
    assert (listed.returncode, listed.stdout.strip()) in ((0, "[]"), (3, "")), listed.stderr
    assert not list((store / "checkpoints").glob("*.json"))


def not_stopped(pid: int) -> bool:
    return state(pid) not in ("T", "t", None)


def test_nonexistent_pid():
    assert_clean_error(ckpt("dump", 4000000, check=False), 3, "no process with PID 4000000")


def test_session_led_from_another_pid_namespace_is_refused_before_freezing(tmp_path):
    """Inside a PID namespace whose processes inherited a session from outside it (a CI runner's
    container), /proc reads their session id as 0 and CRIU cannot dump them: ckpt says so and why."""
    script = (f"sleep 600 & echo $! > {tmp_path}/pid; {sys.executable} -m ckpt dump $! 2> {tmp_path}/err; "
              f"echo $? > {tmp_path}/rc; kill $!")
    # The namespace's init is `sh`, so everything in it ends when it exits.
    subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script], cwd=ROOT,
                   stdin=subprocess.DEVNULL, timeout=60, check=True)
    stderr = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "2", stderr
    assert "Traceback" not in stderr
    assert "session led from outside this PID namespace" in stderr and "setsid" in stderr, stderr


def a_kernel_thread() -> int | None:
    """kthreadd is PID 2 on a host; inside a PID namespace no kernel thread is visible at all."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[6]) & 0x00200000:  # PF_KTHREAD
                return int(entry)
    return None


def test_pid_1_and_kernel_thread():
    assert_clean_error(ckpt("dump", 1, check=False), 2, "PID 1")
    kthread = a_kernel_thread()
    if kthread is None:
        pytest.skip("no kernel thread is visible in this PID namespace")
    assert_clean_error(ckpt("dump", kthread, check=False), 2, "kernel thread")


def test_own_pid_and_parent():
    own = subprocess.run(["sh", "-c", f"exec {sys.executable} -m ckpt dump $$"], capture_output=True,
                         text=True, cwd=ROOT)
    assert_clean_error(own, 2, "is ckpt itself")
    parent = subprocess.run(["sh", "-c", f"{sys.executable} -m ckpt dump $$; exit $?"], capture_output=True,
                            text=True, cwd=ROOT)
    assert_clean_error(parent, 2, "ckpt's own parent")


def test_unknown_id_and_escaping_reference(procs, tmp_path):
    assert_clean_error(ckpt("restore", "20200101-000000-000-abcdef", check=False), 3, "no checkpoint")
    target = procs.start("counter.py", tmp_path / "c.txt")
    ckpt("dump", target.pid)
    for bad in ("../x", "../../etc/passwd", "/etc", "a/b"):
        assert_clean_error(ckpt("restore", bad, check=False), 2, "neither a checkpoint ID nor a name")
        assert_clean_error(ckpt("show", bad, check=False), 2)
        assert_clean_error(ckpt("rm", bad, check=False), 2)
    assert_clean_error(ckpt("dump", target.pid, "--name", "../x", check=False), 2, "invalid checkpoint name")
    assert_clean_error(ckpt("restore", "nosuchname", check=False), 3, "no checkpoint with ID or name")


def test_not_root(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    store = tmp_path / "userstore"
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                           "-m", "ckpt", "dump", str(target.pid), "--store", str(store)],
                          capture_output=True, text=True, cwd=ROOT)
    assert_clean_error(proc, 4, "must run as root")
    assert alive(target.pid)


def test_criu_missing_or_too_old(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    proc = ckpt("dump", target.pid, check=False, env={"CKPT_CRIU": str(tmp_path / "nope")})
    assert_clean_error(proc, 5, "not a working CRIU")
    old = tmp_path / "criu-old"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    proc = ckpt("dump", target.pid, check=False, env={"CKPT_CRIU": str(old)})
    assert_clean_error(proc, 5, "too old", "3.17.1")
    assert alive(target.pid)
    report = ckpt("check", check=False, env={"CKPT_CRIU": str(old)})
    assert report.returncode == 8 and "Traceback" not in report.stderr
    assert "FAIL criu: CRIU is too old" in report.stdout and "fix: run 'make setup'" in report.stdout


@pytest.fixture
def small_tmpfs(tmp_path):
    mounts = []

    def mount(size: str, readonly: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounts)}"
        point.mkdir()
        opts = f"size={size},mode=0700" + (",ro" if readonly else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], check=True)
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_store_not_writable(procs, tmp_path, small_tmpfs):
    target = procs.start("counter.py", tmp_path / "c.txt")
    readonly = small_tmpfs("1m", readonly=True)
    proc = ckpt("dump", target.pid, "--store", readonly / "store", check=False)
    assert_clean_error(proc, 4, "cannot write the store")
    assert not_stopped(target.pid)


def test_disk_full_during_dump(procs, tmp_path, small_tmpfs):
    out = tmp_path / "sums.txt"
    target = procs.start("bigmem.py", out, 64)
    wait_until(lambda: read_lines(out), timeout=60, what="bigmem")
    store = small_tmpfs("8m") / "store"
    proc = ckpt("dump", target.pid, "--store", store, check=False)
    assert_clean_error(proc, 1, "no space left")
    assert not_stopped(target.pid) and alive(target.pid)
    assert ckpt_json("list", "--store", store) == []
    assert not list((store / "tmp").iterdir()), "a failed dump left its staging directory"


def test_bad_compression_is_refused_before_the_target_is_frozen(procs, tmp_path, isolated_env):
    """Before: CRIU froze and dumped the target, then the ingest refused the codec (exit 1)."""
    counts = tmp_path / "c.txt"
    target = procs.start("counter.py", counts)
    wait_until(lambda: read_lines(counts), what="counter")
    marker = tmp_path / "pre-dump-ran"
    proc = ckpt("dump", target.pid, "--compression", "bogus", "--pre-dump", f"touch {marker}", check=False)
    assert_clean_error(proc, 2, "--compression", "'bogus'")
    # Nothing ran and nothing was written: no hook, no store (CRIU, which freezes the target,
    # is given an images directory inside the store's staging area, so it never started).
    assert not marker.exists()
    assert not isolated_env.exists()
    assert not_stopped(target.pid) and alive(target.pid)
    before = len(read_lines(counts))
    wait_until(lambda: len(read_lines(counts)) > before, what="the counter to go on counting")


def test_pid_in_use_on_restore(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    checkpoint = ckpt("dump", target.pid).stdout.strip()
    proc = ckpt("restore", checkpoint, check=False)
    assert_clean_error(proc, 7, f"PID {target.pid}", "counter.py", "in use")


def test_damaged_image_is_named_by_verify_and_refused_by_restore(procs, tmp_path, isolated_env):
    target = procs.start("counter.py", tmp_path / "c.txt")
    dumped = ckpt_json("dump", target.pid)
    packs = list((isolated_env / "packs").glob("*/*"))
    assert len(packs) == 1
    with open(packs[0], "r+b") as f:  # flip one byte of the page data
        f.seek(packs[0].stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = ckpt("verify", dumped["id"], check=False)
    assert proc.returncode == 6 and "pages-1.img" in proc.stderr and "DAMAGED" in proc.stderr
    procs.kill_tree(target.pid)
    proc = ckpt("restore", dumped["id"], check=False)
    assert_clean_error(proc, 6, "pages-1.img", "damaged")
    assert state(target.pid) is None, "a damaged checkpoint must not be restored"


def test_a_command_line_with_brackets_newlines_and_escapes_prints_as_it_is(procs, tmp_path):
    """Other programs' arguments reach ckpt's output: a '[/]' must not be read as markup (it
    made 'ckpt show' fail), a newline must not break a table row, an escape must not reach
    the terminal."""
    target = procs.start_program([sys.executable, "-c", "import time\ntime.sleep(600)", "[/]", "\x1b[31mred"],
                                 "odd-argv")
    time.sleep(0.5)
    dumped = ckpt("dump", target.pid, "--name", "odd")
    assert "checkpoint " in dumped.stderr and "\x1b[31m" not in dumped.stderr
    shown = ckpt("show", "odd").stdout
    assert "import time\\ntime.sleep(600) [/] \\x1b[31mred" in shown and "\x1b" not in shown
    listed = ckpt("list").stdout.splitlines()
    assert len(listed) == 2 and "import time\\n" in listed[1]
