"""The programs of examples/ run as their comments, the README and docs/api.md say, with real CRIU, and do
what they promise across kill -9:

- counter.py under `ckpt run` (the README's command line) goes on from its checkpoint's count;
- callbacks_agent.py, run by the Python of a virtualenv of its own (made as docs/api.md says:
  ckpt installed with `pip install -e` from the checkout, pycriu from CRIU's source tree),
  checkpoints itself, closing and reopening its connection around it; the copy restored from
  that checkpoint returns from the same call, says so and posts on over a new connection;
- journal_agent.py, run by ckpt's own Python, killed right after an intent and after the
  server counted a call but before the agent heard back, restored each time: the server saw
  each step's call exactly once; a second run skips every call (its journal says so, and
  `ckpt journal show` shows why);
- socket_agent.sh under `ckpt run` asks for its checkpoint over CKPT_SOCKET after its report,
  and the copy ckpt run restores after kill -9 learns it was restored: one report, not two.

tests/unit/test_readme_examples.py checks that the code of the README and docs/api.md is these
files' lines."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT, alive, ckpt, ckpt_json, read_lines, wait_until

EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def agent_dir(tmp_path, monkeypatch):
    """ckpt.checkpoint()'s result files in the test's directory, not /run/ckpt/agent."""
    monkeypatch.setenv("CKPT_AGENT_DIR", str(tmp_path / "agent"))


def start(procs, argv: list, out: Path) -> subprocess.Popen:
    """A program as a user starts it in the background: its own session, no input, its output
    appended to `out` (appended: a restored copy writes on at the end, where it would be)."""
    with open(out, "ab") as log:
        proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    procs.popens.append(proc)
    procs.pids.add(proc.pid)
    return proc


def lines_of(out: Path) -> list[str]:
    return read_lines(out)


# ---- ckpt run ---------------------------------------------------------------------------------

class Run:
    """`ckpt run --json ARGS` as a shell runs it (from the checkout), its events read back."""

    def __init__(self, procs, tmp_path: Path, *args):
        self.events_file = tmp_path / "run-events.jsonl"
        self.supervisor = start(procs, [sys.executable, "-m", "ckpt", "run", "--json", *args], self.events_file)
        self.procs = procs
        started = self.wait_for("started")
        self.pid = started["pid"]
        procs.pids.add(self.pid)

    def events(self, kind: str | None = None) -> list[dict]:
        found = []
        for line in read_lines(self.events_file):
            if line.startswith("{"):
                event = json.loads(line)
                if kind is None or event["event"] == kind:
                    found.append(event)
        return found

    def wait_for(self, kind: str, count: int = 1, timeout: float = 60) -> dict:
        return wait_until(lambda: len(self.events(kind)) >= count and self.events(kind)[count - 1],
                          timeout=timeout, what=f"ckpt run's event {kind} #{count} (see {self.events_file})")

    def stop(self) -> None:
        self.supervisor.send_signal(signal.SIGTERM)
        self.supervisor.wait(timeout=30)


def test_the_counter_under_ckpt_run_goes_on_from_its_checkpoint_after_kill_9(procs, tmp_path):
    count = tmp_path / "count.txt"
    run = Run(procs, tmp_path, "--every", "2s", "--name", "counter-run", "--output", tmp_path / "counter.out",
              "--", "python3", "examples/counter.py", count)
    checkpoint = run.wait_for("checkpoint")
    at_checkpoint = len(lines_of(count))
    wait_until(lambda: len(lines_of(count)) >= at_checkpoint + 1, what="a count after the checkpoint")
    os.kill(run.pid, signal.SIGKILL)
    run.wait_for("died")
    before = [int(v) for v in lines_of(count)]
    restored = run.wait_for("restored")
    procs.adopt(restored["pid"])
    newest = run.events("checkpoint")[-1]["id"]
    assert restored["id"] == newest and restored["pid"] == run.pid, (restored, checkpoint)
    wait_until(lambda: len(lines_of(count)) >= len(before) + 3, what="the restored counter to count on")
    after = [int(v) for v in lines_of(count)[len(before):]]
    assert before == list(range(1, len(before) + 1))
    # From its checkpoint's count, not from 1: at most the last count before the kill, plus one.
    assert 2 <= after[0] <= before[-1] + 1, (before, after)
    assert after == list(range(after[0], after[0] + len(after)))
    run.stop()


def test_the_shell_script_asks_for_its_checkpoint_over_ckpt_socket_and_learns_it_was_restored(procs, tmp_path):
    if shutil.which("socat") is None:
        pytest.skip("socat is missing: make setup installs it")
    reports, out = tmp_path / "reports.txt", tmp_path / "reporter.out"
    # The script's own comment: --first-after 10m, so that the checkpoint restored is the one
    # the script asked for.
    run = Run(procs, tmp_path, "--every", "10m", "--first-after", "10m", "--name", "reporter", "--output", out,
              "--", "examples/socket_agent.sh", reports)
    taken = wait_until(lambda: [line for line in lines_of(out) if line.startswith("checkpoint ")], timeout=60,
                       what=f"the script's checkpoint (see {out})")
    checkpoint_id = taken[0].split()[1]
    assert taken == [f"checkpoint {checkpoint_id} taken; going on"]
    assert [e["id"] for e in run.events("checkpoint")] == [checkpoint_id]
    wait_until(lambda: "working 2" in lines_of(out), what="the script's work after its checkpoint")
    os.kill(run.pid, signal.SIGKILL)
    restored = run.wait_for("restored")
    procs.adopt(restored["pid"])
    assert restored["id"] == checkpoint_id
    said = f"restored from {checkpoint_id} after a crash: the report was sent already"
    wait_until(lambda: said in lines_of(out) and lines_of(out)[-1].startswith("working"), timeout=30,
               what=f"the restored script to say it was restored (see {out})")
    assert len(lines_of(reports)) == 1, "the report was sent twice"
    run.stop()


# ---- the journal agent, with ckpt's own Python ------------------------------------------------

def counting_server(procs, tmp_path: Path, *args) -> str:
    port_file = tmp_path / "port"
    start(procs, ["python3", EXAMPLES / "counting_server.py", "--port-file", port_file, *args],
          tmp_path / "server.out")
    wait_until(port_file.exists, what="the counting server's port")
    return f"http://127.0.0.1:{port_file.read_text()}"


def server_counts(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/counts", timeout=10) as answer:
        return json.load(answer)


def kill(agent: subprocess.Popen) -> None:
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)


def restore(procs, agent: subprocess.Popen, ref: str) -> None:
    restored = ckpt_json("restore", ref)
    procs.adopt(restored["pid"])
    assert restored["pid"] == agent.pid


def test_the_journal_agent_calls_each_step_once_across_kill_9_and_restores(procs, tmp_path):
    server_events = tmp_path / "server-events.txt"
    base = counting_server(procs, tmp_path, "--delay", "0.8", "--events", server_events)
    out = tmp_path / "poster.log"
    steps = 4
    agent = start(procs, [sys.executable, EXAMPLES / "journal_agent.py", base, "--steps", steps, "--pause", "0.8"],
                  out)

    # Killed right after an intent, before its call: the copy finds the intent, asks the
    # server, which never got the call, and makes it.
    wait_until(lambda: "step 1: intent recorded, calling" in lines_of(out), timeout=60,
               what=f"step 1's intent (see {out})")
    kill(agent)
    restore(procs, agent, "poster")
    # Killed after the server counted a call and before the agent heard back (the server
    # answers 0.8 s late): the copy finds the intent, and the server says it had the call.
    mark = len(read_lines(server_events))
    called = wait_until(lambda: [line for line in read_lines(server_events)[mark:] if line != "POST 1"],
                        timeout=60, what="a call after step 1")
    kill(agent)
    restore(procs, agent, "poster")
    second = int(called[0].split()[1])

    wait_until(lambda: "finished" in lines_of(out) or not alive(agent.pid), timeout=90, what="the agent to finish")
    assert "finished" in lines_of(out), f"the agent died: see {out}"
    counts = server_counts(base)
    report = "\n".join(lines_of(out))
    assert sorted(int(s) for s in counts) == list(range(steps)), "a step was lost\n" + report
    assert {s: v["count"] for s, v in counts.items() if v["count"] != 1} == {}, "a call was made twice\n" + report
    assert "step 1: reconciled: the server never got it, posted" in report
    assert f'step {second}: reconciled: the server had it {{"reconciled": true}}' in report
    assert len([line for line in lines_of(out) if line.startswith("step ") and " restored from " in line]) == 2

    # The records stay: a second run skips each call its journal says was made, and says so.
    shown = ckpt_json("journal", "show", "poster")
    assert [(r["key"], r["state"]) for r in shown] == [(f"post-step-{s}", "done") for s in range(steps)]
    again = start(procs, [sys.executable, EXAMPLES / "journal_agent.py", base, "--steps", 2], tmp_path / "again.log")
    assert again.wait(timeout=60) == 0
    assert [line for line in lines_of(tmp_path / "again.log") if "skipped" in line] == [
        'step 0: skipped: done before {"step": 0, "count": 1}', 'step 1: skipped: done before {"step": 1, "count": 1}']
    assert all(v["count"] == 1 for v in server_counts(base).values())
    refused = ckpt("journal", "rm", "poster", check=False)
    assert refused.returncode == 2 and "--force" in refused.stderr


# ---- the callbacks agent, with a virtualenv of its own -------------------------------------------

def make_program_venv(where: Path) -> Path:
    """A program's own virtualenv as docs/api.md makes it: `pip install -e` of the checkout, then
    pycriu from the CRIU source tree `make setup` prepared (.venv/.criu-lib). Two differences
    that change nothing installed: the checkout is a copy of this one's files (an editable
    install builds ckpt's C extension and egg-info in place, and this tree's are in use), and
    ckpt's own, newer pip installs into it (`pip --python`: a third of the time of the pip
    that `python3 -m venv` brings)."""
    checkout = where / "ckpt-checkout"
    shutil.copytree(ROOT / "ckpt", checkout / "ckpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, checkout / name)
    criu_lib = (ROOT / ".venv" / ".criu-lib").read_text().strip()
    venv = where / "venv"
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
    for argv in (["python3", "-m", "venv", "--without-pip", str(venv)],
                 [*pip, "-e", str(checkout)],
                 [*pip, "setuptools<85", "wheel"],
                 [*pip, "--no-build-isolation", criu_lib]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return venv / "bin" / "python"


@pytest.fixture(scope="module", autouse=True)
def program_venv(tmp_path_factory):
    """Made in the background while the tests above run (pip takes 20-30 s); the test that
    needs it, last in this file, waits for it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(make_program_venv, tmp_path_factory.mktemp("program"))


