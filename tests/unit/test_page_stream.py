"""The receiving end of CRIU's page-server protocol (ckpt/dump/pagestream.py), driven by this
test playing CRIU's side byte for byte as criu/page-xfer.c writes it. The real CRIU streams
in tests/integration/test_page_stream.py."""

from __future__ import annotations

import os
import socket
import struct

import numpy as np
import pytest

from ckpt.criu.images import PE_LAZY, PE_PARENT, PE_PRESENT, read_pagemap
from ckpt.dump.pagestream import BATCH_PAGES, PageStream
from ckpt.store.blocks.byaddress import PagesByAddress
from ckpt.errors import PageStreamFailed
from ckpt.store.blocks.blockstore import page_ids

SEED = 1234
PAGE = 4096
COMMAND = struct.Struct("<I4xQQQ")
OPEN2, ADD_F, FORCE_CLOSE = 4, 6, 0x1024
VADDR = 0x7F0000000000


def pages(count: int, first: int = 0) -> bytes:
    return b"".join(bytes([(first + i) % 251]) * PAGE for i in range(count))


class Criu:
    """CRIU's end of the socket."""

    def __init__(self, stream: PageStream):
        fd = stream.start()
        self.sock = socket.socket(fileno=os.dup(fd))
        stream.criu_started()

    def open(self, pid: int) -> bytes:
        self.sock.sendall(COMMAND.pack(OPEN2, 0, 0, pid << 8 | 1))
        return self.sock.recv(1)

    def add(self, vaddr: int, data: bytes, flags: int = PE_PRESENT) -> None:
        self.sock.sendall(COMMAND.pack(flags << 16 | ADD_F, len(data) // PAGE if data else 1, vaddr, 0))
        self.sock.sendall(data)

    def close(self) -> bytes:
        self.sock.sendall(COMMAND.pack(FORCE_CLOSE, 0, 0, 0))
        return self.sock.recv(4)


def test_every_page_is_named_and_kept_without_an_earlier_checkpoint(tmp_path):
    stream = PageStream(tmp_path / "images", tmp_path / "kept", SEED, {})
    (tmp_path / "images").mkdir()
    criu = Criu(stream)
    assert criu.open(42) == b"\0"  # no parent: CRIU sends every page
    first, second = pages(3), pages(2, 7)
    criu.add(VADDR, first)
    criu.add(VADDR + 0x10000, b"", flags=PE_PARENT)  # an entry without data
    criu.add(VADDR + 0x20000, second, flags=PE_PRESENT | PE_LAZY)
    assert criu.open(43) == b"\0"
    assert criu.close() == struct.pack("<i", 0)
    streamed = stream.finish()

    image = streamed["pages-1.img"]
    assert image.page_list == page_ids(first + second, SEED)
    assert image.rows.tolist() == [0, 1, 2, 3, 4]
    assert image.path.read_bytes() == first + second
    assert read_pagemap(tmp_path / "images" / "pagemap-42.img") == (
        1, [(VADDR, 3, PE_PRESENT), (VADDR + 0x10000, 1, PE_PARENT), (VADDR + 0x20000, 2, PE_PRESENT | PE_LAZY)])
    assert streamed["pages-2.img"].page_list == b""
    assert read_pagemap(tmp_path / "images" / "pagemap-43.img") == (2, [])
    assert os.stat(image.path).st_mode & 0o777 == 0o600


def test_only_pages_that_changed_at_their_address_are_kept(tmp_path):
    before = pages(BATCH_PAGES + 10)  # more than one batch: the comparison spans two
    after = bytearray(before)
    for changed in (1, BATCH_PAGES + 3):
        after[changed * PAGE] ^= 0xFF
    # The earlier checkpoint held the same addresses, in two runs listed out of address order.
    earlier_ids = page_ids(before, SEED)
    half = 5000
    earlier = PagesByAddress.from_runs([(VADDR + half * PAGE, BATCH_PAGES + 10 - half), (VADDR, half)],
                                     earlier_ids[half * 16:] + earlier_ids[:half * 16])
    stream = PageStream(tmp_path, tmp_path / "kept", SEED, {"pagemap-7.img": earlier})
    criu = Criu(stream)
    criu.open(7)
    criu.add(VADDR, bytes(after))
    criu.add(VADDR + (BATCH_PAGES + 100) * PAGE, pages(1, 3))  # an address the earlier one lacked
    criu.close()
    image = stream.finish()["pages-1.img"]

    assert image.rows.tolist() == [1, BATCH_PAGES + 3, BATCH_PAGES + 10]
    assert image.path.read_bytes() == (after[PAGE:2 * PAGE] + after[(BATCH_PAGES + 3) * PAGE:(BATCH_PAGES + 4) * PAGE]
                                       + pages(1, 3))
    assert image.page_list == page_ids(bytes(after) + pages(1, 3), SEED)
    assert stream.received_pages == BATCH_PAGES + 11 and stream.kept_pages == 3


def test_an_earlier_page_list_that_does_not_fit_its_pagemap_is_not_used():
    assert PagesByAddress.from_runs([(VADDR, 3)], b"\0" * 32) is None


def test_an_unknown_command_fails_the_stream_and_cuts_criu_off(tmp_path):
    stream = PageStream(tmp_path, tmp_path / "kept", SEED, {})
    criu = Criu(stream)
    criu.open(1)
    criu.sock.sendall(COMMAND.pack(99, 0, 0, 0))
    criu.sock.settimeout(10)
    assert criu.sock.recv(1) == b""  # CRIU's next read ends: its dump fails, the tree runs on
    with pytest.raises(PageStreamFailed, match="unknown page-server command 99"):
        stream.finish()


def test_a_stream_cut_midway_is_criu_s_failure_not_the_receiver_s(tmp_path):
    stream = PageStream(tmp_path, tmp_path / "kept", SEED, {})
    criu = Criu(stream)
    criu.open(1)
    criu.sock.sendall(COMMAND.pack(PE_PRESENT << 16 | ADD_F, 4, VADDR, 0) + pages(1))
    criu.sock.close()  # CRIU died two pages short
    assert stream.failure() is None  # CRIU's own error explains the dump's failure
    with pytest.raises(PageStreamFailed, match="closed the stream midway"):
        stream.finish()


def test_a_full_disk_while_keeping_pages_is_said_as_such(tmp_path, monkeypatch):
    import errno

    from ckpt.dump import pagestream
    from ckpt.errors import DiskFull

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pagestream.os, "write", full)
    # Mid-stream: the first batch fails while CRIU still sends; CRIU is cut off.
    stream = PageStream(tmp_path, tmp_path / "kept", SEED, {})
    criu = Criu(stream)
    criu.open(1)
    criu.sock.settimeout(10)
    with pytest.raises(OSError):  # (a reset, or a closed socket, as CRIU sees it)
        criu.add(VADDR, pages(3 * BATCH_PAGES))
        criu.close()
        assert criu.sock.recv(4) == b""
        raise OSError("cut off")
    assert isinstance(stream.failure(), DiskFull)
    with pytest.raises(DiskFull, match="no space left"):
        stream.finish()
    np.testing.assert_equal(stream.kept_pages, 0)

    # The last batch is stored while CRIU gets its answer (and lets the tree run): whether the
    # failure comes before the answer (CRIU is cut off) or after, finish() fails, so that
    # nothing is committed.
    stream = PageStream(tmp_path, tmp_path / "kept2", SEED, {})
    criu = Criu(stream)
    criu.open(1)
    criu.add(VADDR, pages(2))
    assert criu.close() in (struct.pack("<i", 0), b"")
    with pytest.raises(DiskFull):
        stream.finish()


def test_pagemaps_are_written_byte_for_byte_as_pycriu_writes_them(tmp_path):
    import io
    import random

    from pycriu import images

    from ckpt.criu.images import write_pagemap

    rng = random.Random(3)
    runs = [(rng.randrange(0, 1 << 47, PAGE), rng.randint(1, 1 << 20), rng.choice([1, 2, 4, 6]))
            for _ in range(500)]
    expected = io.BytesIO()
    images.dump({"magic": "PAGEMAP", "entries": [{"pages_id": 300}] + [
        {"vaddr": vaddr, "compat_nr_pages": 0, "flags": flags, "nr_pages": nr_pages}
        for vaddr, nr_pages, flags in runs]}, expected)
    write_pagemap(tmp_path / "pagemap-1.img", 300, runs)
    assert (tmp_path / "pagemap-1.img").read_bytes() == expected.getvalue()
    assert read_pagemap(tmp_path / "pagemap-1.img") == (300, runs)


def test_a_pagemap_is_parsed_once_until_it_changes(tmp_path, monkeypatch):
    """read_pagemap remembers what it parsed (a restore's plans read each pagemap of a tree up
    to four times) and what write_pagemap wrote; a file replaced by any other means (another
    inode, size or time) is parsed again, and the runs kept stay bounded."""
    import shutil

    from ckpt.criu import images

    parsed: list[str] = []
    real = images._parse_pagemap
    monkeypatch.setattr(images, "_parse_pagemap", lambda path: (parsed.append(path.name), real(path))[1])
    monkeypatch.setattr(images, "_PAGEMAPS", images._ReadPagemaps())
    first, second = [(0x10000, 3, PE_PRESENT)], [(0x20000, 1, PE_PRESENT | PE_LAZY), (0x30000, 2, PE_PARENT)]
    path = tmp_path / "pagemap-1.img"
    images.write_pagemap(path, 7, first)
    assert read_pagemap(path) == (7, first) and read_pagemap(path) == (7, first)
    assert parsed == []  # what write_pagemap wrote is known
    read_pagemap(path)[1].append((0, 0, 0))  # a caller's list is its own
    assert read_pagemap(path) == (7, first)
    other = tmp_path / "other" / "pagemap-1.img"
    other.parent.mkdir()
    images.write_pagemap(other, 8, second)
    shutil.copyfile(other, tmp_path / "copy.img")
    (tmp_path / "copy.img").replace(path)  # replaced behind write_pagemap's back
    assert read_pagemap(path) == (8, second) and parsed == ["pagemap-1.img"]
    monkeypatch.setattr(images._ReadPagemaps, "KEPT_RUNS", 3)
    kept = images._ReadPagemaps()
    kept.put(path, 8, second)
    kept.put(other, 8, second)  # 4 runs: the first is forgotten
    assert kept.get(path) is None and kept.get(other) == (8, second)
