"""`ckpt run`: a supervised command that dies is restored from its newest checkpoint."""

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, ROOT, ckpt, ckpt_json, read_lines, state, wait_until
from tests.jsonshape import assert_events, assert_shape


def start_run(tmp_path, procs, *args):
    log = open(tmp_path / "run.stderr", "wb")
    supervisor = subprocess.Popen([sys.executable, "-m", "ckpt", "run", "--output", str(tmp_path / "run.out"),
                                   *map(str, args)], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True)
    log.close()
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    return supervisor


def both_started_and_checkpointed(tmp_path, procs) -> tuple[int, int]:
    """The PIDs of a group run's two members, once both started (adopted for the clean-up) and
    the run has taken its first group checkpoint."""
    started = wait_until(lambda: len([e for e in events(tmp_path) if "started PID" in e]) == 2 and
                         [e for e in events(tmp_path) if "started PID" in e], what="both members to start")
    first, second = (int(e.split("started PID ")[1].split(":")[0]) for e in started)
    procs.pids.update((first, second))
    wait_until(lambda: any(e.startswith("ckpt: group checkpoint ") for e in events(tmp_path)), timeout=20,
               what="a group checkpoint")
    return first, second


def events(tmp_path) -> list[str]:
    return read_lines(tmp_path / "run.stderr")


def child_pid(tmp_path) -> int:
    line = wait_until(lambda: [e for e in events(tmp_path) if "started PID" in e], what="start")[0]
    return int(line.split("started PID ")[1].split(":")[0])


def ints(path: Path) -> list[int]:
    return [int(x) for x in read_lines(path)]


def test_killed_command_carries_on_from_the_last_checkpoint(procs, tmp_path):
    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--name", "counter", "--keep-last", "2", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    wait_until(lambda: sum("checkpoint " in e for e in events(tmp_path)) >= 3, timeout=30, what="three checkpoints")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("killed by signal 9" in e for e in events(tmp_path)), what="the death to be seen")
    written = ints(out)  # the killed counter has written its last value by now
    killed_at, n = written[-1], len(written)  # what follows is the restored counter's (it appends)
    wait_until(lambda: any("restored" in e for e in events(tmp_path)), what="the restore")
    # (Counted before the restore: the restored counter may write before its restore is logged,
    # and a count taken then missed its first values: 70 after a kill at 68, in one CI run.)
    wait_until(lambda: len(ints(out)) >= n + 5, what="the restored counter")
    after = ints(out)[n:]
    # It goes on from a checkpointed value: not from 1, and at most one past where it was killed
    # (when the last checkpoint came after its last write).
    assert 10 < after[0] <= killed_at + 1
    assert after == list(range(after[0], after[0] + len(after)))
    assert len([c for c in ckpt_json("list") if c["name"] == "counter"]) <= 3
    supervisor.send_signal(signal.SIGTERM)  # forwarded to the command
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    assert state(pid) in (None, "Z")
    assert "supervision ends" in events(tmp_path)[-1]


def test_restore_limit(procs, tmp_path):
    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--max-restores", "1", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    wait_until(lambda: any("checkpoint " in e for e in events(tmp_path)), what="a checkpoint")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("restored" in e for e in events(tmp_path)), what="the restore")
    os.kill(pid, signal.SIGKILL)  # the restored command has the same PID
    assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
    assert any("restore limit (1) reached" in e for e in events(tmp_path))


def test_clean_exit_ends_supervision_with_its_status(procs, tmp_path):
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--", sys.executable, "-c",
                           "import time; time.sleep(2.5)")
    assert supervisor.wait(timeout=30) == 0
    assert any("exited with status 0; supervision ends" in e for e in events(tmp_path))