def test_the_callbacks_agent_from_its_own_venv_checkpoints_itself_and_its_copy_reconnects(procs, tmp_path,
                                                                                          program_venv: Future):
    python = program_venv.result(timeout=600)
    found = subprocess.run([python, "-c", "import ckpt, pycriu; print(ckpt.__file__)"], capture_output=True,
                           text=True, timeout=60, cwd="/")
    assert found.returncode == 0 and "ckpt-checkout" in found.stdout, found.stderr
    base = counting_server(procs, tmp_path)
    out = tmp_path / "agent.log"
    agent = start(procs, [python, EXAMPLES / "callbacks_agent.py", base, "--interval", "0.2"], out)
    taken = wait_until(lambda: [line for line in lines_of(out) if line.startswith("checkpointed as ")], timeout=90,
                       what=f"the agent's checkpoint (see {out})")
    checkpoint_id = taken[0].split()[-1]
    lines = lines_of(out)
    at = lines.index(taken[0])
    assert lines[at - 3:at] == ["count 5: posted (the server has had it 1 time(s))",
                                "before the checkpoint: connection closed", "after the checkpoint: connected again"]
    wait_until(lambda: "count 8: posted (the server has had it 1 time(s))" in lines_of(out), what="counts after it")
    kill(agent)
    mark = len(lines_of(out))
    restore(procs, agent, checkpoint_id)
    wait_until(lambda: len(lines_of(out)) >= mark + 4, what=f"the restored copy to go on (see {out})")
    # The copy returns from the same call, after its after_restore callback opened a new
    # connection (the before callback ran once, before the freeze), and counts on from 6: the
    # server has had 6 twice (no journal here: examples/journal_agent.py is about that).
    assert lines_of(out)[mark:mark + 4] == [
        "after the checkpoint: connected again", f"restored from {checkpoint_id}",
        "count 6: posted (the server has had it 2 time(s))", "count 7: posted (the server has had it 2 time(s))"]
