"""What packs hold: pages, cut into segments (see docs/design.md). The leaf that the block
store (blocks.py), the block index (blockindex.py) and prune share."""

from __future__ import annotations

from dataclasses import dataclass

PAGE = 4096
ID_LEN = 16  # a page id: keyed XXH3-128
CODECS = {"none": 0, "zstd": 1, "lz4": 2}  # a segment's codec, as index files record it


@dataclass
class Segment:
    pack: str
    offset: int
    length: int
    pages: int
    codec: int
    checksum: bytes


def pack_name(pack: str) -> str:
    """The blob name of a pack."""
    return f"packs/{pack[:2]}/{pack}"


INDEX_PREFIX = "index/"
