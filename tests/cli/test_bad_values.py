"""Bad option and CKPT_* values: refused before anything runs, with exit code 2 and one line.

None of these needs CRIU: each must stop ckpt before it looks at a process or a store."""

import os
import subprocess
import sys

import pytest

from ckpt.cli.main import main
from tests.helpers import ROOT

NO_SUCH_PID = "4000000"  # above the kernel's PID limit (4194304 at most, 32768 by default here)


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_one_line_usage_error(code, out, err, *words):
    assert code == 2, (code, err)
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("Error: "), err
    for word in words:
        assert word in err, err


@pytest.fixture
def cron_dir(tmp_path, monkeypatch):
    path = tmp_path / "cron.d"
    monkeypatch.setenv("CKPT_CRON_DIR", str(path))
    return path


@pytest.mark.parametrize("argv, words", [
    (["forget", "--keep-last", "-1", "--allow-remove-all", "--dry-run"], ["--keep-last", "-1 is negative"]),
    (["forget", "--keep-daily", "-3"], ["--keep-daily", "-3 is negative"]),
    (["forget", "--keep-within", "bogus"], ["invalid duration 'bogus'"]),
    (["dump", "0"], ["invalid PID 0"]),
    (["dump", "--", "-1"], ["invalid PID -1"]),
    (["dump", NO_SUCH_PID, "--compression", "bogus"], ["--compression", "'bogus' is not one of"]),
    (["dump", NO_SUCH_PID, "--name", "a/b"], ["invalid checkpoint name 'a/b'"]),
    (["run", "--every", "5m", "--max-restores", "-1", "--", "true"], ["--max-restores", "-1 is negative"]),
    (["run", "--every", "5m", "--keep-last", "-1", "--", "true"], ["--keep-last", "-1 is negative"]),
    (["run", "--every", "0", "--", "true"], ["invalid duration '0'"]),
    (["run", "--every", "5m", "--name", "a/b", "--", "true"], ["invalid checkpoint name 'a/b'"]),
    (["show", "latest", "--store", ""], ["--store '' names no directory"]),
    (["dump", "99999999999"], ["invalid PID 99999999999"]),
    (["list", "--name", "a/b"], ["--name", "invalid checkpoint name 'a/b'"]),
    (["forget", "--keep-last", "1", "--name", "a/b"], ["--name", "invalid checkpoint name 'a/b'"]),
])
def test_bad_option_values(capsys, argv, words):
    assert_one_line_usage_error(*run(capsys, *argv), *words)


def test_output_to_a_directory_is_refused(capsys, tmp_path):
    # Before: `run` crashed with an internal error (exit 70) once the command had been started.
    assert_one_line_usage_error(*run(capsys, "run", "--every", "5m", "--output", str(tmp_path), "--", "true"),
                                "--output", "is a directory")
    assert_one_line_usage_error(*run(capsys, "restore", "latest", "--output", str(tmp_path)),
                                "--output", "is a directory")
    assert_one_line_usage_error(*run(capsys, "restore", "latest", "--output", str(tmp_path / "no" / "x.log")),
                                "--output", "is not a directory")


@pytest.mark.parametrize("argv, words", [
    # Before: installed, and every run of it failed.
    (["--every", "5m", "--keep-last", "-1"], ["--keep-last", "-1 is negative"]),
    (["--every", "5m", "--keep-weekly", "-1"], ["--keep-weekly", "-1 is negative"]),
    (["--every", "0m"], ["invalid duration '0m'"]),
])
def test_bad_schedules_install_nothing(capsys, cron_dir, isolated_env, argv, words):
    code, out, err = run(capsys, "schedule", "add", "agent", "--pid", str(os.getpid()), *argv)
    assert_one_line_usage_error(code, out, err, *words)
    assert not cron_dir.exists() and not isolated_env.exists()


