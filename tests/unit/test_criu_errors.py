"""CRIU's failures, read from its log, become errors that say what to do."""

import pytest

from ckpt.criu.client import explain_failure
from ckpt.errors import CriuFailed, PidInUse


def failure(tmp_path, action, *log_lines):
    log = tmp_path / "criu.log"
    log.write_text("\n".join(f"(00.0{k:05d}) {line}" for k, line in enumerate(log_lines)) + "\n")
    return explain_failure(action, log)


def test_a_file_gone_since_the_dump_is_named_with_its_fix(tmp_path):
    error = failure(tmp_path, "restore",
                    "1234: Error (criu/files-reg.c:2353): Can't open file var/log/agent.log on restore: "
                    "No such file or directory",
                    "Error (criu/cr-restore.c:2331): Restoring FAILED.")
    assert isinstance(error, CriuFailed)
    assert error.message == "a file the checkpointed tree had open is gone: /var/log/agent.log"
    assert "recreate it" in error.hint and str(tmp_path / "criu.log") in error.hint


def test_a_pid_in_use_and_an_unknown_failure(tmp_path):
    assert isinstance(failure(tmp_path, "restore", "Error (criu/cr-restore.c:1): Can't fork for 4242: File exists"),
                      PidInUse)
    error = failure(tmp_path, "dump", "Error (criu/x.c:1): something new")
    assert isinstance(error, CriuFailed) and "something new" in error.message
    assert "full log" in error.hint


def test_a_datagram_peer_gone_since_the_dump_says_to_start_it(tmp_path):
    """A path that is there but refuses (its program ended): restore's own check passed, CRIU failed."""
    error = failure(tmp_path, "restore",
                    "24274: Error (criu/sk-unix.c:1406): unix: Can't connect 2667179 socket: Connection refused",
                    "24274: Error (criu/files.c:1221): Unable to open fd=3 id=0xf",
                    "Error (criu/cr-restore.c:2331): Restoring FAILED.")
    assert isinstance(error, CriuFailed)
    assert "sent datagrams to is not there" in error.hint and "start the program" in error.hint


def test_a_truncated_image_is_a_typed_error_and_unreadable_stats_are_left_out(tmp_path):
    """CRIU writes stats-dump into the store's log directory and ignores a failed write: on a
    full disk it is empty, which is no reason to fail the dump (its pack write then reports
    the full disk)."""
    from ckpt.criu import images
    from ckpt.errors import ImageUnreadable

    (tmp_path / "stats-dump").write_bytes(b"")
    assert images.dump_stats(tmp_path) == {}
    (tmp_path / "pstree.img").write_bytes(b"\x01\x02")
    with pytest.raises(ImageUnreadable, match="pstree.img is truncated or unreadable"):
        images.process_tree(tmp_path)


@pytest.mark.parametrize("line", [
    "Error (criu/namespaces.c:1117): Can't dump a pid namespace without the process init",
    "Error (criu/namespaces.c:460): Can't dump nested time namespace for 25977",
])
def test_a_tree_restored_into_its_own_pid_namespace_says_why_it_cannot_be_dumped(tmp_path, line):
    """The two errors CRIU 4.2 gives for a tree restored with --new-pidns (dumping a process of
    it, or its ckpt-pidns-init), as seen by hand: a bare "Dumping FAILED" said nothing."""
    error = failure(tmp_path, "dump", line, "Error (criu/cr-dump.c:1975): Dumping FAILED.")
    assert isinstance(error, CriuFailed)
    assert "--new-pidns" in error.hint and "restore it without" in error.hint
