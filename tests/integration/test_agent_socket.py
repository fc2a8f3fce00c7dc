"""ckpt run's CKPT_SOCKET from a shell script (socat): a critical section, a checkpoint it asks
for and learns the id of, and, after kill -9 and the supervisor's restore, the restored copy
learns it was restored from that checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.helpers import env_settings, FIXTURES, ROOT, alive, ckpt, read_lines, wait_until

pytestmark = pytest.mark.skipif(shutil.which("socat") is None, reason="socat is missing: make setup installs it")


def start_run(tmp_path, procs, *args):
    events = open(tmp_path / "events.jsonl", "wb")
    log = open(tmp_path / "run.stderr", "wb")
    supervisor = subprocess.Popen([sys.executable, "-m", "ckpt", "run", "--json", "--output",
                                   str(tmp_path / "run.out"), *map(str, args)], cwd=ROOT,
                                  stdin=subprocess.DEVNULL, stdout=events, stderr=log, start_new_session=True)
    events.close()
    log.close()
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    return supervisor


def events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in read_lines(tmp_path / "events.jsonl")]


def words(log) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in read_lines(log)}


def test_shell_script_sections_and_checkpoints_over_the_socket(procs, tmp_path):
    log = tmp_path / "agent.log"
    supervisor = start_run(tmp_path, procs, "--every", "1h", "--first-after", "1h", "--name", "shell", "--",
                           FIXTURES / "socket_agent.sh", log, 3)
    started = wait_until(lambda: [e for e in events(tmp_path) if e["event"] == "started"], what="start")[0]
    pid = started["pid"]
    procs.pids.add(pid)

    # An outside dump during the script's BEGIN/END section waits for its END.
    wait_until(lambda: "entered" in words(log), what="the section")
    outside = ckpt("dump", pid, "--json", "--store", tmp_path / "other-store")
    outside_id = json.loads(outside.stdout)["id"]
    leaving = float(words(log)["leaving"][0])
    chosen = datetime.strptime(outside_id[:19] + "000", "%Y%m%d-%H%M%S-%f").replace(tzinfo=timezone.utc)
    assert chosen.timestamp() + 0.001 >= leaving, (outside_id, leaving)
    assert f"waiting for PID {pid} to leave its no_checkpoint() section" in outside.stderr

    # The checkpoint it asked for: its id in the reply, then CHECKPOINTED.
    result = wait_until(lambda: words(log).get("result"), timeout=60, what="the RESULT reply")
    asked = words(log)["asked"][0]
    assert result == ["CHECKPOINTED", asked]
    taken = [e for e in events(tmp_path) if e["event"] == "checkpoint"]
    assert [(e["id"], e["pid"]) for e in taken] == [(asked, pid)] and taken[0]["requested_by"]
    assert not [line for line in read_lines(log) if line.startswith("restored")]

    # kill -9: the supervisor restores that checkpoint, whose script asks RESULT again.
    wait_until(lambda: len(read_lines(log)) >= 6, what="ticks")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any(e["event"] == "restored" for e in events(tmp_path)), timeout=60, what="the restore")
    wait_until(lambda: len([line for line in read_lines(log) if line.startswith("result")]) == 2,
               timeout=30, what="the restored script's RESULT")
    restored = [line.split()[1:] for line in read_lines(log) if line.startswith("result")]
    assert restored == [["CHECKPOINTED", asked], ["RESTORED", asked]]
    assert [e["id"] for e in events(tmp_path) if e["event"] == "restored"] == [asked]
    procs.adopt([e for e in events(tmp_path) if e["event"] == "restored"][0]["pid"])

    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    assert not os.path.exists(f"/run/ckpt/run/{supervisor.pid}.sock")


def test_protocol_errors_are_answered(procs, tmp_path):
    """Bad requests get one ERROR line each; the supervisor goes on."""
    script = tmp_path / "bad.sh"
    script.write_text("#!/bin/bash\n"
                      "for r in 'HELLO' 'RESULT nope' 'END nope' 'CHECKPOINT a b c' 'BEGIN x' 'JOURNAL get k'; do\n"
                      "  printf '%s\\n' \"$r\" | socat -t 5 - \"UNIX-CONNECT:$CKPT_SOCKET\" >> \"$1\"\n"
                      "done\n"
                      "ls -l \"$CKPT_SOCKET\" >> \"$1\"\n"
                      "sleep 600\n")
    script.chmod(0o755)
    log = tmp_path / "replies.log"
    start_run(tmp_path, procs, "--every", "1h", "--first-after", "1h", "--", script, log)
    procs.pids.add(wait_until(lambda: [e for e in events(tmp_path) if e["event"] == "started"])[0]["pid"])
    lines = wait_until(lambda: len(read_lines(log)) >= 7 and read_lines(log), what="the replies")
    assert all(line.startswith("ERROR ") for line in lines[:6]), lines
    assert lines[6].startswith("srw-------")  # owner-only


def test_the_journal_over_the_socket_from_a_shell_script(procs, tmp_path):
    """JOURNAL-INTENT / -RECORD / -GET from a script under `ckpt run --name`: the records land
    in the supervisor's store, in the journal of that name, and a second intent is told the
    action was done."""
    script = tmp_path / "journal.sh"
    out = tmp_path / "journal.out"
    script.write_text(f"""#!/bin/bash
