"""The pieces a userfaultfd fill copies a run of pages in (ckpt/restore/uffdfill.py): pages
of one location that follow each other (a JVM's touched heap: the page of zeros, again and
again) make one piece, never across a mapping's bound."""
import numpy as np

from ckpt.restore.uffdfill import _merged_repeats


def test_single_pages_of_one_location_are_one_piece_but_not_across_a_mapping():
    here = np.array([10, 11, 12, 5, 5, 5, 5, 7, 5, 5, 20, 21], dtype=np.int64)
    cut = np.arange(1, len(here))[np.diff(here) != 1]
    starts = np.unique(np.concatenate(([0], cut, [5], [len(here)])))
    assert _merged_repeats(starts, here, {5}) == [
        (0, 3, False), (3, 5, True), (5, 7, True), (7, 8, False), (8, 10, True), (10, 12, False)]


def test_a_lone_page_stays_a_plain_piece():
    here = np.array([3, 9, 4], dtype=np.int64)
    starts = np.array([0, 1, 2, 3])
    assert _merged_repeats(starts, here, set()) == [(0, 1, False), (1, 2, False), (2, 3, False)]


def test_a_short_run_is_cut_page_by_page_into_the_same_pieces_as_a_long_one():
    """run_pieces cuts runs of up to SHORT_RUN pages in Python, longer ones with numpy: the
    same pieces either way (random runs: consecutive, repeated and scattered locations, with
    mapping bounds inside and around them)."""
    import random

    from ckpt.restore import uffdfill

    rng = random.Random(5)
    for _ in range(3000):
        count = rng.randint(1, uffdfill.SHORT_RUN)
        vaddr = rng.randrange(16, 1 << 20) * 4096
        here, location = [], rng.randrange(1000)
        for _ in range(count):
            draw = rng.random()
            location = location + 1 if draw < 0.5 else location if draw < 0.7 else rng.randrange(1000)
            here.append(location)
        bounds = sorted(rng.sample(range(vaddr - 8 * 4096, vaddr + (count + 8) * 4096, 4096), rng.randint(0, 6)))
        short = uffdfill.run_pieces(vaddr, here, bounds)
        uffdfill.SHORT_RUN, saved = 0, uffdfill.SHORT_RUN
        try:
            long = uffdfill.run_pieces(vaddr, here, bounds)
        finally:
            uffdfill.SHORT_RUN = saved
        assert short == [(int(begin), int(end), repeated) for begin, end, repeated in long], (here, bounds, vaddr)
        # And as cut by hand: at every break of consecutive locations and every bound inside.
        located, edges = np.asarray(here, dtype=np.int64), np.array(bounds, dtype=np.int64)
        at_bound = (edges[(edges > vaddr) & (edges < vaddr + count * 4096)] - vaddr) // 4096
        starts = np.unique(np.concatenate(([0], np.arange(1, count)[np.diff(located) != 1], at_bound, [count])))
        assert short == _merged_repeats(starts, located, set(at_bound.tolist())), (here, bounds, vaddr)
