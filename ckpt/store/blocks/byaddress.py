"""A pages image's page ids looked up by the address each page had in its process.

A dump compares the pages CRIU streams with those the same addresses held in the target's
newest checkpoint (ckpt/dump/pagestream.py, ckpt/dump/unchanged.py); a restore compares a
tree's processes' pages with its root's (ckpt/restore/treeshare.py). Both from the pagemap's
held runs ((vaddr, nr_pages) in pagemap order, criu/images.py held_runs) and the page list."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.system.arrays import np

from ckpt.store.blocks.segments import ID_LEN, PAGE


def runs_by_address(held: list[tuple[int, int]], pages: int) -> list[tuple[int, int, int]] | None:
    """The held runs of an image whose page list has `pages` pages, as (start, end, first
    row) sorted by address; None if they do not account for the page list (not worth
    trusting). Rows follow the runs in pagemap order, which CRIU writes by address."""
    if sum(n for _, n in held) != pages:
        return None
    by_address, row = [], 0
    for vaddr, n in held:
        by_address.append((vaddr, vaddr + n * PAGE, row))
        row += n
    by_address.sort()
    return by_address


@dataclass
class PagesByAddress:
    """The pages an image holds, by address: runs sorted by address (start, end, first row)
    and the page list as pairs of uint64 (an id is equal if both halves are)."""

    starts: np.ndarray
    ends: np.ndarray
    rows: np.ndarray
    ids: np.ndarray

    @classmethod
    def from_runs(cls, held: list[tuple[int, int]], page_list: bytes) -> PagesByAddress | None:
        runs = runs_by_address(held, len(page_list) // ID_LEN)
        if runs is None:
            return None
        table = np.array(runs, dtype=np.uint64).reshape(-1, 3)
        return cls(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].astype(np.int64),
                   np.frombuffer(page_list, dtype=np.uint64))

    def same(self, addresses: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """For pages at `addresses` (uint64) with `ids` (rows of two uint64 halves), whether
        each one's id is the one its address has here. Whole arrays at once: a batch can hold
        thousands of pagemap entries (a sparse heap: one per page)."""
        same = np.zeros(len(addresses), dtype=bool)
        if not len(self.starts) or not len(addresses):
            return same
        k = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        inside = k >= 0
        k[~inside] = 0
        inside &= addresses < self.ends[k]
        rows = self.rows[k] + ((addresses - self.starts[k]) // PAGE).astype(np.int64)
        rows[~inside] = 0
        then = self.ids.reshape(-1, 2)[rows]
        return inside & (then[:, 0] == ids[:, 0]) & (then[:, 1] == ids[:, 1])
