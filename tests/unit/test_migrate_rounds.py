"""The pre-copy's stop rule (docs/design.md, "Migration: Phases"), as a table."""

import pytest

from ckpt.commands.migrate import PrecopyRound, precopy_done


def rounds(*new_pages: int) -> list[PrecopyRound]:
    return [PrecopyRound(i + 1, f"c{i}", 262144, n, n * 4096, 10.0, 100.0) for i, n in enumerate(new_pages)]


@pytest.mark.parametrize("sent,limit,done", [
    ((), 4, False),  # nothing sent yet
    ((), 0, True),  # --rounds 0: the final dump alone
    ((262144,), 4, False),  # the first round sent everything: go on
    ((262144,), 1, True),  # the limit
    ((262144, 5000), 4, False),  # shrinking fast
    ((262144, 5000, 4000), 4, False),  # by more than a tenth
    ((262144, 5000, 4600), 4, True),  # by less than a tenth: stopped shrinking
    ((262144, 5000, 6000), 4, True),  # growing
    ((262144, 64), 4, True),  # down to the floor
    ((262144, 2621), 4, True),  # down to a hundredth of the tree
    ((262144, 2622), 4, False),
    ((64,), 4, True),  # the store had it all already
    ((262144, 5000, 2000, 1000), 4, True),  # the limit
])
def test_precopy_stops(sent, limit, done):
    assert precopy_done(rounds(*sent), limit) is done