def test_failure_before_any_checkpoint_is_handed_on(procs, tmp_path):
    supervisor = start_run(tmp_path, procs, "--every", "1m", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert supervisor.wait(timeout=30) == 3
    assert any("nothing to restore" in e for e in events(tmp_path))


def test_run_forgets_only_the_checkpoints_it_made(procs, tmp_path):
    """Issue 24: `ckpt run --keep-last` forgot, silently, a checkpoint dumped by hand under its name."""
    hand_out = tmp_path / "hand.txt"
    target = procs.start("counter.py", hand_out)
    wait_until(lambda: len(ints(hand_out)) >= 3, what="the counter dumped by hand to count")
    hand = ckpt("dump", target.pid, "--name", "keepme").stdout.strip()

    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--every", "1s", "--keep-last", "1", "--name", "keepme", "--",
                           sys.executable, FIXTURES / "counter.py", out, 0.05)
    procs.pids.add(child_pid(tmp_path))
    wait_until(lambda: sum(e.startswith("ckpt: checkpoint ") for e in events(tmp_path)) >= 3, timeout=30,
               what="three checkpoints")
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM
    taken = [e.split()[2].rstrip(":") for e in events(tmp_path) if e.startswith("ckpt: checkpoint ")]

    listed = ckpt_json("list")
    assert hand in [c["id"] for c in listed], "the checkpoint dumped by hand is still there"
    assert_shape(listed, "list")
    assert [(c["id"], c["origin"]) for c in listed] == [
        (hand, {"kind": "dump", "name": None}), (taken[-1], {"kind": "run", "name": "keepme"})]
    forgot = re.compile(r"^ckpt: forgot 1 checkpoint of 'keepme' \(keep-last 1\): [0-9a-f-]{26}$")
    said = [e.split()[-1] for e in events(tmp_path) if forgot.match(e)]
    assert said == taken[:-1], "each checkpoint of the run but the last forgotten, and said so"
    shown = ckpt_json("show", hand)
    assert_shape(shown, "show")
    assert shown["origin"] == {"kind": "dump", "name": None}
    assert "made by ckpt dump (by hand)" in ckpt("show", hand).stdout
    assert "made by ckpt run --name keepme" in ckpt("show", taken[-1]).stdout

    # and the hand-made checkpoint still restores
    procs.kill_tree(target.pid)
    written = ints(hand_out)
    procs.adopt(int(ckpt("restore", hand).stdout.strip()))
    wait_until(lambda: len(ints(hand_out)) >= len(written) + 5, what="the restored counter")
    after = ints(hand_out)[len(written):]
    assert 3 <= after[0] <= written[-1] and after == list(range(after[0], after[0] + len(after)))


def test_a_crash_in_the_first_seconds_is_recovered(procs, tmp_path):
    """Issue 24: with the default --every 5m, a crash in the first five minutes ended the run ('no
    checkpoint was taken yet'). The first checkpoint comes --first-after (3 s) the start."""
    out = tmp_path / "count.txt"
    supervisor = start_run(tmp_path, procs, "--name", "early", "--", sys.executable, FIXTURES / "counter.py", out,
                           0.05)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    started = time.monotonic()
    wait_until(lambda: any(e.startswith("ckpt: checkpoint ") for e in events(tmp_path)), timeout=20,
               what="the first checkpoint, with the default --every 5m")
    assert time.monotonic() - started > 2, "not before --first-after (3 s)"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("killed by signal 9" in e for e in events(tmp_path)), what="the death to be seen")
    written = ints(out)
    killed_at, n = written[-1], len(written)
    wait_until(lambda: any("restored" in e for e in events(tmp_path)), timeout=30, what="the restore")
    wait_until(lambda: len(ints(out)) >= n + 5, what="the restored counter")
    after = ints(out)[n:]
    # From the checkpoint, taken some 3 s (60 counts at 0.05 s) after the start: not from 1.
    assert 20 < after[0] <= killed_at + 1
    assert after == list(range(after[0], after[0] + len(after)))
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM


# Dies at once, with status 1, once DIE exists: after the restores too, which find it there.
DIES_ONCE_TOLD = """
import os, sys, time
out, die = sys.argv[1], sys.argv[2]
i = 0
while True:
    i += 1
    if os.path.exists(die):
        sys.exit(1)
    with open(out, "a") as f:
        f.write(f"{i}\\n")
    time.sleep(0.05)
"""


