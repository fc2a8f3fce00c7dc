"""Logs a tree also reads (ckpt/system/procs.py, logs_read_back): a restore refuses them once
they grow, so the dump warns of them up front. Found in this test's own process."""

import ctypes
import mmap
import os

from ckpt.system import procs


def test_a_log_is_named_only_where_the_tree_also_reads_it(tmp_path):
    paths = {name: tmp_path / f"{name}.log" for name in ("only", "back", "both", "mapped", "data")}
    for path in paths.values():
        path.write_bytes(b"x" * 4096)
    fds = [os.open(paths["only"], os.O_WRONLY | os.O_APPEND),  # a log the tree only writes: fine
           os.open(paths["back"], os.O_WRONLY | os.O_APPEND), os.open(paths["back"], os.O_RDONLY),
           os.open(paths["both"], os.O_RDWR | os.O_APPEND),  # Python's "a+"
           os.open(paths["mapped"], os.O_WRONLY | os.O_APPEND),
           os.open(paths["data"], os.O_RDWR)]  # read and written, but not as a log: no O_APPEND, not stdout
    # Mapped through libc, the descriptor closed: Python's mmap would keep a descriptor of its own.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    map_fd = os.open(paths["mapped"], os.O_RDONLY)
    address = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE, map_fd, 0)
    os.close(map_fd)
    try:
        found = {f["path"]: f for f in procs.logs_read_back([os.getpid()])}
    finally:
        libc.munmap(address, 4096)
        for fd in fds:
            os.close(fd)
    me = os.getpid()
    assert sorted(found) == sorted(str(paths[name]) for name in ("back", "both", "mapped"))
    assert found[str(paths["back"])] == {"pid": me, "fd": fds[1], "path": str(paths["back"]),
                                         "how": f"PID {me} holds it open read-only, fd {fds[2]}"}
    assert found[str(paths["both"])]["how"] == f"PID {me} opened it for reading and writing, fd {fds[3]}"
    assert found[str(paths["mapped"])]["how"] == f"PID {me} maps it"
