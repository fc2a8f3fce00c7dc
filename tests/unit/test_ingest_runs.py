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


def _ids_seen(seen) -> set[bytes]:
    """The ids _first_seen's arrays hold, as 16-byte strings."""
    return {np.array([first, second], dtype=np.uint64).tobytes()
            for firsts, seconds in seen for first, second in zip(firsts.tolist(), seconds.tolist(), strict=True)}


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
        pairs = np.frombuffer(b"".join(sorted(earlier)), dtype=np.uint64).reshape(-1, 2)
        order = np.argsort(pairs[:, 0], kind="stable")
        seen_a = [(pairs[order, 0].copy(), pairs[order, 1].copy())]
        seen_b = set(earlier)
        assert _first_seen(positions, page_list, seen_a) == first_seen_by_loop(positions, page_list, seen_b), trial
        assert _ids_seen(seen_a) == seen_b


def test_first_seen_over_many_images_matches_the_loop():
    """Image after image, as a dump of a tree: ids repeated within an image, across images, and
    ids alike in their first 8 bytes only; the arrays seen stay few and sorted."""
    rng = random.Random(11)
    alike = [bytes([7]) * 8 + bytes([k]) * 8 for k in range(6)]  # one first half, six ids
    seen_a: list = []
    seen_b: set[bytes] = set()
    for image in range(60):
        n = rng.randint(0, 400)
        page_list = b"".join(rng.choice(alike) if rng.random() < 0.05 else rng.randbytes(16) if rng.random() < 0.5
                             else bytes([rng.randint(0, 255)]) * 16 for _ in range(n))
        positions = sorted(rng.sample(range(n), rng.randint(0, n)))
        assert _first_seen(positions, page_list, seen_a) == first_seen_by_loop(positions, page_list, seen_b), image
        assert _ids_seen(seen_a) == seen_b
        assert all(np.all(firsts[1:] >= firsts[:-1]) for firsts, _ in seen_a)
    assert len(seen_a) <= 8


def test_a_streamed_image_and_the_pages_image_it_stands_for_are_stored_alike(tmp_path):
    """The two PageSources of BlockStore.ingest: a pages image CRIU wrote, and the same pages
    streamed with only some of them kept (the others known at their address). Same page list,
    and only the kept pages the store lacks are new."""
    import os

    from ckpt.store.backends.local import LocalBackend
    from ckpt.store.blocks.blockstore import BlockStore, PagesImage, StreamedPages, page_ids

    page = 4096
    blocks = BlockStore(LocalBackend(tmp_path / "blocks"))
    first = os.urandom(page * 12)
    image = tmp_path / "pages-1.img"
    image.write_bytes(first)
    page_lists, stats, _ = blocks.ingest([PagesImage(image)], lambda _: "zstd")
    assert page_lists["pages-1.img"] == page_ids(first, blocks.seed) and stats.new_pages == 12

    # The next dump changed pages 3 and 7 (and 8 repeats 3): only those were kept from the stream.
    second = bytearray(first)
    second[3 * page:4 * page] = second[8 * page:9 * page] = os.urandom(page)
    second[7 * page:8 * page] = os.urandom(page)
    kept = tmp_path / "pages-2.kept"
    rows = np.array([3, 7, 8])
    kept.write_bytes(b"".join(bytes(second[r * page:(r + 1) * page]) for r in rows))
    streamed = StreamedPages("pages-2.img", kept, page_ids(bytes(second), blocks.seed), rows)
    nothing_kept = StreamedPages("pages-3.img", tmp_path / "none.kept", page_ids(first, blocks.seed),
                                 np.zeros(0, dtype=np.int64))
    page_lists, stats, _ = blocks.ingest([streamed, nothing_kept], lambda _: "zstd")
    assert page_lists == {"pages-2.img": page_ids(bytes(second), blocks.seed),
                          "pages-3.img": page_ids(first, blocks.seed)}
    assert (stats.pages, stats.new_pages, stats.bytes_dedup) == (24, 2, 22 * page)
    out = tmp_path / "rebuilt.img"
    blocks.write_image("pages-2.img", page_lists["pages-2.img"], out, check_ids=True)
    assert out.read_bytes() == bytes(second)


def test_an_image_whose_pages_are_all_stored_is_not_sampled_for_its_codec(tmp_path):
    """The codec is asked (a sample read and compressed) only of an image with pages to store:
    a dump whose pages the store has already asks for none, and stores them as before."""
    import os

    from ckpt.store.backends import LocalBackend
    from ckpt.store.blocks.blockstore import PAGE, BlockStore

    blocks = BlockStore(LocalBackend(tmp_path / "blocks"))
    data = os.urandom(8 * PAGE) + bytes(range(256)) * 16 * 8
    asked = []

    def codec_for(path):
        asked.append(path.name)
        return "zstd"

    lists = []
    for name in ("pages-1.img", "pages-2.img"):
        image = tmp_path / name
        image.write_bytes(data)
        page_lists, stats, _ = blocks.ingest([image], codec_for)
        lists.append((page_lists[name], stats.new_pages))
    assert asked == ["pages-1.img"], "asked of the first image only: the second's pages are all stored"
    assert lists[0][0] == lists[1][0] and lists[0][1] == 9 and lists[1][1] == 0
    out = tmp_path / "out.img"
    blocks.write_image("pages-2.img", lists[1][0], out, check_ids=True)
    assert out.read_bytes() == data