def test_a_tree_that_dies_after_each_restore_is_restored_after_growing_pauses(procs, tmp_path):
    """Issue 24: a program that died right after each restore was restored three times in 1.5 s
    and given up on. Now the first restore is at once, then each waits 1 s, 2 s..., said."""
    out, die, events_file = tmp_path / "count.txt", tmp_path / "die", tmp_path / "events.jsonl"
    with open(events_file, "wb") as stdout, open(tmp_path / "run.stderr", "wb") as stderr:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "run", "--json", "--every", "1s", "--max-restores", "3",
             "--output", str(tmp_path / "run.out"), "--", sys.executable, "-c", DIES_ONCE_TOLD, out, die],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    procs.pids.add(child_pid(tmp_path))
    wait_until(lambda: any(e.startswith("ckpt: checkpoint ") for e in events(tmp_path)), timeout=20,
               what="a checkpoint")
    die.touch()
    assert supervisor.wait(timeout=40) == 1  # the command's status, after the last restore died too
    said = events(tmp_path)
    pauses = [e for e in said if "before restore" in e]
    assert all(re.search(r"^Warning: PID \d+ died \d+\.\d s after restore [12]: waiting [12] s before restore [23] "
                         r"of 3$", e) for e in pauses), pauses
    assert [int(e.split("waiting ")[1].split()[0]) for e in pauses] == [1, 2]
    assert "restore limit (3) reached; giving up" in said[-1]

    seen = assert_events(read_lines(events_file))
    kinds = [e["event"] for e in seen]
    assert kinds[kinds.index("died"):] == ["died", "restored", "died", "restore_delayed", "restored",
                                           "died", "restore_delayed", "restored", "died", "exit"]
    delayed = [e for e in seen if e["event"] == "restore_delayed"]
    assert [(e["delay_s"], e["restores"], e["max_restores"]) for e in delayed] == [(1, 1, 3), (2, 2, 3)]
    assert all(e["ran_s"] < 5 for e in delayed)
    stamp = {i: datetime.fromisoformat(e["time"]) for i, e in enumerate(seen)}
    for i, e in enumerate(seen):
        if e["event"] == "restore_delayed":  # the restore came no sooner than said
            assert (stamp[i + 1] - stamp[i]).total_seconds() >= e["delay_s"]
    assert seen[-1]["reason"] == "restore_limit" and seen[-1]["restores"] == 3


def test_supervision_outlives_the_reader_of_its_output(procs, tmp_path):
    """Issue 24: `ckpt run ... 2>&1 | head -1`: ckpt died at its next message (EPIPE) and the
    command ran on unsupervised. Now ckpt's messages go on in its log, and a crash after the
    pipe closed is still restored. A hang-up (the terminal closed) does not end it either."""
    out = tmp_path / "count.txt"
    read_end, write_end = os.pipe()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "ckpt", "run", "--every", "1s", "--name", "piped", "--output", str(tmp_path / "run.out"),
         "--", sys.executable, FIXTURES / "counter.py", out, "0.05"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    os.close(write_end)
    head = subprocess.Popen(["head", "-1"], stdin=read_end, stdout=subprocess.PIPE)
    os.close(read_end)
    first = head.communicate(timeout=30)[0].decode()
    assert head.returncode == 0 and first.startswith("ckpt: started PID "), first
    pid = int(first.split("started PID ")[1].split(":")[0])
    procs.pids.add(pid)
    log = Path(first.split("ckpt's log: ")[1].rstrip(")\n")) if "ckpt's log: " in first else None

    def logged() -> list[str]:
        return read_lines(log) if log else []

    def checkpoints_since_the_pipe_closed() -> int:
        lines = logged()
        gone = [i for i, e in enumerate(lines) if "can no longer be shown" in e]
        return sum(" info: checkpoint " in e for e in lines[gone[0]:]) if gone else 0

    # The reader is gone; ckpt meets EPIPE at its next message (a checkpoint, every second).
    wait_until(lambda: supervisor.poll() is not None or checkpoints_since_the_pipe_closed() >= 2, timeout=30,
               what="ckpt to write on after its reader exited")
    assert supervisor.poll() is None, f"ckpt ended (exit {supervisor.returncode}) when its reader went away"
    supervisor.send_signal(signal.SIGHUP)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any("killed by signal 9" in e for e in logged()), what="the death, in ckpt's log")
    written = ints(out)
    n = len(written)
    wait_until(lambda: any(" info: restored " in e for e in logged()), timeout=30, what="the restore, logged")
    wait_until(lambda: len(ints(out)) >= n + 5, what="the restored counter")
    after = ints(out)[n:]
    assert 10 < after[0] <= written[-1] + 1 and after == list(range(after[0], after[0] + len(after)))
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=15) == 128 + signal.SIGTERM
    assert "supervision ends" in logged()[-1]