@pytest.mark.parametrize("expr, words", [
    # Before: accepted and installed; Debian's cron refuses the line ("bad minute") and never runs it.
    ("5/10 * * * *", ["cron minute field '5/10'", "5-59/10"]),
    # Before: accepted; cron reads '0#2' as every Sunday.
    ("0 0 * * 0#2", ["day-of-week field '0#2'"]),
    ("@reboot", ["'@reboot' runs once when cron starts"]),
    ("0 0 31 2 *", ["day-of-month field '31'", "can never match"]),
])
def test_cron_expressions_cron_would_not_run_as_written_install_nothing(capsys, cron_dir, isolated_env, expr,
                                                                          words):
    code, out, err = run(capsys, "schedule", "add", "agent", "--pid", str(os.getpid()), "--cron", expr)
    assert_one_line_usage_error(code, out, err, *words)
    assert not cron_dir.exists() and not isolated_env.exists()


@pytest.mark.parametrize("expr", ["@daily", "0 9 * * mon-fri", "0 0 */2 * 1"])
def test_what_debians_cron_accepts_is_installed_as_written(capsys, cron_dir, expr):
    # Before: '@daily' and 'mon-fri' were refused.
    code, out, err = run(capsys, "schedule", "add", "agent", "--pid", str(os.getpid()), "--cron", f" {expr} ")
    assert code == 0, err
    assert f"\n{expr} root /" in (cron_dir / "ckpt-agent").read_text()


@pytest.mark.parametrize("pid", ["0", "-1", "99999999999"])
def test_a_schedule_of_pid_0_or_less_is_refused(capsys, cron_dir, isolated_env, pid):
    code, out, err = run(capsys, "schedule", "add", "agent", f"--pid={pid}", "--every", "5m")
    assert_one_line_usage_error(code, out, err, f"invalid PID {pid}")
    assert not cron_dir.exists() and not isolated_env.exists()


def test_a_schedule_keeps_its_pidfile_as_an_absolute_path(capsys, cron_dir, tmp_path, monkeypatch):
    """Cron runs ckpt from $HOME: a relative pidfile would name another file there."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "schedule", "add", "agent", "--pidfile", "agent.pid", "--every", "5m", "--json")
    assert code == 0, err
    assert f"\"pidfile\": \"{tmp_path / 'agent.pid'}\"" in out


@pytest.mark.parametrize("variable, value, command, message", [
    # Read when ckpt.restore.lazy was imported: a 13-line ValueError traceback.
    ("CKPT_LAZY_MIN_MIB", "x", "check", "CKPT_LAZY_MIN_MIB='x' is not a whole number of MiB; unset it or set e.g. 64"),
    # Both silently ignored before.
    ("CKPT_LOCK_TIMEOUT", "abc", "list", "CKPT_LOCK_TIMEOUT='abc' is not a number of seconds; unset it or set e.g. 60"),
    ("CKPT_STAGING", "bogus", "list", "CKPT_STAGING='bogus' is not one of auto, disk, ram; unset it or set e.g. ram"),
    # Fell back to 3 before.
    ("CKPT_CRIU_LOG_LEVEL", "9", "list", "CKPT_CRIU_LOG_LEVEL='9' is not a log level from 0 to 4"),
])
def test_bad_settings_in_the_environment(isolated_env, variable, value, command, message):
    """In a fresh process, as a user runs it: a module that read its setting at import would
    crash before the CLI could say anything."""
    proc = subprocess.run([sys.executable, "-m", "ckpt", command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, variable: value}, cwd=ROOT)
    assert_one_line_usage_error(proc.returncode, proc.stdout, proc.stderr, message)
    assert not isolated_env.exists()  # nothing written


def test_a_thread_id_is_refused_naming_its_process(capsys, procs, isolated_env):
    """CRIU took a thread for a process and failed with 'BUG at criu/pstree.c:484'."""
    from tests.helpers import state, wait_until

    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    proc = procs.start_program([sys.executable, "-c", code], "threads")
    tasks = f"/proc/{proc.pid}/task"
    wait_until(lambda: len(os.listdir(tasks)) == 2, timeout=10, what="the target's second thread")
    tid = max(int(t) for t in os.listdir(tasks) if int(t) != proc.pid)
    code_, out, err = run(capsys, "dump", str(tid))
    assert_one_line_usage_error(code_, out, err, f"{tid} is a thread of process {proc.pid}",
                                f"ckpt dump {proc.pid}")
    assert state(proc.pid) in ("S", "R") and not isolated_env.exists()  # never frozen, nothing written
