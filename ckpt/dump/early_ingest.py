"""A dump's images stored while CRIU still dumps the rest of the tree.

Why: CRIU dumps a tree one process after the other, and each process's images are whole once
CRIU closes them. A dump that ends its tree (--stop) commits while the tree is frozen, so its
time is CRIU's plus the ingest's: for 1 + 100 Python processes, 1.5 s of CRIU and then 1.4-2 s
of hashing, looking up and writing pages, and 0.4 s making some 300 small objects durable one
by one. Stored as each image is closed, on the core CRIU leaves free, most of that overlaps
CRIU. Only for dumps that end their tree: for a dump that lets the tree run on, the freeze is
what counts, and the ingest would take CPU from CRIU while the tree is frozen.

Safe by construction: an image is stored only after inotify says CRIU closed it (CRIU writes
each image once, from open to close), and its identity (inode, size, modification time) is
taken again once CRIU is done; if any differs or is gone, or the early ingest failed at all,
its pack is dropped and the ingest starts over from the images as they are (the result is the
same; only slower): the staging area keeps every image (objects are stored from hard links,
or from copies where the object would be the file itself, stored as it is: see IngestAhead).
Images it never got to are stored after CRIU, as before. Killed midway, what it wrote is a
pack without an index file and objects nobody names: prune reclaims both, as after any ingest
that was cut short.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ckpt.store.ingest import IngestAhead
from ckpt.store.objects import Objects
from ckpt.system.inotify import ClosedFiles

WAIT_S = 1.0  # between looks at the stop signal, were it missed (it is not: also watched)


def _identity(path: Path) -> tuple[int, int, int]:
    """What a write to the file, or a new file under its name, changes (not the change time:
    the hard link IngestAhead makes, and the mode its store sets, change that)."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class EarlyIngest:
    """Made before CRIU starts (the watch must see every close); start() once the store's
    index is loading; take() once CRIU has dumped the tree, for what it stored; close() on
    the way out of anything (it drops an ingest nobody took). scratch: a directory of the
    staging area's own, outside its images (made here)."""

    def __init__(self, images_dir: Path, objects: Objects, codec: str, scratch: Path):
        self.images_dir, self.objects, self.codec, self.scratch = images_dir, objects, codec, scratch
        self._closed = ClosedFiles(images_dir)
        try:
            self._stop_read, self._stop_write = os.pipe2(os.O_CLOEXEC)
        except OSError:
            self._closed.close()
            raise
        self._thread: threading.Thread | None = None
        # Owned here to the end: close() aborts it whatever happened (after a commit, that
        # does nothing), so a failure between take() and the ingest leaves no pack half-written.
        self._run: IngestAhead | None = None
        self._identities: dict[str, tuple[int, int, int]] = {}
        self._failed: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="ckpt-early-ingest", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            self._run = IngestAhead(self.objects, self.codec, self.scratch)
            stopping = False
            while not stopping:
                names = self._closed.wait(WAIT_S, self._stop_read)
                stopping = _signalled(self._stop_read)
                if stopping:
                    names += self._closed.read()  # every close before the stop: CRIU is done
                # Each image's identity before it is read; the batch at once, so that the
                # pages images in it are looked up while the one before is stored.
                before = {name: _identity(self.images_dir / name) for name in names
                          if name not in self._identities}
                self._run.add_all([self.images_dir / name for name in before])
                self._identities.update(before)
        except BaseException as exc:  # noqa: BLE001 - take() drops the run; the ingest starts over
            self._failed = exc

    def take(self) -> IngestAhead | None:
        """Once CRIU has written every image: what was stored, every image of it still as it
        was when it was read, every object durable; or None (nothing taken, or anything changed
        or went wrong: the caller ingests every image itself). What it returns stays this
        object's to abort in close(), unless committed by then."""
        self._stop()
        run = self._run
        if run is None:
            return None
        try:
            if self._failed is None:
                run.settle()
            # (Modification times tick coarsely: a rewrite of the same size within one tick
            # would pass. CRIU writes each image once; this is the guard against that changing.)
            unchanged = self._failed is None and all(
                _identity(self.images_dir / name) == identity for name, identity in self._identities.items())
        except Exception:  # noqa: BLE001 - an object not stored, an image gone: all of it again
            unchanged = False
        except BaseException:
            self._drop()
            raise
        if not unchanged:
            self._drop()
            return None
        return run

    def close(self) -> None:
        try:
            self._stop()
            self._drop()
        finally:
            self._closed.close()
            for fd in (self._stop_read, self._stop_write):
                if fd >= 0:
                    os.close(fd)
            self._stop_read = self._stop_write = -1

    def _drop(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.abort()

    def _stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_write, b"x")
            self._thread.join()
            self._thread = None


def _signalled(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])