def test_each_run_has_its_own_output_file(procs, tmp_path, isolated_env):
    """Issue 24: successive runs of one name appended to one output file. Each run now writes a
    file of its own (and ckpt's log beside it); --output FILE is appended to, as given."""
    for word in ("first", "second"):
        done = subprocess.run([sys.executable, "-m", "ckpt", "run", "--name", "twice", "--", "sh", "-c",
                               f"echo {word}"], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
    run_dir = isolated_env / "logs" / "run-twice"
    outputs = sorted(run_dir.glob("output-*.log"))
    assert [p.read_text() for p in outputs] == ["first\n", "second\n"]
    logs = sorted(run_dir.glob("ckpt-*.log"))
    assert [p.name.replace("ckpt-", "output-") for p in logs] == [p.name for p in outputs]
    assert all("supervision ends" in read_lines(p)[-1] for p in logs)
    given = tmp_path / "given.out"
    given.write_text("earlier\n")
    done = subprocess.run([sys.executable, "-m", "ckpt", "run", "--name", "twice", "--output", str(given), "--",
                           "sh", "-c", "echo third"], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert given.read_text() == "earlier\nthird\n"  # appended to, as it is
    assert f"(output: {given}, after the 8 B it held; ckpt's log: " in done.stderr


def test_a_second_run_of_a_live_name_is_refused_and_a_dead_ones_name_is_free(procs, tmp_path):
    """Two supervisors of one name would forget each other's checkpoints (each run's retention
    forgets the checkpoints of its name), and the one whose newest went could restore nothing."""
    first = start_run(tmp_path, procs, "--every", "1h", "--name", "twice", "--", "sleep", "600")
    procs.pids.add(child_pid(tmp_path))
    second = subprocess.run([sys.executable, "-m", "ckpt", "run", "--every", "1h", "--name", "twice", "--",
                             "sleep", "600"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    assert f"(PID {first.pid}) supervises the name 'twice'" in second.stderr and "--name" in second.stderr
    assert "Traceback" not in second.stderr
    first.kill()  # kill -9: its lock dies with it
    first.wait(timeout=10)
    (tmp_path / "run.stderr").unlink()
    third = start_run(tmp_path, procs, "--every", "1h", "--name", "twice", "--", "sleep", "600")
    procs.pids.add(child_pid(tmp_path))
    assert third.poll() is None


def test_a_signal_during_a_restore_reaches_the_restored_tree(procs, tmp_path):
    """SIGTERM while the supervisor restores (no tree to forward it to yet): the restored tree
    gets it once it runs, and supervision ends, instead of the signal being lost and the next
    crash of the tree taken for a stop."""
    from ckpt.phases import PAUSE_AT, PAUSE_FILE

    out, pause = tmp_path / "count.txt", tmp_path / "paused"
    log = open(tmp_path / "run.stderr", "wb")
    supervisor = subprocess.Popen([sys.executable, "-m", "ckpt", "run", "--every", "1s", "--output",
                                   str(tmp_path / "run.out"), "--", sys.executable, FIXTURES / "counter.py", out],
                                  cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                  env={**os.environ, PAUSE_AT: "restore.before-criu", PAUSE_FILE: str(pause)})
    log.close()
    procs.popens.append(supervisor)
    pid = child_pid(tmp_path)
    procs.pids.add(pid)
    wait_until(lambda: any("checkpoint " in e for e in events(tmp_path)), timeout=30, what="a checkpoint")
    os.kill(pid, signal.SIGKILL)
    wait_until(pause.exists, timeout=60, what="the restore to reach CRIU")
    supervisor.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # the handler has run (the pause polls every 50 ms)
    pause.unlink()  # the restore goes on
    assert supervisor.wait(timeout=60) == 128 + signal.SIGTERM, events(tmp_path)
    restored = [e for e in events(tmp_path) if "restored" in e and " as PID " in e]
    assert restored, events(tmp_path)
    assert state(int(restored[-1].split(" as PID ")[1].split()[0])) in (None, "Z")


def peer_status(path: Path) -> dict:
    """What tests/fixtures/stream_peer.py says of its end: {"sent", "received", "bad"}."""
    try:
        fields = dict(item.split("=", 1) for item in path.read_text().split())
    except OSError:
        return {"sent": 0, "received": 0, "bad": "-"}
    return {"sent": int(fields.get("sent", 0)), "received": int(fields.get("received", 0)), "bad": fields.get("bad")}


def test_a_group_run_restores_every_member_when_one_dies(procs, tmp_path):
    """Issue 26: `ckpt run -- A ::: B`, two trees streaming numbered lines to each other over TCP
    both ways: a group checkpoint, one member killed (SIGKILL, by PID), and ckpt run ends the
    other and restores both from the group checkpoint; both carry on, every number received
    once and in order on both sides (each end checks), the connection between them established."""
    port, server_status, client_status = tmp_path / "port", tmp_path / "server.status", tmp_path / "client.status"
    # The client waits (bounded) for the server's port, then becomes the peer (exec: same PID).
    client = (f'i=0; while [ ! -s {port} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; '
              f'exec {sys.executable} {FIXTURES / "stream_peer.py"} client "$(cat {port})" {client_status}')
    events_file = tmp_path / "events.jsonl"
    with open(events_file, "wb") as stdout, open(tmp_path / "run.stderr", "wb") as stderr:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "run", "--json", "--every", "2s", "--first-after", "1s", "--name", "pair",
             "--keep-last", "2", "--output", str(tmp_path / "run.out"), "--", sys.executable,
             str(FIXTURES / "stream_peer.py"), "server", str(port), str(server_status), ":::", "sh", "-c", client],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    server, client_pid = both_started_and_checkpointed(tmp_path, procs)
    at_kill = {path: peer_status(path) for path in (server_status, client_status)}
    assert all(s["received"] > 0 and s["bad"] == "-" for s in at_kill.values()), at_kill
    os.kill(client_pid, signal.SIGKILL)
    wait_until(lambda: any("restored group " in e for e in events(tmp_path)), timeout=30, what="the group restore")
    restored = [e for e in events(tmp_path) if "restored group " in e][-1]
    assert f"as PIDs {server}, {client_pid} (restore 1 of 3)" in restored, events(tmp_path)
    for path in (server_status, client_status):
        # What the killed incarnations wrote last (the server saw its peer's end: EOF) is stale:
        # overwritten with a mark that only the restored peer's next record (every 20 ms) replaces.
        with open(path, "r+b") as status:
            os.pwrite(status.fileno(), b"sent=0 received=0 bad=stale".ljust(119) + b"\n", 0)
    for path in (server_status, client_status):  # both carry on from the checkpoint, nothing lost or repeated
        wait_until(lambda: peer_status(path)["received"] > at_kill[path]["received"] + 20000
                   or peer_status(path)["bad"] not in ("-", "stale"), timeout=20, what=f"{path.name} to receive on")
        assert peer_status(path)["bad"] == "-", (path.name, peer_status(path))
    assert state(server) not in (None, "Z", "t", "T") and state(client_pid) not in (None, "Z", "t", "T")
    supervisor.send_signal(signal.SIGTERM)  # forwarded to both members
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM
    assert state(server) in (None, "Z") and state(client_pid) in (None, "Z")
    assert "supervision ends" in " ".join(events(tmp_path)[-3:])
    told = assert_events(read_lines(events_file))
    kinds = [e["event"] for e in told]
    assert kinds[:3] == ["started", "started", "group_checkpoint"], kinds
    # (after the restore, more group checkpoints and what retention forgot, as time goes)
    died, restored_event, ended = [e for e in told[kinds.index("died"):]
                                   if e["event"] not in ("group_checkpoint", "forgot")]
    assert [e["event"] for e in (died, restored_event, ended)] == ["died", "group_restored", "exit"], kinds
    assert died["pid"] == client_pid and restored_event["pids"] == [server, client_pid]
    assert restored_event["id"] == [e for e in told if e["event"] == "group_checkpoint"][-1]["id"]
    assert ended["reason"] == "stopped" and ended["exit_code"] == 128 + signal.SIGTERM


@pytest.mark.parametrize("first,code,reason", [
    ("sleep 0.5", 0, "exited"),  # a clean exit ends the run: the other member is ended
    ("exit 3", 3, "no_checkpoint"),  # a death before the first group checkpoint: nothing to restore
])
def test_a_group_run_ends_with_its_first_member_to_end_when_it_cannot_go_on(procs, tmp_path, first, code, reason):
    events_file = tmp_path / "events.jsonl"
    with open(events_file, "wb") as stdout, open(tmp_path / "run.stderr", "wb") as stderr:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "ckpt", "run", "--json", "--every", "1h", "--name", "ends",
             "--output", str(tmp_path / "run.out"), "--", "sh", "-c", first, ":::", "sleep", "600"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
    procs.popens.append(supervisor)
    procs.pids.add(supervisor.pid)
    assert supervisor.wait(timeout=30) == code, events(tmp_path)
    told = assert_events(read_lines(events_file))
    started = [e["pid"] for e in told if e["event"] == "started"]
    assert len(started) == 2 and told[-1]["reason"] == reason and told[-1]["pid"] == started[0]
    assert state(started[1]) in (None, "Z"), "the other member was left running"


def test_a_group_run_gives_up_at_the_restore_limit_and_ends_every_member(procs, tmp_path):
    """Two counters as one group, --max-restores 1: the first death restores both (each counts
    on from the group checkpoint), the second ends the run and the other member with it."""
    outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    # One group checkpoint (--first-after), taken well before the kill: the restore goes back.
    supervisor = start_run(tmp_path, procs, "--every", "1h", "--first-after", "1s", "--max-restores", "1", "--name",
                           "counters", "--", sys.executable, FIXTURES / "counter.py", outs[0], 0.05, ":::",
                           sys.executable, FIXTURES / "counter.py", outs[1], 0.05)
    first, second = both_started_and_checkpointed(tmp_path, procs)
    time.sleep(0.3)  # both count on past it
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: any("restored group " in e for e in events(tmp_path)), timeout=30, what="the group restore")

    def restarted(values: list[int]) -> int | None:
        """Where the restored counter took over: the first value that is not the one before + 1."""
        return next((i for i in range(1, len(values)) if values[i] != values[i - 1] + 1), None)

    # Each counted on after the group checkpoint, then went back to its checkpointed value (both
    # were frozen together, then ran on until the kill): the restored one counts from there.
    wait_until(lambda: all((i := restarted(ints(out))) is not None and len(ints(out)) >= i + 5 for out in outs),
               what="both restored counters to count on")
    for out in outs:
        values = ints(out)
        i = restarted(values)
        assert i is not None and 1 < values[i] <= values[i - 1], (out.name, values[max(0, (i or 0) - 3):(i or 0) + 3])
        assert values[i:] == list(range(values[i], values[i] + len(values) - i)), out.name
    os.kill(first, signal.SIGKILL)  # the restored members have their PIDs back
    assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
    assert any("restore limit (1) reached" in e for e in events(tmp_path))
    assert state(second) in (None, "Z")
