"""The bookkeeping of ckpt's lazy-pages daemon (ckpt/restore/uffdlazy.py): which pages of a
process are still to copy, and from where, as the tree forks, moves and drops its memory."""

from ckpt.restore.uffdlazy import PAGE, _Memory, _piece

BASE = 0x7F0000000000


def pages_of(memory: _Memory) -> dict[int, tuple[int, int]]:
    """address -> (segment key, page within it) of every page still to copy."""
    found = {}
    for vaddr, count, key, within, repeated in memory.runs.values():
        for k in range(count):
            found[vaddr + k * PAGE] = (key, within if repeated else within + k)
    return found


def memory_with(*runs) -> _Memory:
    return _Memory(fd=-1, pid=None, runs=list(runs), shares=2)


def test_find_gives_the_run_holding_an_address_and_nothing_between_runs():
    memory = memory_with((BASE, 4, 7, 0, False), (BASE + 10 * PAGE, 2, 8, 5, False))
    assert memory.find(BASE + 3 * PAGE + 5)[0] == BASE
    assert memory.find(BASE + 4 * PAGE) is None
    assert memory.find(BASE - PAGE) is None
    assert memory.find(BASE + 11 * PAGE)[2] == 8
    assert memory.find(BASE + 12 * PAGE) is None


def test_cut_drops_exactly_the_range_and_keeps_where_each_page_comes_from():
    memory = memory_with((BASE, 8, 7, 10, False), (BASE + 8 * PAGE, 4, 9, 0, True))
    before = pages_of(memory)
    memory.cut(BASE + 2 * PAGE, BASE + 10 * PAGE)
    after = pages_of(memory)
    gone = {BASE + k * PAGE for k in range(2, 10)}
    assert after == {address: source for address, source in before.items() if address not in gone}
    assert sorted(memory.runs) == memory.starts


def test_move_carries_the_pages_to_their_new_addresses():
    memory = memory_with((BASE, 8, 7, 0, False))
    before = pages_of(memory)
    destination = BASE + 0x100000
    memory.move(BASE + 4 * PAGE, destination, 8 * PAGE)  # half of the run, and past its end
    after = pages_of(memory)
    expected = {a: s for a, s in before.items() if a < BASE + 4 * PAGE}
    expected.update({destination + (a - BASE - 4 * PAGE): s for a, s in before.items() if a >= BASE + 4 * PAGE})
    assert after == expected


def test_a_forked_child_misses_what_its_parent_missed_and_each_goes_its_own_way():
    parent = memory_with((BASE, 8, 7, 0, False))
    parent.cut(BASE, BASE + 2 * PAGE)
    child = _Memory(fd=-1, pid=None, runs=list(parent.runs.values()), shares=2)
    assert pages_of(child) == pages_of(parent)
    child.cut(BASE, BASE + 8 * PAGE)
    assert child.complete and not parent.complete and len(pages_of(parent)) == 6


def test_replace_of_a_run_changed_meanwhile_changes_nothing():
    """A copying thread's run, cut by an event in the meantime: its leftover must not come back."""
    run = (BASE, 8, 7, 0, False)
    memory = memory_with(run)
    memory.cut(BASE, BASE + 8 * PAGE)
    memory.replace(run, [_piece(run, 4, 4)])
    assert memory.complete


def test_every_run_has_a_hint_in_the_share_of_its_segment():
    memory = memory_with((BASE, 8, 7, 0, False), (BASE + 8 * PAGE, 8, 8, 0, False))
    memory.cut(BASE + 2 * PAGE, BASE + 3 * PAGE)
    memory.move(BASE + 12 * PAGE, BASE + 0x200000, 2 * PAGE)
    hinted = {(start, k) for k, hints in enumerate(memory.hints) for start in hints}
    for start, run in memory.runs.items():
        assert (start, run[2] % 2) in hinted
