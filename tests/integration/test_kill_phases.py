"""kill -9 of ckpt at every named phase (ckpt/phases.py) of dump, restore, forget, rm, prune, copy
and a group dump.

ckpt waits at the phase the test names (CKPT_TEST_PAUSE_AT, a test-only hook), says so in a
file, and is killed there: no guessed sleeps, so every phase is hit on every machine, and a
phase that is never reached fails. After each kill, ckpt's promises:
  - the target is never left frozen: it is not stopped, not in a frozen cgroup, and keeps
    answering (its in-memory counter grows);
  - a --stop dump kills the target only once its checkpoint is committed;
  - no half-written checkpoint is listed: every listed checkpoint verifies, and the newest
    restores with its memory as it was;
  - a killed rm, forget or prune leaves every checkpoint it was not asked to remove intact;
  - ckpt's own helpers (CRIU) do not outlive it for long, and nothing holds the store's lock;
  - the next dump succeeds and leaves no staging behind; prune then reclaims what is left;
  - a killed copy shows no half-copied checkpoint in the destination, and the next copy finishes.
The target is dirtymem.py (8 MiB of random data and a counter): SIGUSR1 makes it write the
checksum of its memory and its counter, SIGUSR2 rewrites some of its pages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.phases import PAUSE_AT, PAUSE_FILE, PHASES
from tests.helpers import ROOT, alive, ckpt, ckpt_json, read_lines, state, tree_pids, wait_until

VARIANTS = {"dump": ("plain", "stop"), "restore": ("eager", "lazy"), "forget": ("",), "rm": ("",), "prune": ("",),
            "copy": ("",), "group": ("plain", "stop"),
            # across two test hosts: tests/integration/test_migrate.py kills it at every migrate phase
            "migrate": ()}
CASES = [(name, variant) for name in PHASES for variant in VARIANTS[name.split(".")[0]]]
MIB = 8
DIRTY_PAGES = MIB * 256  # all of it: the first dump's pack keeps only the interpreter's pages, prune repacks it


def test_every_verb_with_phases_is_tested():
    assert {name.split(".")[0] for name in PHASES} == set(VARIANTS)


def test_every_phase_in_the_code_is_listed():
    """phase("x") calls and PHASES name the same phases (one without the other is untested or dead)."""
    import re

    called = set()
    for path in (ROOT / "ckpt").rglob("*.py"):
        called |= set(re.findall(r'\bphase\("([^"]+)"\)', path.read_text()))
    assert called == set(PHASES)


# ---- the target ----------------------------------------------------------------------------


class Target:
    """dirtymem.py, or what a restore brought back of it (same PID)."""

    def __init__(self, procs, tmp_path: Path):
        self.procs = procs
        self.out = tmp_path / "mem.txt"
        self.popen = procs.start("dirtymem.py", self.out, MIB, "off", DIRTY_PAGES)
        self.pid = self.popen.pid
        wait_until(lambda: "ready" in read_lines(self.out), timeout=30, what="dirtymem to fill its memory")

    def report(self) -> tuple[str, int]:
        """(checksum of its memory, its counter), asked for now."""
        before = len(self._sums())
        os.kill(self.pid, signal.SIGUSR1)
        wait_until(lambda: len(self._sums()) > before, timeout=10, what=f"PID {self.pid} to report")
        _, checksum, counter = self._sums()[before].split()
        return checksum, int(counter)

    def answers_or_dies(self) -> bool:
        """After a kill mid-restore the tree either runs or is being killed by CRIU (seen in state
        R for a few ms before it is a zombie): asks for a report and tells which came first."""
        before = len(self._sums())
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return False
        wait_until(lambda: len(self._sums()) > before or not alive(self.pid), timeout=10,
                   what=f"PID {self.pid} to report or die")
        return len(self._sums()) > before

    def dirty(self) -> None:
        before = sum(line.startswith("dirtied") for line in read_lines(self.out))
        os.kill(self.pid, signal.SIGUSR2)
        wait_until(lambda: sum(line.startswith("dirtied") for line in read_lines(self.out)) > before,
                   timeout=10, what="dirtymem to rewrite its pages")

    def _sums(self) -> list[str]:
        return [line for line in read_lines(self.out) if line.startswith("sum ")]

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return alive(self.pid)

    def assert_running(self) -> tuple[str, int]:
        """Not frozen, and its counter grows. Returns its last report."""
        wait_until(lambda: not frozen(self.pid), timeout=10, what=f"PID {self.pid} to be thawed")
        first = self.report()
        time.sleep(0.3)
        second = self.report()
        assert second[1] > first[1], f"PID {self.pid} makes no progress: {first} then {second}"
        assert not frozen(self.pid)
        return second

    def end(self) -> None:
        self.procs.kill_tree(self.pid)
        if self.popen is not None:
            self.popen.wait(timeout=10)
        wait_until(lambda: state(self.pid) is None, timeout=10, what=f"PID {self.pid} to be free")

    def restored(self, checkpoint_id: str, *args: str) -> dict:
        result = ckpt_json("restore", checkpoint_id, *args)
        assert result["pid"] == self.pid
        self.popen = None
        self.procs.adopt(self.pid)
        return result


def frozen(pid: int) -> bool:
    """Stopped (ptrace or SIGSTOP) or in a frozen cgroup (v1 freezer or v2)."""
    if state(pid) in ("t", "T"):
        return True
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "freezer":
            files = [(Path(f"/sys/fs/cgroup/freezer{path}/freezer.state"), ("FROZEN", "FREEZING"))]
        elif controllers == "":
            files = [(Path(f"/sys/fs/cgroup{base}{path}/cgroup.events"), ("frozen 1",))
                     for base in ("", "/unified")]
        else:
            continue
        for file, words in files:
            try:
                text = file.read_text()
            except OSError:
                continue
            if any(w in text for w in words):
                return True
    return False


# ---- ckpt, killed at a phase ----------------------------------------------------------------


def killed_at(phase: str, args: list, tmp_path: Path, procs, target: Target) -> None:
    """Runs `ckpt ARGS` until it reaches `phase`, then SIGKILLs it there."""
    pause = tmp_path / "paused-at"
    pause.unlink(missing_ok=True)
    errors = open(tmp_path / "killed.stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", *map(str, args)], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=errors,
                            env={**os.environ, PAUSE_AT: phase, PAUSE_FILE: str(pause)})
    try:
        wait_until(lambda: pause.exists() or proc.poll() is not None, timeout=60, what=f"phase {phase}")
        if not pause.exists():
            errors.seek(0)
            pytest.fail(f"ckpt {' '.join(map(str, args))} never reached phase {phase} "
                        f"(exit {proc.returncode}):\n{errors.read()}")
        assert wait_until(pause.read_text).split() == [phase, str(proc.pid)]
        # Its helpers (CRIU; while restoring, the tree too): they must end by themselves.
        helpers = [p for p in tree_pids(proc.pid) if p != proc.pid and p != target.pid]
        procs.pids.update(helpers)  # ended at teardown should the test fail
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errors.close()
    wait_until(lambda: not any(alive(p) for p in helpers), timeout=10,
               what=f"ckpt's helpers {helpers} to end after it was killed")


def assert_intact(expected: dict[str, str], must_remain: set[str], killed_dump: str | None = None) -> list[str]:
    """Only checkpoints that were committed are listed, those that must remain are, and every
    listed one verifies. Returns the listed IDs, oldest first. killed_dump: the checksum of
    the target when a dump was killed (it may have committed a checkpoint, one at most)."""
    verified = ckpt("verify", "--all", "--json", check=False)
    assert verified.returncode == 0, verified.stderr
    ids = [c["id"] for c in json.loads(verified.stdout)]  # every listed checkpoint, as `ckpt list` shows them
    new = [i for i in ids if i not in expected]
    if killed_dump is not None and len(new) == 1:
        expected[new[0]] = killed_dump
    assert set(ids) <= set(expected), f"listed {ids}, committed {sorted(expected)}"
    assert must_remain <= set(ids), f"listed {ids}, {sorted(must_remain)} must remain"
    return ids


def dump(target: Target, expected: dict[str, str]) -> str:
    checksum, _ = target.report()
    checkpoint_id = ckpt_json("dump", target.pid)["id"]
    expected[checkpoint_id] = checksum
    return checkpoint_id


def finish(target: Target, expected: dict[str, str], must_remain: set[str], store: Path,
           ids: list[str] | None = None) -> None:
    """The promises that hold after any kill (see the module's docstring)."""
    ids = ids or assert_intact(expected, must_remain)
    assert [c["id"] for c in ckpt_json("list")] == ids
    # The newest restores, with its memory as it was.
    if target.alive():
        target.end()
    target.restored(ids[-1], "--eager")
    checksum, _ = target.assert_running()
    assert checksum == expected[ids[-1]]
    # The next dump succeeds and leaves no staging of its own or of the killed command.
    latest = dump(target, expected)
    assert not [p.name for p in (store / "tmp").iterdir() if p.name.startswith("dump-")]
    # Nothing holds the store's lock; prune reclaims whatever the kill left.
    ckpt("prune", env={"CKPT_LOCK_TIMEOUT": "30"})
    assert not list((store / "tmp").iterdir()), "staged images left after prune"
    assert_intact(expected, must_remain | {latest})
    target.end()


# ---- one case per phase and variant ---------------------------------------------------------


@pytest.mark.parametrize("phase,variant", CASES, ids=[f"{p}-{v}" if v else p for p, v in CASES])
def test_kill_9_at_phase(phase, variant, procs, tmp_path, isolated_env, monkeypatch):
    scenario(phase, variant, procs, tmp_path, isolated_env, monkeypatch)


# The same promises for a store in S3 (SeaweedFS), at the phases where its writes, lock
# objects and deletions differ from a local store's: the manifest as a create-only PUT, packs
# as multipart uploads, prune's deletions (under its safety margin), forget and rm.
S3_LOCK_TTL = 3
S3_CASES = [("dump.ingest", None), ("dump.before-commit", None), ("forget.removing", None), ("rm.removed", None),
            ("prune.index-written", None), ("prune.deleting", None), ("restore.before-criu", "lazy")]


@pytest.mark.parametrize("phase,variant", S3_CASES, ids=[p for p, _ in S3_CASES])
def test_kill_9_at_phase_on_s3(phase, variant, procs, tmp_path, s3_url, monkeypatch):
    from ckpt.store.backends.cache import store_cache_dir

    monkeypatch.setenv("CKPT_PASSWORD", "kill-phases")
    monkeypatch.setenv("CKPT_STORE", s3_url)
    # prune keeps unreferenced data younger than twice the lock TTL: a short one lets the
    # prune phases be reached (the scenario waits it out).
    monkeypatch.setenv("CKPT_LOCK_TTL", str(S3_LOCK_TTL))
    ckpt("init", s3_url)
    local_side = store_cache_dir(tmp_path / "cache" / "stores", s3_url)
    scenario(phase, variant, procs, tmp_path, local_side, monkeypatch)


def scenario(phase, variant, procs, tmp_path, isolated_env, monkeypatch):
    """Kills ckpt at the phase and checks the promises; isolated_env: the store's local directory."""
    lazy_records = tmp_path / "lazy"
    monkeypatch.setenv("CKPT_LAZY_DIR", str(lazy_records))
    target = Target(procs, tmp_path)
    verb = phase.split(".")[0]
    expected: dict[str, str] = {}
    if verb == "dump":
        first = dump(target, expected)
        checksum, _ = target.report()
        killed_at(phase, ["dump", target.pid] + (["--stop"] if variant == "stop" else []), tmp_path, procs, target)
        running = target.alive()
        if running:  # and its memory is as it was
            assert target.assert_running()[0] == checksum
        else:
            target.popen.wait(timeout=10)
        ids = assert_intact(expected, {first}, killed_dump=checksum)
        # --stop kills the target only once its checkpoint is committed.
        assert running or (variant == "stop" and len(ids) == 2), "the target is gone, and no checkpoint of it"
        finish(target, expected, {first}, isolated_env, ids)
    elif verb == "restore":
        checksum, _ = target.report()
        first = ckpt_json("dump", target.pid, "--stop")["id"]
        expected[first] = checksum
        target.popen.wait(timeout=10)
        killed_at(phase, ["restore", first, f"--{variant}"], tmp_path, procs, target)
        # A lazy restore's page server is detached: it ends once the daemon is done, or at once
        # when no tree depends on it; it must not wait forever, holding the store's lock.
        servers = [int(p.stem) for p in lazy_records.glob("*.json")]
        procs.pids.update(servers)
        wait_until(lambda: not any(alive(p) for p in servers), timeout=30,
                   what=f"page server(s) {servers} to end after ckpt restore was killed")
        if target.answers_or_dies():  # restored before the kill: it runs, with its memory
            target.popen = None
            procs.adopt(target.pid)
            assert target.assert_running()[0] == checksum
        finish(target, expected, {first}, isolated_env)
    elif verb == "forget":
        ids = [dump(target, expected) for _ in range(3)]  # two to remove: killed between them
        killed_at(phase, ["forget", "--keep-last", "1"], tmp_path, procs, target)
        target.assert_running()  # a store command never touches the target
        finish(target, expected, {ids[-1]}, isolated_env)
    elif verb == "rm":
        ids = [dump(target, expected) for _ in range(2)]
        killed_at(phase, ["rm", ids[0]], tmp_path, procs, target)
        target.assert_running()
        finish(target, expected, {ids[-1]}, isolated_env)
    elif verb == "prune":
        first = dump(target, expected)
        target.dirty()
        second = dump(target, expected)
        assert [r["id"] for r in ckpt_json("forget", "--keep-last", "1")["remove"]] == [first]
        del expected[first]
        if os.environ.get("CKPT_STORE", "").startswith("s3://"):
            time.sleep(2 * S3_LOCK_TTL + 1)  # past prune's safety margin
        killed_at(phase, ["prune"], tmp_path, procs, target)
        target.assert_running()
        finish(target, expected, {second}, isolated_env)
    elif verb == "copy":
        copy_killed(phase, target, expected, procs, tmp_path, isolated_env)
    elif verb == "group":
        group_killed(phase, variant, target, procs, tmp_path, isolated_env)
    else:
        pytest.fail(f"no scenario for phase {phase}")


def copy_killed(phase: str, target: Target, expected: dict[str, str], procs, tmp_path: Path, store: Path) -> None:
    """Two checkpoints copied into another store, killed at the phase: the destination shows
    whole checkpoints only (none before the first commit, the first after it), the next copy
    finishes the rest, and what it copied restores from it."""
    dest = tmp_path / "dest"
    first = dump(target, expected)
    target.dirty()
    second = dump(target, expected)
    killed_at(phase, ["copy", "--all", "--to", dest], tmp_path, procs, target)
    target.assert_running()  # a store command never touches the target
    verified = ckpt("verify", "--all", "--json", "--store", dest, check=False)
    assert verified.returncode == 0, verified.stderr
    listed = [c["id"] for c in json.loads(verified.stdout)]
    assert listed == ([first] if phase == "copy.committed" else []), listed
    finished = ckpt_json("copy", "--all", "--to", dest)
    assert [c["status"] for c in finished["checkpoints"]] == (
        ["present", "copied"] if phase == "copy.committed" else ["copied", "copied"])
    assert [c["id"] for c in ckpt_json("list", "--store", dest)] == [first, second]
    assert ckpt("verify", "--all", "--store", dest).returncode == 0
    # Nothing holds the destination's lock; prune reclaims what the kill left there.
    ckpt("prune", "--store", dest, env={"CKPT_LOCK_TIMEOUT": "30"})
    assert not [p for p in (dest / "packs").rglob(".*")], "a partly written pack left after prune"
    target.end()
    target.restored(second, "--eager", "--store", dest)
    assert target.assert_running()[0] == expected[second]
    finish(target, expected, {first, second}, store)


def group_killed(phase: str, variant: str, target: Target, procs, tmp_path: Path, store: Path) -> None:
    """A group dump of two trees killed at the phase: every tree runs on, unfrozen, with its
    memory as it was, unless (--stop) the group was committed, and then the group restores;
    no group is visible before its commit point; no CRIU lock is left but a committed --stop
    group's own (lifted by its restore); nothing is left locked: the next group dump works."""
    from ckpt.store import Store
    from tests.helpers import env_settings

    (tmp_path / "second").mkdir()
    second = Target(procs, tmp_path / "second")
    members = (target, second)
    checksums = [m.report()[0] for m in members]
    tables_before = criu_tables()
    killed_at(phase, ["dump", "--group", "g", target.pid, second.pid] + (["--stop"] if variant == "stop" else []),
              tmp_path, procs, target)
    groups = Store.open(store, False, settings=env_settings()).groups.ids()
    committed = variant == "stop" and phase in ("group.released", "group.members-committed")
    assert len(groups) == (1 if committed else 0), f"groups {groups} after a kill at {phase} ({variant})"
    if committed:  # --stop ends the trees only once the group is committed: it brings them back
        for member in members:
            member.popen.wait(timeout=10)
        restored = ckpt_json("restore", "g")
        assert [m["pid"] for m in restored["members"]] == [m.pid for m in members]
        for member in members:
            member.popen = None
            procs.adopt(member.pid)
    else:
        assert criu_tables() == tables_before, "CRIU's network lock was left behind"
    for member, checksum in zip(members, checksums, strict=True):
        assert member.assert_running()[0] == checksum
    assert ckpt_json("dump", "--group", "g", target.pid, second.pid)["id"] in \
        Store.open(store, False, settings=env_settings()).groups.ids()
    for member in members:
        member.end()


def criu_tables() -> list[str]:
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if "CRIU" in line]
