"""Restoring where the checkpoint's files differ, and on another host (a UTS namespace with
another host name): checked before CRIU runs, and TCP connections closed there by default. A
log the tree only writes to may have grown: it restores."""

import ctypes
import ctypes.util
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.criu.elf import build_id
from tests.helpers import FIXTURES, ROOT, alive, ckpt, ckpt_json, read_lines, state, wait_until

OTHER_HOST = "ckpt-other-host"


def loaded_library(name: str) -> Path:
    """The file of a shared library as the dynamic linker finds it (loaded here to ask /proc)."""
    soname = ctypes.util.find_library(name)
    if not soname:
        pytest.skip(f"no lib{name} here")
    ctypes.CDLL(soname)
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/" in path and Path(path).name.startswith(soname.split(".so")[0] + ".so"):
            return Path(path)
    pytest.skip(f"lib{name} not found in /proc/self/maps")


def counted(path: Path) -> int:
    return len(read_lines(path))


def test_restore_names_every_file_that_differs_here_and_runs_no_criu(procs, tmp_path, isolated_env):
    """A file grown, a file deleted and a library of another build: one error naming the three,
    exit code 10, before CRIU runs and before the restore waits for the tree's PIDs (the
    original still runs, untouched). Put back as they were, the checkpoint restores."""
    data, gone = tmp_path / "data.txt", tmp_path / "gone.txt"
    data.write_text("0123456789" * 100)
    gone.write_text("soon gone\n")
    library = tmp_path / "libcopy.so"
    shutil.copy(loaded_library("z"), library)
    original_id = build_id(str(library))
    assert original_id, "the library copy has no build id to change"
    out = tmp_path / "count.txt"
    target = procs.start("file_holder.py", out, library, data, gone)
    wait_until(lambda: counted(out) >= 5, what="the holder to count")
    dumped = ckpt_json("dump", target.pid)
    from ckpt.system.procfs import cpu_instruction_flags
    assert ckpt_json("show", dumped["id"])["system"]["cpu_flags"] == cpu_instruction_flags() != []

    with data.open("a") as f:
        f.write("more")  # 1000 -> 1004 bytes
    gone.rename(tmp_path / "gone.txt.saved")
    library.rename(tmp_path / "libcopy.so.saved")
    rebuilt = bytearray((tmp_path / "libcopy.so.saved").read_bytes())
    at = rebuilt.find(original_id)
    rebuilt[at] ^= 0xFF  # same size, another build id
    library.write_bytes(bytes(rebuilt))
    library.chmod((tmp_path / "libcopy.so.saved").stat().st_mode & 0o7777)

    before = counted(out)
    refused = ckpt("restore", dumped["id"], check=False)
    assert refused.returncode == 10, refused.stderr
    error = refused.stderr
    assert f"cannot restore {dumped['id']} on this host" in error
    assert f"on this host {data} has size 1004, the checkpoint's had 1000" in error
    assert f"{gone} is missing" in error
    assert f"{library} has another ELF build id here" in error and original_id.hex() in error
    assert "put these files back as they were" in error and "Traceback" not in error
    logs = isolated_env / "logs" / dumped["id"]
    assert not list(logs.glob("restore-*.log")), "CRIU ran"
    # Nothing was frozen or ended: the original runs on.
    assert alive(target.pid) and state(target.pid) != "T"
    wait_until(lambda: counted(out) >= before + 5, what="the original to go on counting")

    # The JSON form of the check lists the same mismatches, one finding each.
    checked = subprocess.run([sys.executable, "-m", "ckpt", "check", dumped["id"], "--json"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
    assert checked.returncode == 8, checked.stderr
    failed = [c["detail"] for c in json.loads(checked.stdout)["checks"] if not c["ok"]]
    assert len([d for d in failed if str(tmp_path) in d]) == 3, failed

    # Put back as they were: the check passes and the checkpoint restores.
    with data.open("r+") as f:
        f.truncate(1000)
    (tmp_path / "gone.txt.saved").rename(gone)
    (tmp_path / "libcopy.so.saved").rename(library)
    procs.kill_tree(target.pid)
    restored = ckpt_json("restore", dumped["id"])
    procs.adopt(restored["pid"])
    assert restored["another_host"] is False and restored["tcp_connections"] is None
    counts = counted(out)
    wait_until(lambda: counted(out) >= counts + 5, what="the restored holder to count")


def run_on_other_host(*args: str) -> subprocess.CompletedProcess:
    """`ckpt ARGS` in a UTS namespace of its own whose host name is OTHER_HOST."""
    script = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
              "os.execv(sys.executable, [sys.executable, '-m', 'ckpt', *sys.argv[2:]])")
    return subprocess.run(["unshare", "--uts", sys.executable, "-c", script, OTHER_HOST, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def echo(port: int, word: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(word.encode() + b"\n")
        return s.makefile().readline().strip()


@pytest.mark.parametrize("where, flags, expected", [
    ("same-host", [], "established"),
    ("other-host", [], "closed"),
    ("other-host", ["--tcp-established"], "established"),
    ("same-host", ["--tcp-close"], "closed"),
])
def test_a_server_restored_elsewhere_has_its_connections_closed_and_listens_again(procs, tmp_path, where, flags,
                                                                                   expected):
    """On another host (another host name) the server's established connection is restored
    closed by default: the server sees it end instead of waiting on it forever, and its
    listening socket accepts new clients. On its own host the connection goes on talking. The
    flags override the default both ways."""
    log = tmp_path / "server.txt"
    server = procs.start("echo_server.py", log)
    port = int(wait_until(lambda: read_lines(log), what="server port")[0].split()[1])
    out = tmp_path / "client.txt"
    procs.start("tcp_client.py", port, out)
    wait_until(lambda: len(read_lines(out)) >= 5, what="client traffic")
    client_port = read_lines(out)[-1].split()[1]
    dumped = ckpt_json("dump", server.pid, "--stop")
    server.wait(timeout=10)
    assert ckpt_json("show", dumped["id"])["criu"]["options"]["tcp_established"] is True

    if where == "other-host":
        run = run_on_other_host("restore", dumped["id"], *flags, "--json")
    else:
        run = ckpt("restore", dumped["id"], *flags, "--json", check=False)
    assert run.returncode == 0, run.stderr
    restored = json.loads(run.stdout)
    procs.adopt(restored["pid"])
    assert restored["another_host"] is (where == "other-host")
    assert restored["tcp_connections"] == expected
    if where == "other-host" and not flags:
        assert f"this is {OTHER_HOST}: its established TCP connections are restored closed" in run.stderr
    if expected == "closed":
        wait_until(lambda: f"closed {client_port}" in read_lines(log), timeout=10,
                   what="the restored server to see its connection closed")
    else:
        n = len(read_lines(out))
        wait_until(lambda: len(read_lines(out)) >= n + 10, timeout=30, what="the client's traffic after the restore")
        assert {line.split()[1] for line in read_lines(out) if line != "EOF"} == {client_port}
        assert f"closed {client_port}" not in read_lines(log)
    assert echo(port, "after") == "after", "the restored listening socket does not accept"
    assert alive(restored["pid"])


def start_logging(procs, tmp_path: Path, redirect: str, *read: Path) -> tuple[subprocess.Popen, Path, Path]:
    """log_writer.py started as a service by hand, `app.py REDIRECT app.log 2>&1` (the shell
    execs it: the tree is the one process), once it has logged 5 lines: (it, the log, the mark
    that makes its lines "new")."""
    log, mark = tmp_path / "app.log", tmp_path / "restored"
    target = procs.start_program(["sh", "-c", f'exec "$0" "$@" {redirect} "{log}" 2>&1', sys.executable,
                                  FIXTURES / "log_writer.py", mark, *read], "app")
    wait_until(lambda: len(read_lines(log)) >= 5, what="the service to log")
    return target, log, mark


def dump_then_log_on(procs, target: subprocess.Popen, log: Path) -> tuple[dict, str, bytes]:
    """Dumps the service (left running), lets it log 10 lines more, kills it (kill -9): (the
    dump's JSON, its messages, the log as the killed process left it)."""
    run = ckpt("dump", target.pid, "--json")
    at_dump = len(read_lines(log))
    wait_until(lambda: len(read_lines(log)) >= at_dump + 10, what="the service to log after the dump")
    procs.kill_tree(target.pid)
    return json.loads(run.stdout), run.stderr, log.read_bytes()


@pytest.mark.parametrize("redirect", [">", ">>"])
def test_a_log_grown_after_the_dump_restores_and_is_written_on(procs, tmp_path, redirect):
    """The usual crash: a service logging with `> app.log 2>&1` (O_WRONLY, O_TRUNC) or `>>`
    (O_APPEND), dumped, logging on, killed. The restore takes the grown log; the restored
    process counts on from the checkpoint and writes where it would have: with `>` at its own
    offset, over what the lost process wrote after the dump (a warning says so, and `ckpt check`
    says the same), with `>>` after the end."""
    target, log, mark = start_logging(procs, tmp_path, redirect)
    dumped, dump_messages, lost = dump_then_log_on(procs, target, log)
    assert "a restore" not in dump_messages, dump_messages  # nothing to warn of at the dump
    mark.touch()

    checked = subprocess.run([sys.executable, "-m", "ckpt", "check", dumped["id"], "--json"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    notes = [c["detail"] for c in json.loads(checked.stdout)["checks"] if str(log) in c["detail"]]
    run = ckpt("restore", dumped["id"], "--json", check=False)
    assert run.returncode == 0, run.stderr
    procs.adopt(json.loads(run.stdout)["pid"])
    assert "Traceback" not in run.stderr
    wait_until(lambda: log.read_bytes().count(b" new\n") >= 5, what="the restored service to log")

    content = log.read_bytes()
    start = content.rfind(b"\n", 0, content.index(b" new\n")) + 1  # the restored process's first line
    lines = content[start:].decode().splitlines()
    first = int(lines[0].split()[0])
    written = [line for line in lines if line.endswith(" new")]
    assert written == [f"{n} new" for n in range(first, first + len(written))], lines  # one after the other
    assert content[:start] == lost[:start]  # nothing before it touched
    assert first <= len(lost.splitlines()), "the restored process did not count on from the checkpoint"
    if redirect == ">":
        # At its offset at the dump, which its count then was: over the lines logged since.
        assert start == len(b"".join(lost.splitlines(keepends=True)[:first - 1]))
        assert start < len(lost)
        warned = [line for line in run.stderr.splitlines() if line.startswith("Warning:") and str(log) in line]
        assert len(warned) == 1 and "overwrit" in warned[0], run.stderr
        assert len(notes) == 1 and "overwrit" in notes[0], notes
    else:
        assert start == len(lost)  # appended
        assert str(log) not in run.stderr and not notes, run.stderr + str(notes)


@pytest.mark.parametrize("redirect, reads_it", [("1<>", False), (">", True)], ids=["read-write", "read-back"])
def test_a_grown_log_the_tree_also_reads_is_refused_and_the_dump_says_so(procs, tmp_path, redirect, reads_it):
    """A log opened for reading and writing (`1<> app.log`, O_RDWR), or written and also held
    open read-only: what the tree reads changed, so the restore refuses it (exit code 10), and
    the dump warned of that up front."""
    log = tmp_path / "app.log"
    log.touch()
    target, log, mark = start_logging(procs, tmp_path, redirect, *([log] if reads_it else []))
    dumped, dump_messages, lost = dump_then_log_on(procs, target, log)
    warned = [line for line in dump_messages.splitlines() if line.startswith("Warning:") and str(log) in line]
    assert len(warned) == 1 and "a restore" in warned[0], dump_messages

    refused = ckpt("restore", dumped["id"], check=False)
    assert refused.returncode == 10, refused.stderr
    assert f"on this host {log} has size {len(lost)}, the checkpoint's had" in refused.stderr
    assert "Traceback" not in refused.stderr
