from datetime import datetime, timezone

import pytest

from ckpt.errors import InvalidReference
from ckpt.store import ids


def test_new_ids_are_valid_unique_and_sort_by_time():
    early = ids.new_id(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    late = ids.new_id(datetime(2026, 11, 30, 23, 0, 0, tzinfo=timezone.utc))
    assert early.startswith("20260102-030405-") and ids.is_id(early)
    assert early < late
    # 24 random bits after the millisecond: distinct in practice, not by construction (the
    # store refuses to commit a second checkpoint under an existing ID: see test_store).
    assert len({ids.new_id() for _ in range(20)}) > 1


@pytest.mark.parametrize("ref,kind", [
    ("latest", "latest"),
    ("20261130-230102-123-3fa9c1", "id"),
    ("20261130-23", "prefix"),
    ("20261130-230102-1", "prefix"),
    ("agent", "name"),
    ("my-agent.v2_1", "name"),
])
def test_classify_reference(ref, kind):
    assert ids.classify_reference(ref) == kind


@pytest.mark.parametrize("bad", ["../x", "..", "a/b", "/etc/passwd", "", ".hidden", "x" * 65, "a b", "-rf"])
def test_unsafe_references_are_refused(bad):
    with pytest.raises(InvalidReference):
        ids.classify_reference(bad)
    with pytest.raises(InvalidReference):
        ids.check_id(bad)


@pytest.mark.parametrize("bad", ["../x", "1abc", "", "a/b", "x" * 65])
def test_invalid_names(bad):
    with pytest.raises(InvalidReference):
        ids.check_name(bad)


def test_text_from_other_programs_prints_on_one_line_without_escapes():
    from ckpt.system.textutil import printable

    assert printable("python3 agent.py") == "python3 agent.py"
    assert printable("-c import time\ntime.sleep(1)") == "-c import time\\ntime.sleep(1)"
    assert printable("\x1b[31mred") == "\\x1b[31mred"
