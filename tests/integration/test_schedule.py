"""Schedules: cron entries, what `schedule run` records, retention, and a real cron daemon."""

import fcntl
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from ckpt.errors import CkptError
from ckpt.schedule.book import Schedule, ScheduleBook
from tests.helpers import env_settings, ckpt, ckpt_json, read_lines, state, wait_until
from tests.jsonshape import assert_shape


@pytest.fixture
def cron_dir(tmp_path, monkeypatch):
    path = tmp_path / "cron.d"
    monkeypatch.setenv("CKPT_CRON_DIR", str(path))
    # cron even where systemd runs (a developer's machine), whose timers these tests do not test
    monkeypatch.setenv("CKPT_SCHEDULER", "cron")
    return path


def test_add_list_rm(procs, tmp_path, cron_dir, isolated_env):
    target = procs.start("counter.py", tmp_path / "c.txt")
    ckpt("schedule", "add", "agent", "--pid", target.pid, "--every", "5m", "--keep-last", "3")
    entry = cron_dir / "ckpt-agent"
    text = entry.read_text()
    assert oct(entry.stat().st_mode & 0o777) == "0o644"
    line = [x for x in text.splitlines() if x.startswith("*/5 * * * * root ")][0]
    assert f"schedule run agent --store {isolated_env}" in line and line.split()[6].startswith("/")
    assert "PATH=/usr/local/sbin:" in text
    rows = ckpt_json("schedule", "list")
    assert rows[0]["name"] == "agent" and rows[0]["cron"] == "*/5 * * * *" and rows[0]["last"] is None
    assert rows[0]["target"] == {"pid": target.pid} and rows[0]["retention"]["keep_last"] == 3
    assert rows[0]["next_run"][-2:] in ("00", "05", "10", "15", "20", "25", "30", "35", "40", "45", "50", "55")

    checkpoint = ckpt("schedule", "run", "agent").stdout.strip()
    assert ckpt_json("schedule", "list")[0]["last"]["id"] == checkpoint
    ckpt("schedule", "rm", "agent")
    assert not entry.exists() and ckpt_json("schedule", "list") == []
    assert [c["id"] for c in ckpt_json("list")] == [checkpoint], "rm removes the schedule, not checkpoints"


