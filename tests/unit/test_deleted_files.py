"""Deleted files a tree holds (CRIU's "ghost files"), and how large CRIU is told they may be."""

import ctypes
import mmap
import os

import pytest

from ckpt.commands import dump as checkpoint
from ckpt.errors import TargetRefused
from ckpt.system import procs


def test_deleted_files_held_open_or_mapped_are_found_once(tmp_path):
    opened = tmp_path / "opened.tmp"
    opened.write_bytes(b"x" * 5000)
    mapped = tmp_path / "mapped.tmp"
    mapped.write_bytes(b"y" * 8192)
    fd = os.open(opened, os.O_RDONLY)
    # Mapped through libc, the descriptor closed: Python's mmap would keep a descriptor of its own.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    map_fd = os.open(mapped, os.O_RDONLY)
    address = libc.mmap(None, 8192, mmap.PROT_READ, mmap.MAP_PRIVATE, map_fd, 0)
    os.close(map_fd)
    twice = os.open(opened, os.O_RDONLY)  # the same file twice: one entry
    memfd = os.memfd_create("scratch")  # shows as "/memfd:scratch (deleted)": not a ghost file
    shared = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)  # shows as "/dev/zero (deleted)"
    try:
        opened.unlink()
        mapped.unlink()
        found = [f for f in procs.deleted_files([os.getpid()]) if f["path"].startswith(str(tmp_path))]
        assert found == [{"pid": os.getpid(), "fd": fd, "path": str(opened), "size": 5000},
                         {"pid": os.getpid(), "fd": None, "path": str(mapped), "size": 8192}]
        assert not [f for f in procs.deleted_files([os.getpid()]) if f["path"].startswith(("/memfd:", "/dev/zero"))]
    finally:
        for descriptor in (fd, twice, memfd):
            os.close(descriptor)
        libc.munmap(address, 8192)
        shared.close()


def facts(*sizes: int) -> procs.TargetFacts:
    return procs.TargetFacts(pid=10, command="agent", pids=[10], needs_shell_job=False, has_tcp_established=False,
                             has_file_locks=False, deleted_files=[{"pid": 10, "fd": 3 + k, "path": f"/tmp/#{k}",
                                                                   "size": size} for k, size in enumerate(sizes)])


@pytest.mark.parametrize("sizes,limit", [
    ((), None),  # nothing deleted
    ((1 << 20,), None),  # CRIU's own limit will do
    ((4 << 20, 100), 8 << 20),  # twice the largest: it may grow while CRIU works
    (((3 << 20) + 1,), 7 << 20),  # in whole MiB, rounded up
    ((3 << 30,), (1 << 32) - 1),  # at most what the RPC field holds
])
def test_ghost_limit(sizes, limit):
    assert checkpoint._ghost_limit(facts(*sizes)) == limit


def test_a_deleted_file_over_4_gib_is_refused_with_the_fix():
    with pytest.raises(TargetRefused, match=r"PID 10 holds a deleted file of 5.0 GiB \(/tmp/#1\)") as refused:
        checkpoint._ghost_limit(facts(100, 5 << 30))
    assert "close" in refused.value.hint