say() {{ printf '%s\\n' "$1" | socat -t 5 - "UNIX-CONNECT:$CKPT_SOCKET"; }}
{{
  echo "first $(say 'JOURNAL-INTENT send-mail-7')"
  echo "record $(say 'JOURNAL-RECORD send-mail-7 sent id=42')"
  echo "again $(say 'JOURNAL-INTENT send-mail-7')"
  echo "get $(say 'JOURNAL-GET send-mail-7')"
  echo "bad $(say 'JOURNAL-RECORD send-mail-8')"
  echo "env $CKPT_NAME"
}} > {out}
sleep 600
""")
    script.chmod(0o755)
    start_run(tmp_path, procs, "--every", "1h", "--first-after", "1h", "--name", "mailer", "--", script)
    wait_until(lambda: len(read_lines(out)) >= 6, timeout=60, what="the script's journal requests")
    lines = {line.split()[0]: " ".join(line.split()[1:]) for line in read_lines(out)}
    assert lines["first"] == "OK NEW"
    assert lines["record"] == "OK DONE sent id=42"
    assert lines["again"] == "OK DONE sent id=42"
    assert lines["get"] == "OK DONE sent id=42"
    assert lines["bad"].startswith("ERROR usage")
    assert lines["env"] == "mailer"
    from ckpt.store import Store
    from ckpt.store.journal import Journal as StoreJournal

    store = Store.open(Path(os.environ["CKPT_STORE"]), settings=env_settings())
    entry = StoreJournal(store.backend, "mailer").entry("send-mail-7")
    assert entry is not None and entry.done and entry.outcome == "sent id=42"


SAY = "say() { printf '%s\\n' \"$1\" | socat -t 5 - \"UNIX-CONNECT:$CKPT_SOCKET\"; }\n"


def markers_of(pid: int) -> list[str]:
    return [p.name for p in Path("/run/ckpt/sections").glob(f"{pid}.*")]


def test_begin_of_a_pid_outside_the_supervised_tree_is_refused(procs, tmp_path):
    """BEGIN holds off the dumps of the supervised tree only: a PID outside it (PID 1, any
    other process on the host) gets one ERROR line and no section, and its dumps go on; a PID
    of the tree, and the connecting process, still get their sections."""
    foreign = procs.start_program(["sleep", "600"], "foreign")
    replies = tmp_path / "replies"
    replies.mkdir()
    script = tmp_path / "begin.sh"
    script.write_text("#!/bin/bash\n" + SAY +
                      "say 'BEGIN 1' > \"$1/init\"\n"
                      "say \"BEGIN $2\" > \"$1/foreign\"\n"
                      "say \"BEGIN $$\" > \"$1/own\"\n"
                      "say 'BEGIN' > \"$1/connecting\"\n"
                      "touch \"$1/done\"\n"
                      "sleep 600\n")
    script.chmod(0o755)
    init_markers = markers_of(1)  # none, unless something on this host holds one
    supervisor = start_run(tmp_path, procs, "--every", "1h", "--first-after", "1h", "--", script, replies, foreign.pid)
    pid = wait_until(lambda: [e for e in events(tmp_path) if e["event"] == "started"], what="start")[0]["pid"]
    procs.pids.add(pid)
    wait_until((replies / "done").exists, timeout=30, what="the replies")

    for name, refused in (("init", 1), ("foreign", foreign.pid)):
        reply = (replies / name).read_text()
        assert reply == f"ERROR PID {refused} is not in the supervised tree (root PID {pid}): BEGIN takes a PID " \
                        "of that tree, or none for the connecting process\n", (name, reply)
    assert markers_of(1) == init_markers and markers_of(foreign.pid) == []
    own = (replies / "own").read_text()
    assert own.startswith("SECTION ") and markers_of(pid) == [own.split()[1]]
    assert (replies / "connecting").read_text().startswith("SECTION ")
    # What the issue saw: every dump of the foreign process failed with exit 7.
    proc = ckpt("dump", foreign.pid, "--section-timeout", "1", "--store", tmp_path / "foreign-store", check=False)
    assert proc.returncode == 0, proc.stderr

    supervisor.send_signal(signal.SIGTERM)  # its sections end with it
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    assert markers_of(pid) == []


def test_a_section_of_a_killed_supervisor_does_not_block_a_dump(procs, tmp_path):
    """kill -9 of `ckpt run` leaves the markers of its BEGINs behind; the supervisor owned them,
    so they are void: a later dump of the process that held the section is not held off (and
    removes them)."""
    script = tmp_path / "held.sh"
    script.write_text("#!/bin/bash\n" + SAY + "say \"BEGIN $$\" > \"$1.tmp\" && mv \"$1.tmp\" \"$1\"\nexec sleep 600\n")
    script.chmod(0o755)
    reply = tmp_path / "begin.reply"
    supervisor = start_run(tmp_path, procs, "--every", "1h", "--first-after", "1h", "--", script, reply)
    pid = wait_until(lambda: [e for e in events(tmp_path) if e["event"] == "started"], what="start")[0]["pid"]
    procs.pids.add(pid)
    token = wait_until(lambda: read_lines(reply), timeout=30, what="the BEGIN reply")[0]
    assert token.startswith("SECTION "), token
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=10)
    Path(f"/run/ckpt/run/{supervisor.pid}.sock").unlink(missing_ok=True)  # SIGKILL leaves it behind
    assert Path("/run/ckpt/sections", token.split()[1]).exists() and alive(pid)

    proc = ckpt("dump", pid, "--section-timeout", "1", "--json", check=False)
    assert proc.returncode == 0, proc.stderr
    assert "no_checkpoint() section" not in proc.stderr
    assert markers_of(pid) == []