def test_an_existing_schedule_is_replaced_only_with_replace(cron_dir):
    """Issue 24: a second add of the same name replaced the first without a word."""
    ckpt("schedule", "add", "agent", "--match", "no-such-agent-program", "--every", "5m")
    entry = cron_dir / "ckpt-agent"
    first = entry.read_text()
    proc = ckpt("schedule", "add", "agent", "--match", "other", "--every", "1h", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("Error: a schedule named 'agent' exists already; pass --replace to replace it, or "
                           "see 'ckpt schedule list'\n")
    assert entry.read_text() == first
    ckpt("schedule", "add", "agent", "--match", "other", "--every", "1h", "--replace")
    assert "\n0 * * * * root " in entry.read_text()
    assert [(r["name"], r["target"], r["every"]) for r in ckpt_json("schedule", "list")] == [
        ("agent", {"match": "other"}, "1h")]


def test_keep_everything_is_said_once(cron_dir):
    """Issue 24: 'keep keep everything'."""
    proc = ckpt("schedule", "add", "agent", "--match", "no-such-agent-program", "--every", "5m")
    assert ", keep everything; log: " in proc.stderr and "keep keep" not in proc.stderr
    proc = ckpt("schedule", "add", "other", "--match", "x", "--every", "5m", "--keep-last", "3")
    assert ", keep last 3; log: " in proc.stderr


@pytest.mark.parametrize("args", [
    ["--pid", "1", "--every", "30s"],  # cron cannot do seconds
    ["--pid", "1", "--every", "7m"],  # not a divisor of an hour
    ["--pid", "1", "--cron", "61 * * * *"],
    ["--pid", "1"],
    ["--every", "5m"],
    ["--pid", "1", "--match", "x", "--every", "5m"],
    ["--match", "(", "--every", "5m"],
])
def test_bad_schedules_are_refused(args, cron_dir):
    proc = ckpt("schedule", "add", "bad", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("Error: ") and "Traceback" not in proc.stderr
    assert not (cron_dir / "ckpt-bad").exists()
    assert ckpt("schedule", "add", "bad.name", "--pid", "1", "--every", "5m", check=False).returncode == 2


def test_vanished_target_and_bad_matches_are_recorded(procs, tmp_path, cron_dir):
    target = procs.start("counter.py", tmp_path / "c.txt")
    ckpt("schedule", "add", "gone", "--pid", target.pid, "--every", "1m")
    procs.kill_tree(target.pid)
    proc = ckpt("schedule", "run", "gone", check=False)
    assert proc.returncode == 3 and "is gone" in proc.stderr and "Traceback" not in proc.stderr
    last = ckpt_json("schedule", "list")[0]["last"]
    assert last["outcome"] == "target-gone"

    tag = secrets.token_hex(4)
    ckpt("schedule", "add", "nomatch", "--match", f"no-such-program-{tag}", "--every", "1m")
    assert ckpt("schedule", "run", "nomatch", check=False).returncode == 3
    a = procs.start("counter.py", tmp_path / f"twin-{tag}-a.txt")
    b = procs.start("counter.py", tmp_path / f"twin-{tag}-b.txt")
    ckpt("schedule", "add", "twins", "--match", f"twin-{tag}", "--every", "1m")
    proc = ckpt("schedule", "run", "twins", check=False)
    assert proc.returncode == 2 and "refusing to guess" in proc.stderr
    assert str(a.pid) in proc.stderr and str(b.pid) in proc.stderr
    states = {r["name"]: r["last"]["outcome"] for r in ckpt_json("schedule", "list")}
    assert states == {"gone": "target-gone", "nomatch": "target-gone", "twins": "failed"}
    assert ckpt_json("list") == []


def test_overlapping_run_waits_then_skips(procs, tmp_path, cron_dir, isolated_env):
    target = procs.start("counter.py", tmp_path / "c.txt")
    ckpt("schedule", "add", "busy", "--pid", target.pid, "--every", "1m")
    lock = os.open(isolated_env / "schedules" / "busy.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a run still going would hold it
    try:
        proc = ckpt("schedule", "run", "busy", check=False, env={"CKPT_SCHEDULE_WAIT": "1"})
    finally:
        os.close(lock)
    assert proc.returncode == 7 and "skipped" in proc.stderr
    assert ckpt_json("schedule", "list")[0]["last"]["outcome"] == "skipped"
    assert ckpt_json("list") == []
    assert ckpt("schedule", "run", "busy").returncode == 0  # lock released: runs


def test_schedule_retention_keeps_only_what_it_should(procs, tmp_path, cron_dir):
    procs.start("counter.py", tmp_path / "c.txt")
    ckpt("schedule", "add", "kept", "--match", f"counter.py {tmp_path}", "--every", "1m", "--keep-last", "2")
    ids = [ckpt("schedule", "run", "kept").stdout.strip() for _ in range(4)]
    assert [c["id"] for c in ckpt_json("list")] == ids[-2:]
    assert ckpt_json("schedule", "list")[0]["last"]["forgot"] == [ids[1]]
    assert ckpt_json("verify", "--all")[0]["problems"] == []


@pytest.fixture
def cron_daemon():
    """Debian's cron, started here (CI has no init system) unless one runs already; ended by PID."""
    pidfile = Path("/run/crond.pid")
    if pidfile.exists():
        try:
            if state(int(pidfile.read_text().split()[0])) not in (None, "Z"):
                yield None
                return
        except ValueError:
            pass
    daemon = subprocess.Popen(["cron", "-f"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    yield daemon
    daemon.terminate()
    daemon.wait(timeout=10)


def test_real_cron_takes_a_checkpoint_within_130_s(procs, tmp_path, cron_daemon, monkeypatch):
    monkeypatch.setenv("CKPT_SCHEDULER", "cron")
    target = procs.start("counter.py", tmp_path / "c.txt")
    name = f"test-{secrets.token_hex(4)}"
    ckpt("schedule", "add", name, "--pid", target.pid, "--every", "1m", "--keep-last", "1")
    try:
        assert Path(f"/etc/cron.d/ckpt-{name}").exists()
        checkpoints = wait_until(lambda: ckpt_json("list"), timeout=130, interval=2, what="cron to run the schedule")
        assert checkpoints[0]["name"] == name and checkpoints[0]["pid"] == target.pid
        last = wait_until(lambda: ckpt_json("schedule", "list")[0]["last"], timeout=30, what="the outcome")
        assert last["outcome"] == "ok"
    finally:
        removed = ckpt("schedule", "rm", name, check=False)
        Path(f"/etc/cron.d/ckpt-{name}").unlink(missing_ok=True)  # never leave a test's entry behind
    assert removed.returncode == 0, removed.stderr


# Lines Debian's crontab accepts that a crontab editor must leave exactly as they are.
FOREIGN = ["# m h dom mon dow command", "MAILTO=\"\"", "FOO = a b c", "0 0 * * fri-7 echo 'a\\%b'",
           "@reboot /usr/local/bin/thing --start", "", "  7 7 * * *   leading-blanks"]


def _crontab_of_nobody() -> list[str] | None:
    proc = subprocess.run(["crontab", "-u", "nobody", "-l"], capture_output=True, text=True, timeout=30)
    return proc.stdout.splitlines() if proc.returncode == 0 else None


@pytest.fixture
def users_crontab(tmp_path, monkeypatch):
    """ckpt's non-root path (lines in the user's own crontab), run here by root against the real
    crontab of 'nobody': a `crontab` first on PATH adds '-u nobody'. Yields the bin directory."""
    if not shutil.which("crontab"):
        pytest.skip("needs Debian's crontab")
    if _crontab_of_nobody() is not None:
        pytest.skip("'nobody' has a crontab: not touching it")
    real = shutil.which("crontab")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "crontab").write_text(f'#!/bin/sh\nexec {real} -u nobody "$@"\n')
    (bin_dir / "crontab").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    subprocess.run([real, "-u", "nobody", "-"], input="\n".join(FOREIGN) + "\n", text=True, check=True, timeout=30)
    try:
        yield bin_dir
    finally:
        subprocess.run([real, "-u", "nobody", "-r"], capture_output=True, timeout=30)


def test_a_users_crontab_keeps_its_other_lines(users_crontab, tmp_path):
    book = ScheduleBook(tmp_path / "store", env_settings())
    book.install_cron(Schedule(name="agent", target={"pid": 1}, cron="@daily"))
    book.install_cron(Schedule(name="web", target={"pid": 1}, cron="0 9 * * mon-fri"))
    book.install_cron(Schedule(name="agent", target={"pid": 1}, cron="*/5 * * * *"))  # replaces, once
    lines = _crontab_of_nobody()
    ours = [line for line in lines if line not in FOREIGN]
    assert [line for line in lines if line in FOREIGN] == FOREIGN
    assert ours[0::2] == ["# ckpt:web", "# ckpt:agent"], lines
    assert ours[1].startswith("0 9 * * mon-fri PATH=") and ours[3].startswith("*/5 * * * * PATH=")
    assert f"-m ckpt schedule run agent --store {book.store_root} " in ours[3]

    book.remove_cron("agent")
    assert _crontab_of_nobody() == FOREIGN + ours[:2]


def test_a_crontab_that_cannot_be_read_is_not_replaced(users_crontab, tmp_path):
    # Before: any failure of `crontab -l` read as an empty crontab, which ckpt then replaced
    # with its own lines only.
    real = users_crontab / "crontab"
    wrapper = real.read_text()
    real.write_text('#!/bin/sh\n[ "$1" = -l ] && { echo "crontab: cannot open your crontab" >&2; exit 1; }\n'
                    + wrapper.split("\n", 1)[1])
    book = ScheduleBook(tmp_path / "store", env_settings())
    with pytest.raises(CkptError, match="cannot read your crontab: crontab: cannot open your crontab"):
        book.install_cron(Schedule(name="agent", target={"pid": 1}, cron="@daily"))
    assert _crontab_of_nobody() == FOREIGN


def test_schedule_retention_forgets_only_what_the_schedule_made(procs, tmp_path, cron_dir, isolated_env):
    """Issue 24: a schedule's retention forgot every checkpoint of its name, those dumped by hand too."""
    out = tmp_path / "c.txt"
    target = procs.start("counter.py", out)
    wait_until(lambda: len(read_lines(out)) >= 3, what="the counter to count")
    hand = ckpt("dump", target.pid, "--name", "keepme").stdout.strip()
    old = ckpt("dump", target.pid, "--name", "keepme").stdout.strip()
    # As an older ckpt wrote it, by hand or by one of its schedules (docs/design.md, "Origins"):
    # no origin, so nobody's.
    manifest = isolated_env / "checkpoints" / f"{old}.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "origin"}))

    ckpt("schedule", "add", "keepme", "--pid", target.pid, "--every", "1m", "--keep-last", "1")
    # what cron runs (its entry appends stdout and stderr to the schedule's log)
    runs = [ckpt("schedule", "run", "keepme") for _ in range(3)]
    taken = [r.stdout.strip() for r in runs]

    listed = ckpt_json("list")
    assert [c["id"] for c in listed] == [hand, old, taken[-1]], "only the schedule's own were forgotten"
    assert_shape(listed, "list")
    assert [c["origin"] for c in listed] == [{"kind": "dump", "name": None}, None,
                                             {"kind": "schedule", "name": "keepme"}]
    assert ckpt_json("schedule", "list")[0]["last"]["forgot"] == [taken[1]]
    assert f"forgot 1 checkpoint of 'keepme' (keep-last 1): {taken[0]}" in runs[1].stderr
    assert "forgot" not in runs[0].stderr
    entry = (cron_dir / "ckpt-keepme").read_text()
    assert f"schedule run keepme --store {isolated_env} >> " in entry, "not --quiet: the log tells what was forgotten"
    assert "made by schedule 'keepme'" in ckpt("show", taken[-1]).stdout
    assert "made by an older ckpt" in ckpt("show", old).stdout

    # and the hand-made checkpoint still restores
    procs.kill_tree(target.pid)
    written = [int(x) for x in read_lines(out)]
    procs.adopt(int(ckpt("restore", hand).stdout.strip()))
    wait_until(lambda: len(read_lines(out)) >= len(written) + 5, what="the restored counter")
    after = [int(x) for x in read_lines(out)][len(written):]
    assert 3 <= after[0] <= written[-1] and after == list(range(after[0], after[0] + len(after)))


def test_a_group_schedule_takes_one_group_checkpoint_of_its_members(procs, tmp_path, cron_dir, isolated_env):
    """Issue 26: a schedule of several targets (a PID and a --match, each resolved at the run)
    takes one group checkpoint of them, named after it and made by it; list shows the members."""
    from ckpt.store import Origin, Store

    first = procs.start("counter.py", tmp_path / "first.txt")
    second = procs.start("counter.py", tmp_path / "second.txt")
    added = ckpt_json("schedule", "add", "pair", "--group", "--pid", first.pid, "--match",
                      f"counter.py {tmp_path}/second", "--every", "1m", "--keep-last", "2")
    members = [{"pid": first.pid}, {"match": f"counter.py {tmp_path}/second"}]
    assert added["target"] == {"group": members}
    assert "group of pid" in (cron_dir / "ckpt-pair").read_text()
    table = ckpt("schedule", "list").stdout
    assert f"group of pid {first.pid}, match counter.py {tmp_path}/second" in table

    ran = ckpt_json("schedule", "run", "pair")
    assert_shape(ran, "schedule run")
    assert [m["pid"] for m in ran["members"]] == [first.pid, second.pid] and "pid" not in ran
    (group,) = Store.open(isolated_env, False, settings=env_settings()).groups.all()
    assert (group.id, group.name, group.origin) == (ran["group"], "pair", Origin("schedule", "pair"))
    assert [(m.pid, m.checkpoint) for m in group.members] == [(m["pid"], m["checkpoint"]) for m in ran["members"]]
    store = Store.open(isolated_env, False, settings=env_settings())
    assert {store.load(m.checkpoint).origin for m in group.members} == {Origin("schedule", "pair")}
    (row,) = ckpt_json("schedule", "list")
    assert_shape([row], "schedule list")
    assert row["last"]["members"] == ran["members"] and row["last"]["outcome"] == "ok"

    procs.kill_tree(second.pid)  # a member gone: the run fails, nothing is taken
    proc = ckpt("schedule", "run", "pair", check=False)
    assert proc.returncode == 3 and "no process matches" in proc.stderr, proc.stderr
    assert ckpt_json("schedule", "list")[0]["last"]["outcome"] == "target-gone"
    assert [g.id for g in Store.open(isolated_env, False, settings=env_settings()).groups.all()] == [group.id]


def test_a_group_schedules_retention_keeps_its_groups_whole(procs, tmp_path, cron_dir, isolated_env):
    """--keep-last 2 of a group schedule forgets its oldest group, every member with it, and
    never a group of the same name dumped by hand."""
    from ckpt.store import Store

    first = procs.start("counter.py", tmp_path / "first.txt")
    second = procs.start("counter.py", tmp_path / "second.txt")
    hand = ckpt_json("dump", "--group", "pair", first.pid, second.pid)["id"]
    ckpt("schedule", "add", "pair", "--group", "--pid", first.pid, "--pid", second.pid, "--every", "1m",
         "--keep-last", "2")
    ran = [ckpt_json("schedule", "run", "pair") for _ in range(3)]
    store = Store.open(isolated_env, False, settings=env_settings())
    assert store.groups.ids() == [hand, ran[1]["id"], ran[2]["id"]]
    assert ran[2]["forgot"] == [ran[0]["id"]] and ran[1].get("forgot") == []
    kept = {m.checkpoint for g in store.groups.all() for m in g.members}
    assert {m.id for m in store.manifests()} == kept  # the forgotten group's members went with it
