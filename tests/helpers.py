"""Starting real target processes, running the real ckpt CLI, and ending only what we started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent
# Read at import: every test's environment is cleared of CKPT_* settings (conftest.isolated_env).
WAIT_LOG = os.environ.get("CKPT_TEST_WAIT_LOG")


def state(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()[0]


def alive(pid: int) -> bool:
    return state(pid) not in (None, "Z", "X")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            _log_wait(what, time.monotonic() - started, timeout)
            return value
        time.sleep(interval)
    _log_wait(what, time.monotonic() - started, timeout)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _log_wait(what: str, waited: float, timeout: float) -> None:
    """With CKPT_TEST_WAIT_LOG set, records how much of its bound each wait used: a wait that
    takes a large share of it on a quiet machine is the next flaky test on a loaded one."""
    log = WAIT_LOG
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(log, "a") as out:
            out.write(json.dumps({"test": test, "what": what, "waited": round(waited, 3), "timeout": timeout}) + "\n")


def read_lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def tree_pids(pid: int) -> list[int]:
    """The PID and its descendants, from /proc (children lists of every thread)."""
    result, todo = [], [pid]
    while todo:
        p = todo.pop()
        if state(p) is None:
            continue
        result.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue  # it exited meanwhile (a pipeline's short-lived children do)
        for task in tasks:
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return result


class Processes:
    """Every process a test starts or restores, ended by PID at teardown."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.popens: list[subprocess.Popen] = []
        self.pids: set[int] = set()

    def start(self, fixture: str, *args: str) -> subprocess.Popen:
        return self.start_program([sys.executable, str(FIXTURES / fixture), *map(str, args)], fixture)

    def start_program(self, argv: list, label: str) -> subprocess.Popen:
        """Any program, in a session of its own, its output in the test's directory."""
        log = open(self.workdir / f"{label}.{len(self.popens)}.stdio", "wb")
        proc = subprocess.Popen([str(a) for a in argv],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.popens.append(proc)
        self.pids.add(proc.pid)
        return proc

    def adopt(self, pid: int) -> None:
        """A restored process: not our child, but ours to end."""
        self.pids.update(tree_pids(pid) or [pid])

    def kill_tree(self, pid: int) -> None:
        pids = tree_pids(pid)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.popens:
            if proc.pid in pids:
                proc.wait()

    def cleanup(self) -> None:
        for pid in list(self.pids):
            for p in tree_pids(pid):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.popens:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            proc.wait()


def echo_server(procs: Processes, tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """tests/fixtures/echo_server.py on a port of the kernel's choice: (server, port, its log)."""
    log = tmp_path / "server.txt"
    server = procs.start("echo_server.py", log)
    port = int(wait_until(lambda: read_lines(log), what="the echo server's port")[0].split()[1])
    return server, port, log


def ckpt(*args: str, check: bool = True, timeout: float = 300, env: dict | None = None
         ) -> subprocess.CompletedProcess:
    """Runs the real CLI (`python -m ckpt`) as a user would."""
    proc = subprocess.run([sys.executable, "-m", "ckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckpt {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}"
                             + _criu_log_tail(proc.stderr))
    return proc


def ckpt_json(*args: str, **kwargs):
    return json.loads(ckpt(*args, "--json", **kwargs).stdout)


def _criu_log_tail(stderr: str) -> str:
    """On failure, show the end of CRIU's log that the error message points to."""
    for word in stderr.replace("(", " ").replace(")", " ").split():
        if word.endswith(".log") and os.path.exists(word):
            lines = Path(word).read_text(errors="replace").splitlines()[-40:]
            return "\n--- end of " + word + " ---\n" + "\n".join(lines)
    return ""


def dumped_file_reader(procs, tmp_path: Path, lines: int, records: int) -> tuple[Path, Path, dict]:
    """file_reader.py over a file of `lines` records, dumped with --stop once it has read
    `records` of them: (the file, the reader's output, the dump's JSON)."""
    data = tmp_path / "data.txt"
    data.write_text("".join(f"line{i:05d}\n" for i in range(lines)))
    out = tmp_path / "read.txt"
    target = procs.start("file_reader.py", data, out)
    wait_until(lambda: len(read_lines(out)) >= records, what="reader")
    dumped = ckpt_json("dump", target.pid, "--stop")
    target.wait(timeout=10)
    return data, out, dumped


def manifest_only_checkpoint(store, name: str | None, when, command: str = "agent") -> str:
    """A checkpoint with a manifest and no images: enough for list, names and references (no CRIU)."""
    from ckpt.store import Manifest, ids

    checkpoint_id = ids.new_id(when)
    store.commit(Manifest(id=checkpoint_id, created=when.isoformat(), pid=1234, command=command, processes=[],
                          files=[], name=name))
    return checkpoint_id


def env_settings():
    """ckpt's settings as the CLI would build them from this test's environment (isolated_env's
    CKPT_STORE and CKPT_CACHE, and whatever the test set): what the test passes down to the core."""
    from ckpt.settings import Settings

    return Settings.from_environment()
