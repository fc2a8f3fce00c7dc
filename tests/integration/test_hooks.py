"""Hooks: environment, order around the freeze, and failure handling."""

from tests.helpers import alive, ckpt, ckpt_json, read_lines, state


def test_pre_dump_hook_runs_before_the_freeze_with_its_environment(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    seen = tmp_path / "hook.txt"
    hook = (f'echo "$CKPT_EVENT $CKPT_PID $CKPT_ID $CKPT_NAME" >> {seen}; '
            f'cut -d" " -f3 /proc/$CKPT_PID/stat >> {seen}')
    dumped = ckpt_json("dump", target.pid, "--name", "hooked", "--pre-dump", hook)
    event, pid, checkpoint_id, name = read_lines(seen)[0].split()
    assert (event, int(pid), checkpoint_id, name) == ("pre-dump", target.pid, dumped["id"], "hooked")
    assert read_lines(seen)[1] in ("S", "R"), "the hook must run while the target is not frozen"


def test_failing_pre_dump_hook_aborts_cleanly(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    proc = ckpt("dump", target.pid, "--pre-dump", "echo flush failed >&2; exit 3", check=False)
    assert proc.returncode == 1 and "pre-dump hook failed with exit code 3" in proc.stderr
    assert "flush failed" in proc.stderr and "Traceback" not in proc.stderr
    assert ckpt_json("list") == []
    assert alive(target.pid) and state(target.pid) not in ("T", "t")


def test_post_restore_hook_sees_the_restored_tree_and_its_failure_leaves_it_running(procs, tmp_path):
    target = procs.start("counter.py", tmp_path / "c.txt")
    checkpoint = ckpt("dump", target.pid).stdout.strip()
    procs.kill_tree(target.pid)
    seen = tmp_path / "hook.txt"
    restored = ckpt_json("restore", checkpoint, "--post-restore",
                         f'echo "$CKPT_EVENT $CKPT_PID $CKPT_ID" > {seen}; test -d /proc/$CKPT_PID')
    procs.adopt(restored["pid"])
    assert read_lines(seen) == [f"post-restore {restored['pid']} {checkpoint}"]
    assert restored["hook_error"] is None
    procs.kill_tree(restored["pid"])

    proc = ckpt("restore", checkpoint, "--post-restore", "exit 4", "--json")
    result = __import__("json").loads(proc.stdout)
    procs.adopt(result["pid"])
    assert proc.returncode == 0 and "exit code 4" in result["hook_error"]
    assert "post-restore hook failed" in proc.stderr and "keeps running" in proc.stderr
    assert alive(result["pid"])
