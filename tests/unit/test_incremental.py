"""The pure logic of dirty-page tracking: when a parent may be trusted, and flattening."""

from pathlib import Path

import pytest

from ckpt.criu.images import PE_PARENT, PE_PRESENT
from ckpt.dump.incremental import TargetIdentity, TrackingLog, choose_parent, flatten_runs, parent_page_ids
from ckpt.errors import DamagedCheckpoint

TARGET = TargetIdentity("boot-1", 4242, 1000)
STORE = Path("/var/lib/ckpt")


def page_id(n: int) -> bytes:
    return n.to_bytes(16, "little")


def test_parent_is_the_last_committed_attempt_on_the_same_process():
    last = {"store": str(STORE), "checkpoint": "A"}
    assert choose_parent(last, STORE, TARGET, {"target": TARGET.key}) == "A"


@pytest.mark.parametrize("last, parent_tracking, why", [
    (None, {"target": TARGET.key}, "never tracked"),
    ({"store": "/elsewhere", "checkpoint": "A"}, {"target": TARGET.key}, "another store cleared the bits"),
    ({"store": str(STORE), "checkpoint": "A"}, None, "the last attempt never committed, or was removed"),
    ({"store": str(STORE), "checkpoint": "A"}, {"target": "boot-1-4242-999"}, "another process with that PID"),
    ({"store": str(STORE), "checkpoint": "A"}, {"target": "boot-2-4242-1000"}, "another boot"),
])
def test_no_parent_when_the_soft_dirty_bits_cannot_be_trusted(last, parent_tracking, why):
    assert choose_parent(last, STORE, TARGET, parent_tracking) is None, why


def test_tracking_log_keeps_the_last_attempt(tmp_path):
    log = TrackingLog(tmp_path / "tracking")
    assert log.last_attempt(TARGET) is None
    log.record_attempt(TARGET, STORE, "A")
    log.record_attempt(TARGET, STORE, "B")
    assert log.last_attempt(TARGET) == {"store": str(STORE), "checkpoint": "B"}
    assert (tmp_path / "tracking").stat().st_mode & 0o077 == 0


def test_flatten_takes_unchanged_pages_from_the_parent_in_pagemap_order():
    parent_runs = [(0x1000, 3, PE_PRESENT), (0x9000, 1, PE_PRESENT)]
    parent = parent_page_ids(parent_runs, page_id(1) + page_id(2) + page_id(3) + page_id(4))
    # The new dump: page 0x2000 was written (present), 0x1000 and 0x3000 and 0x9000 were not.
    runs = [(0x1000, 1, PE_PARENT), (0x2000, 1, PE_PRESENT), (0x3000, 1, PE_PARENT), (0x9000, 1, PE_PARENT)]
    flat, page_list, from_parent = flatten_runs(runs, page_id(20), parent, "pagemap-1.img")
    assert flat == [(0x1000, 1, PE_PRESENT), (0x2000, 1, PE_PRESENT), (0x3000, 1, PE_PRESENT),
                    (0x9000, 1, PE_PRESENT)]
    assert page_list == page_id(1) + page_id(20) + page_id(3) + page_id(4)
    assert from_parent == 3


def test_flatten_refuses_a_page_the_parent_lacks():
    with pytest.raises(DamagedCheckpoint, match="does not hold it"):
        flatten_runs([(0x5000, 1, PE_PARENT)], b"", parent_page_ids([(0x1000, 1, PE_PRESENT)], page_id(1)),
                     "pagemap-1.img")


def test_flatten_refuses_a_pages_image_that_does_not_match_its_pagemap():
    with pytest.raises(DamagedCheckpoint):
        flatten_runs([(0x1000, 2, PE_PRESENT)], page_id(1), {}, "pagemap-1.img")
    with pytest.raises(DamagedCheckpoint):
        flatten_runs([(0x1000, 1, PE_PRESENT)], page_id(1) + page_id(2), {}, "pagemap-1.img")
