"""What packs hold: pages, cut into segments (see docs/design.md). The leaf that the block
store (blocks.py), the block index (blockindex.py) and prune share."""

from __future__ import annotations

from dataclasses import dataclass

PAGE = 4096
ID_LEN = 16  # a page id: keyed XXH3-128
# The codecs a dump may use (the default first), with the number index files record for a
# segment; objects (the small images) are kept as zstd or none (repository.py).
CODECS = {"zstd": 1, "lz4": 2, "none": 0}


@dataclass
class Segment:
    pack: str
    offset: int
    length: int
    pages: int
    codec: int
    checksum: bytes


# A page's location in the block index: its segment's number << 16 | the page within the
# segment (a segment holds fewer than 65536 pages). Works on ints and on numpy arrays alike.
WITHIN_BITS = 16
WITHIN_MASK = (1 << WITHIN_BITS) - 1


def to_location(segment, within):
    return (segment << WITHIN_BITS) | within


def segment_key(location):
    """The segment number of a location (or of an array of them)."""
    return location >> WITHIN_BITS


def split_location(location: int) -> tuple[int, int]:
    """(segment number, page within the segment)."""
    return location >> WITHIN_BITS, location & WITHIN_MASK


def pack_name(pack: str) -> str:
    """The blob name of a pack."""
    return f"packs/{pack[:2]}/{pack}"


INDEX_PREFIX = "index/"
