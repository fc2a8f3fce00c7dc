"""The ingest's vectorised helpers against the plain loops they replaced (blockstore.py)."""

from __future__ import annotations

import random

import numpy as np

from ckpt.store.blocks.blockstore import _first_seen, _runs


def runs_by_loop(positions, longest):
    runs = []
    for p in positions:
        if runs and runs[-1][1] == p and p - runs[-1][0] < longest:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def first_seen_by_loop(rows, page_list, seen):
    fresh = []
    for i in rows:
        page_id = page_list[i * 16:(i + 1) * 16]
        if page_id not in seen:
            seen.add(page_id)
            fresh.append(i)
    return fresh


def test_runs_and_first_seen_match_the_loops():
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(0, 3000)
        positions = sorted(rng.sample(range(5000), n))
        longest = rng.choice([1, 3, 256])
        assert _runs(positions, longest) == runs_by_loop(positions, longest), trial
        # ids drawn from a small alphabet: many repeats, within the image and with an earlier one
        page_list = b"".join(bytes([rng.randint(0, 40)]) * 16 for _ in range(5000))
        earlier = {bytes([k]) * 16 for k in rng.sample(range(41), 5)}
        seen_a = [np.frombuffer(b"".join(sorted(earlier)), dtype=np.uint64).reshape(-1, 2)]
        seen_b = set(earlier)
        assert _first_seen(positions, page_list, seen_a) == first_seen_by_loop(positions, page_list, seen_b), trial
        assert {bytes(row) for row in np.concatenate(seen_a)} == seen_b
