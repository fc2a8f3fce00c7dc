"""Files closed after writing, in one directory, as Linux's inotify tells them (IN_CLOSE_WRITE).

The standard library has no inotify; libc's three calls through ctypes are all it takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
from pathlib import Path

IN_CLOSE_WRITE = 0x00000008
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name

_libc = None


def _lib():
    global _libc  # noqa: PLW0603 - loaded once, on first use
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


class ClosedFiles:
    """Names of files in `directory` closed after being written, in the order they were.
    Events come from the moment the watch is made (made here): files closed before are not
    named. Close it (or use it as a context manager) to free the descriptor."""

    def __init__(self, directory: Path):
        libc = _lib()
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_CLOSE_WRITE) < 0:
            errno = ctypes.get_errno()
            os.close(self.fd)
            self.fd = -1
            raise OSError(errno, os.strerror(errno), str(directory))
        self._pending = b""

    def wait(self, timeout: float, also: int = -1) -> list[str]:
        """The names closed since the last call, waiting up to timeout seconds for one (or
        for the descriptor `also` to become readable: a caller's stop signal)."""
        watched = [self.fd] + ([also] if also >= 0 else [])
        readable, _, _ = select.select(watched, [], [], timeout)
        if self.fd not in readable:
            return []
        return self.read()

    def read(self) -> list[str]:
        """The names closed since the last call, without waiting."""
        names = []
        while True:
            try:
                chunk = os.read(self.fd, 64 << 10)
            except BlockingIOError:
                break
            data, at = self._pending + chunk, 0
            while at + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                if at + _EVENT.size + length > len(data):
                    break
                name = data[at + _EVENT.size:at + _EVENT.size + length].rstrip(b"\0")
                if mask & IN_CLOSE_WRITE and name:
                    names.append(os.fsdecode(name))
                at += _EVENT.size + length
            self._pending = data[at:]
        return names

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ClosedFiles:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
