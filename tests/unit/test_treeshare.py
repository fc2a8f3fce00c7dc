"""The pure parts of laying a tree's shared pages out once (ckpt/restore/treeshare.py)."""

import numpy as np

from ckpt.criu.images import PE_LAZY, PE_PARENT, PE_PRESENT
from ckpt.restore.treeshare import _marked_runs, _ranges
from ckpt.store.blocks.byaddress import PagesByAddress

PAGE = 4096


def test_runs_are_split_where_pages_turn_from_own_to_the_roots():
    runs = [(0x1000, 4, PE_PRESENT | PE_LAZY), (0x10000, 2, PE_PRESENT)]
    same = np.array([False, True, True, False, True, True])
    assert _marked_runs(runs, same) == [
        (0x1000, 1, PE_PRESENT | PE_LAZY),
        (0x2000, 2, PE_PARENT),  # no page of the pages image (not present), not left to userfaultfd
        (0x4000, 1, PE_PRESENT | PE_LAZY),
        (0x10000, 2, PE_PARENT),
    ]


def test_the_ranges_left_out_are_the_runs_of_shared_rows():
    assert _ranges(np.array([True, True, False, True, False, False, True])) == [(0, 2), (3, 1), (6, 1)]
    assert _ranges(np.array([False, False])) == []


def test_a_page_is_shared_only_at_the_same_address_with_the_same_id():
    # The root's image: pages at 3 * PAGE (id 3), then PAGE and 2 * PAGE (ids 1, 2).
    root = PagesByAddress.from_runs([(3 * PAGE, 1), (PAGE, 2)],
                                    np.array([[3, 3], [1, 1], [2, 2]], dtype=np.uint64).tobytes())
    assert root is not None
    child = np.array([PAGE, 2 * PAGE, 5 * PAGE, 3 * PAGE], dtype=np.uint64)
    ids = np.array([[1, 1], [2, 9], [3, 3], [3, 3]], dtype=np.uint64)
    # same page / other content / an address the root has no page at (its id elsewhere) / same
    assert root.same(child, ids).tolist() == [True, False, False, True]


def test_only_addresses_inside_the_mappings_count():
    from ckpt.restore.treeshare import _inside

    addresses = np.array([0x1000, 0x2000, 0x5000, 0x9000], dtype=np.uint64)
    assert _inside(addresses, [(0x2000, 0x3000), (0x5000, 0x6000)]).tolist() == [False, True, True, False]
    assert _inside(addresses, []).tolist() == [False] * 4


def test_runs_are_marked_as_page_by_page_marking_would():
    """_marked_runs against a page-by-page reference: random runs (some empty) and marks."""
    import random

    rng = random.Random(7)
    for _ in range(500):
        runs, vaddr = [], 0x10000
        for _ in range(rng.randint(1, 12)):
            vaddr += rng.randint(0, 4) * PAGE
            n = rng.choice([0, 1, 1, 2, 3, 5, 9])
            runs.append((vaddr, n, PE_PRESENT | (PE_LAZY if rng.random() < 0.5 else 0)))
            vaddr += n * PAGE
        rows = sum(n for _, n, _ in runs)
        same = np.array([rng.random() < 0.5 for _ in range(rows)], dtype=bool)
        expected, row = [], 0
        for start, n, flags in runs:
            if not n:
                expected.append((start, n, flags))
            for page in range(n):
                mark = (flags & ~(PE_PRESENT | PE_LAZY)) | PE_PARENT if same[row] else flags
                last = expected[-1] if expected and page else None
                if last is not None and last[2] == mark and last[0] + last[1] * PAGE == start + page * PAGE:
                    expected[-1] = (last[0], last[1] + 1, mark)
                else:
                    expected.append((start + page * PAGE, 1, mark))
                row += 1
        assert _marked_runs(runs, same) == expected, (runs, same)
