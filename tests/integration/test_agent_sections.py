"""no_checkpoint(): dumps from outside wait for the tree's critical sections, or give up."""

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.helpers import alive, ckpt, ckpt_json, read_lines, state, wait_until


def moments(log) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[2]) for line in read_lines(log)}


def id_time(checkpoint_id: str) -> float:
    """When the dump chose its ID: after its wait for sections, before the freeze."""
    return datetime.strptime(checkpoint_id[:19] + "000", "%Y%m%d-%H%M%S-%f").replace(
        tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("mode", ["thread", "child"])
def test_dump_waits_for_the_section_to_end(procs, tmp_path, mode):
    """A dump started inside a section (nested: the inner one ends first) is frozen only after
    the outer section ends, whether a thread of the root or a child process holds it."""
    log = tmp_path / "sections.log"
    target = procs.start("section_agent.py", log, mode, 3)
    wait_until(lambda: "entered" in moments(log), what="the section")
    asked = time.time()
    proc = ckpt("dump", target.pid, "--json")
    checkpoint = json.loads(proc.stdout)
    seen = moments(log)
    assert seen["entered"] < asked < seen["inner-left"] < seen["leaving"]
    # The ID is chosen after the wait (to the millisecond): the outer section had ended.
    assert id_time(checkpoint["id"]) + 0.001 >= seen["leaving"], (checkpoint["id"], seen)
    holder = int(read_lines(log)[0].split()[1])
    assert f"waiting for PID {holder} to leave its no_checkpoint() section" in proc.stderr
    assert checkpoint["processes"] == (2 if mode == "child" else 1)
    assert alive(target.pid)


def no_checkpoints() -> bool:
    proc = ckpt("list", "--json", check=False)
    return proc.returncode == 3 or json.loads(proc.stdout) == []  # 3: not even a store


def test_section_longer_than_the_timeout_fails_the_dump_and_freezes_nothing(procs, tmp_path):
    log = tmp_path / "sections.log"
    target = procs.start("section_agent.py", log, "thread", 20)
    wait_until(lambda: "entered" in moments(log), what="the section")
    started = time.monotonic()
    proc = ckpt("dump", target.pid, "--section-timeout", "1", check=False)
    assert proc.returncode == 7, proc.stderr
    assert 1 <= time.monotonic() - started < 10
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and f"PID {target.pid} stayed in a no_checkpoint() section for 1 s" in error[0]
    assert "--section-timeout" in error[0] and "Traceback" not in proc.stderr
    assert no_checkpoints()
    assert alive(target.pid) and state(target.pid) != "t" and state(target.pid) != "T"
    assert "left" not in moments(log)
    # The dump's flag is gone: sections are not held off after a dump that gave up.
    assert not Path(f"/run/ckpt/sections/dumping.{target.pid}").exists()


def test_schedule_run_records_a_skip(procs, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CRON_DIR", str(tmp_path / "cron.d"))
    log = tmp_path / "sections.log"
    target = procs.start("section_agent.py", log, "child", 30)
    ckpt("schedule", "add", "busy", "--pid", target.pid, "--every", "5m")
    wait_until(lambda: "entered" in moments(log), what="the section")
    proc = ckpt("schedule", "run", "busy", check=False, env={"CKPT_SECTION_TIMEOUT": "1"})
    assert proc.returncode == 7 and "no_checkpoint() section" in proc.stderr, proc.stderr
    last = ckpt_json("schedule", "list")[0]["last"]
    assert last["outcome"] == "skipped" and "stayed in a no_checkpoint() section for 1 s" in last["error"]
    assert no_checkpoints() and alive(target.pid)
