"""Which section markers count for a dump (ckpt/agent/sections.py), without CRIU: a marker is
void once its process or its owner (the `ckpt run` that answered BEGIN) is gone, whatever
remains at its PID; void markers are removed. The real thing: tests/integration/test_agent_sections.py
and test_agent_socket.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from ckpt.agent import sections


@pytest.fixture
def sleeper():
    """A process of our own (ended by PID at teardown)."""
    proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def rewrite(marker, index: int, value: str) -> None:
    words = marker.read_text().split()
    words[index] = value
    marker.write_text(" ".join(words) + "\n")


def test_a_section_counts_while_its_owner_runs_and_is_void_once_the_owner_is_killed(tmp_path, sleeper):
    """kill -9 of the supervisor that held a BEGIN for a process: that process's dumps go on."""
    me = os.getpid()
    supervisor = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        marker = sections.create_marker(sleeper.pid, sleeper.pid, tmp_path, owner=supervisor.pid)
        assert sections.open_sections({sleeper.pid, me}, tmp_path) == [sleeper.pid]
    finally:
        supervisor.kill()
        supervisor.wait(timeout=10)
    assert sections.open_sections({sleeper.pid, me}, tmp_path) == []
    assert not marker.exists()


def test_an_owner_pid_now_another_process_is_gone(tmp_path, sleeper):
    marker = sections.create_marker(sleeper.pid, sleeper.pid, tmp_path, owner=os.getpid())
    assert sections.open_sections({sleeper.pid}, tmp_path) == [sleeper.pid]
    rewrite(marker, 3, "1")  # the owner's PID runs, with another start time: reused
    assert sections.open_sections({sleeper.pid}, tmp_path) == []
    assert not marker.exists()


def test_a_void_marker_of_a_process_outside_the_tree_is_removed_too(tmp_path, sleeper):
    """The issue's leftover: a marker of a long-lived process (PID 1) whose supervisor was killed."""
    supervisor = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    marker = sections.create_marker(1, 1, tmp_path, owner=supervisor.pid)
    supervisor.kill()
    supervisor.wait(timeout=10)
    assert sections.open_sections({sleeper.pid}, tmp_path) == []
    assert not marker.exists()
    assert sections.open_sections({1}, tmp_path) == []


def test_a_marker_of_another_boot_is_void(tmp_path):
    me = os.getpid()
    marker = sections.create_marker(me, me, tmp_path)
    assert sections.open_sections({me}, tmp_path) == [me]
    rewrite(marker, 1, "another-boot")
    assert sections.open_sections({me}, tmp_path) == []


def test_own_sections_and_markers_of_the_old_format_still_count(tmp_path):
    me = os.getpid()
    with sections.no_checkpoint(tmp_path):
        assert sections.open_sections({me}, tmp_path) == [me]
    assert sections.open_sections({me}, tmp_path) == []
    old = tmp_path / f"{me}.{me}.0000abcd"
    old.write_text(f"{sections._start_ticks(me)}\n")  # start time only: written before owners were recorded
    assert sections.open_sections({me}, tmp_path) == [me]


def test_an_empty_marker_counts_while_new_and_is_void_when_old(tmp_path):
    me = os.getpid()
    marker = tmp_path / f"{me}.{me}.0000abcd"
    marker.touch()
    assert sections.open_sections({me}, tmp_path) == [me]  # being written
    old = os.stat(marker).st_mtime - sections.EMPTY_MARKER_S - 1
    os.utime(marker, (old, old))
    assert sections.open_sections({me}, tmp_path) == []
    assert not marker.exists()


def test_a_section_for_a_gone_process_or_owner_is_not_made(tmp_path, sleeper):
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        sections.create_marker(sleeper.pid, sleeper.pid, tmp_path, owner=gone.pid)
    with pytest.raises(ProcessLookupError):
        sections.create_marker(gone.pid, gone.pid, tmp_path, owner=os.getpid())
    assert list(tmp_path.iterdir()) == []
