"""An error raised in a forked child keeps its class, hint and documented exit code in the parent
(a restore with --new-pidns used to turn every error but CRIU's into a plain exit 1)."""

import os

import pytest

from ckpt.errors import CkptError, CriuFailed, ExitCode, PidInUse, StoreBusy, from_record, to_record


@pytest.mark.parametrize("error", [
    StoreBusy("the store is locked", hint="wait"),
    PidInUse("PID 42 is taken"),
    CriuFailed("CRIU failed", log_path="/x/restore.log", log_lines=["Error (criu/cr-restore.c:1): boom"]),
    CkptError("plain"),
])
def test_errors_cross_a_fork_with_their_class_and_exit_code(error):
    again = from_record(to_record(error))
    assert type(again) is type(error)
    assert (again.message, again.hint, again.exit_code) == (error.message, error.hint, error.exit_code)
    assert getattr(again, "log_lines", None) == getattr(error, "log_lines", None)


def test_an_unknown_class_keeps_its_exit_code():
    record = {**to_record(StoreBusy("busy")), "error_type": "SomethingNewer"}
    again = from_record(record)
    assert type(again) is CkptError and again.exit_code == ExitCode.BUSY


@pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace needs root")
def test_a_restore_in_a_new_pid_namespace_reports_the_typed_error():
    from ckpt.restore.pidns import run_in_new_pidns

    def fails() -> int:
        raise PidInUse("PID 4242 is in use", hint="restore with --new-pidns")

    with pytest.raises(PidInUse) as caught:
        run_in_new_pidns(fails)
    assert caught.value.exit_code == ExitCode.BUSY and caught.value.hint == "restore with --new-pidns"
