"""The block index: which segment of which pack holds each page, and the format of its index
files, written (render_index) and read (BlockIndex.add_file) here (see docs/design.md).

Index files are kept as numpy views of their bytes: loading one costs no work per entry, and
pages are looked up by sorted searches rather than through a dict of every page the store
holds, which cost a dump or a restore a second for 2.2 million pages.
"""

from __future__ import annotations

import struct

import blake3
from ckpt.system.arrays import np

from ckpt.errors import DamagedCheckpoint
from ckpt.store.blocks.segments import ID_LEN, Segment, segment_key, to_location

INDEX_MAGIC = b"CKPTIDX1"
SEGMENT = struct.Struct("<IQIHB16s")  # pack number, offset, stored length, pages, codec, checksum


def render_index(segments: list[Segment], ids: bytes, segment_numbers, positions) -> bytes:
    """An index file's bytes, from its entries as columns: their ids one after the other, the
    number of each one's segment, its position there. The entries are written in the order of
    their ids (readers search them)."""
    ids, segment_numbers, positions = in_id_order(ids, segment_numbers, positions)
    packs = sorted({s.pack for s in segments})
    pack_no = {p: i for i, p in enumerate(packs)}
    parts = [INDEX_MAGIC, struct.pack("<I", len(packs))] + [p.encode() for p in packs]
    parts.append(struct.pack("<I", len(segments)))
    parts += [SEGMENT.pack(pack_no[s.pack], s.offset, s.length, s.pages, s.codec, s.checksum) for s in segments]
    parts += [struct.pack("<I", len(ids) // ID_LEN), ids, segment_numbers, positions]
    return b"".join(parts)


class _IndexColumns:
    """One index file's entries, as views of its bytes (nothing copied, nothing per entry)."""

    def __init__(self, data: bytes, ids_at: int, count: int, base: int):
        self.data = data
        self.count = count
        self.base = base  # the number of this file's first segment in BlockIndex.segment_list
        ids_end = ids_at + ID_LEN * count
        # Big-endian halves: numeric order of `high` is the byte order of the ids.
        halves = np.frombuffer(data, dtype=">u8", count=2 * count, offset=ids_at)
        self.high, self.low = halves[0::2], halves[1::2]
        self.segs = np.frombuffer(data, dtype="<u4", count=count, offset=ids_end)
        self.within = np.frombuffer(data, dtype="<u2", count=count, offset=ids_end + 4 * count)
        self.ids_at = ids_at
        self._sorted: bool | None = None
        self._ordered: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    @property
    def sorted(self) -> bool:
        """Whether the entries are in the order of their ids (ckpt writes them so since index
        files are searched; older files are not, and are searched the other way round)."""
        if self._sorted is None:
            self._sorted = bool(np.all(self.high[1:] >= self.high[:-1]))
        return self._sorted

    def in_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The high halves in id order as native, contiguous integers, the low halves in the
        same order, and the rows they come from (None: in order already). Made once per file
        and kept (8 bytes an entry): numpy's sorted search converts a big-endian, strided
        haystack anew on every call, 0.4 ms against 0.12 ms for 300,000 entries, and a dump
        searches each index file (up to 32 of them) once for each pages image. An unsorted
        file is sorted once (0.1 s a million entries)."""
        if self._ordered is None:
            if self.sorted:
                self._ordered = (self.high.astype(np.uint64), self.low, None)
            else:
                order = argsort(self.high)
                self._ordered = (self.high[order].astype(np.uint64), self.low[order], order)
        return self._ordered

    def id_bytes(self) -> bytes:
        """The ids one after the other, as in the file."""
        return self.data[self.ids_at:self.ids_at + ID_LEN * self.count]

    def id_list(self) -> list[bytes]:
        data, at = self.data, self.ids_at
        return [data[o:o + ID_LEN] for o in range(at, at + ID_LEN * self.count, ID_LEN)]

    def locations(self, rows=slice(None)) -> np.ndarray:
        return to_location(self.segs[rows].astype(np.int64) + self.base, self.within[rows])


class BlockIndex:
    """Every index file of the store, loaded.

    A page's location is an int: segment number << 16 | page within the segment (segments.py), where the
    segment number indexes `segment_list` (one flat list over all index files). Index files
    are kept as numpy views of their bytes: loading one costs no work per entry, and `find`
    looks pages up with sorted searches instead of building a dict of every page the store
    holds (1 s for 2.2 million pages, and a restore or a dump wants only its own pages).
    """

    def __init__(self) -> None:
        self.segment_list: list[Segment] = []
        self.segment_file: list[str] = []
        self.files: list[str] = []
        self._columns: list[_IndexColumns] = []
        self._pages: dict[bytes, int] | None = None
        # Segment numbers recorded as damaged (see "Damage and healing" in docs/design.md).
        self.damaged: set[int] = set()
        self._suspect: set[int] | None = None
        # Index files that could not be read: their pages are not known (dumps store them again).
        self.damaged_files: list[str] = []

    @property
    def columns(self) -> list[_IndexColumns]:
        """Each index file's entries, in the order of `files`."""
        return self._columns

    @property
    def suspect(self) -> set[int]:
        """Every segment of a pack with a segment recorded as damaged. The others in such a
        pack have not been checked since (a pack cut short, or a failing disk, damages more
        than the segment a reader happened to meet first): a dump checks those it would name
        before it names them (BlockStore.check_suspect), and reads prefer copies elsewhere."""
        if self._suspect is None:
            packs = {self.segment_list[key].pack for key in self.damaged}
            self._suspect = {key for key, seg in enumerate(self.segment_list) if seg.pack in packs} \
                if packs else set()
        return self._suspect

    @property
    def pages(self) -> dict[bytes, int]:
        """Page id -> location, for every page (built on first use: prune needs it, dumps and
        restores use `find`). A page with several copies is located at the most trusted one:
        outside packs with recorded damage, else in such a pack but not recorded as damaged,
        else damaged (a restore then names the damage)."""
        if self._pages is None:
            pages: dict[bytes, int] = {}
            damaged, suspect = self.damaged, self.suspect

            def rank(location: int) -> int:
                key = segment_key(location)
                return 2 if key in damaged else 1 if key in suspect else 0

            for columns in self._columns:
                ids, locations = columns.id_list(), columns.locations().tolist()
                if not damaged:
                    pages.update(zip(ids, locations, strict=True))
                    continue
                for page_id, location in zip(ids, locations, strict=True):  # rare: the store has recorded damage
                    known = pages.get(page_id)
                    if known is None or rank(location) < rank(known):
                        pages[page_id] = location
            self._pages = pages
        return self._pages

    def find(self, page_list: bytes) -> np.ndarray:
        """The location of each id of a page list (16-byte ids one after the other), -1 where
        the store holds no healthy copy of it, as `pages` would give it.

        The wanted ids are sorted once; a large sorted index file is searched for each of them,
        a small (or unsorted) one is searched the other way round, each of its ids among the
        wanted ones. Either way the cost is that of the smaller side times a logarithm."""
        n = len(page_list) // ID_LEN
        if self.damaged:  # rare: `pages` knows which copy is healthy
            pages = self.pages
            return np.array([pages.get(page_list[i:i + ID_LEN], -1) for i in range(0, n * ID_LEN, ID_LEN)],
                            dtype=np.int64)
        result = np.full(n, -1, dtype=np.int64)
        if n == 0 or not self._columns:
            return result
        halves = np.frombuffer(page_list, dtype=">u8", count=2 * n)
        order = id_order(page_list[:n * ID_LEN])
        high, low = halves[0::2][order].astype(np.uint64), halves[1::2][order]  # (native: see in_order)
        first = np.ones(n, dtype=bool)  # the first of each run of equal ids (a page list repeats ids)
        first[1:] = (high[1:] != high[:-1]) | (low[1:] != low[:-1])
        unique_high, unique_low = high[first], low[first]
        found = np.full(len(unique_high), -1, dtype=np.int64)
        # The ids not found yet (any healthy copy will do): once the index file of the dump
        # that stored most of them has been searched, the others are searched for few ids.
        todo = np.arange(len(unique_high))
        for columns in self._columns:
            if columns.count == 0:
                continue
            todo_high, todo_low = unique_high[todo], unique_low[todo]
            if columns.count >= len(todo) // 8:
                high, low, back = columns.in_order()
                rows, wanted = search_ids(high, low, todo_high, todo_low)
                if back is not None:
                    rows = back[rows]
            else:
                wanted, rows = search_ids(todo_high, todo_low, columns.high.astype(np.uint64), columns.low)
            found[todo[wanted]] = columns.locations(rows)
            todo = todo[found[todo] < 0]
            if not len(todo):
                break
        # Back from unique sorted ids to the page list's order.
        result[order] = found[np.cumsum(first) - 1]
        return result

    @property
    def has_damage(self) -> bool:
        """Whether the store recorded damage: then `held` alone knows which copies count."""
        return bool(self.damaged or self.damaged_files)

    def held(self, page_list: bytes) -> np.ndarray:
        """For each id of a page list, whether the store holds a healthy copy of it (a page
        known only from a damaged segment is stored again by the next dump)."""
        found = self.find(page_list)
        if not self.damaged:
            return found >= 0
        return (found >= 0) & ~np.isin(segment_key(found), np.fromiter(self.damaged, dtype=np.int64))

    def missing(self, page_list: bytes, earlier: tuple | None = None) -> list[int]:
        """The rows of a page list whose page the store holds no healthy copy of.

        earlier: (the page list of a committed checkpoint of the same target, and where the
        pages at the same addresses sat in it: (row, earlier row, count) stretches;
        ckpt/dump/unchanged.py). A row whose id is the one its address had there is held: that
        checkpoint's pages are all in the store, and the shared lock keeps them there. Only
        the other rows are searched for, which for a target that changed 1% of its memory
        spares sorting and searching the other 99% (0.3 s for 2 GiB). Where the store has
        recorded damage, `held` alone knows which copies count: everything is searched."""
        n = len(page_list) // ID_LEN
        if earlier is None or self.has_damage or not _fits(earlier, n):
            return np.flatnonzero(~self.held(page_list)).tolist()
        earlier_list, pieces = earlier
        now = np.frombuffer(page_list, dtype=np.uint64, count=2 * n)
        then = np.frombuffer(earlier_list, dtype=np.uint64, count=2 * (len(earlier_list) // ID_LEN))
        same = np.zeros(n, dtype=bool)
        # Stretch by stretch, both lists read in order (a gather of half a million ids cost
        # twice as much); an id is equal if both its halves are.
        for row, earlier_row, count in pieces.tolist():
            equal = now[2 * row:2 * (row + count)] == then[2 * earlier_row:2 * (earlier_row + count)]
            same[row:row + count] = equal[0::2] & equal[1::2]
        others = np.flatnonzero(~same)
        if not len(others):
            return []
        ids = np.frombuffer(page_list, dtype="V16", count=n)
        return others[~self.held(ids[others].tobytes())].tolist()

    def locate(self, page_list: bytes) -> list[int]:
        """`find`, as a list."""
        return self.find(page_list).tolist()

    def mark_damaged(self, keys) -> None:
        new = set(keys) - self.damaged
        if new:
            self.damaged |= new
            self._pages = None
            self._suspect = None

    def add_file(self, name: str, data: bytes) -> None:
        """Adds one index file, checked first against its name (the BLAKE3 of its content): a
        flipped bit in an entry would otherwise send a page to another page's place."""
        if blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest() != name:
            raise DamagedCheckpoint(f"index file {name} is damaged (its content does not match its name)")
        if data[:8] != INDEX_MAGIC:
            raise DamagedCheckpoint(f"index file {name} is damaged (bad magic)")
        segments = []
        try:
            pos = 8
            (n_packs,) = struct.unpack_from("<I", data, pos)
            pos += 4
            packs = [data[pos + 32 * i: pos + 32 * (i + 1)].decode() for i in range(n_packs)]
            pos += 32 * n_packs
            (n_segments,) = struct.unpack_from("<I", data, pos)
            pos += 4
            for pack_no, offset, length, pages, codec, checksum in SEGMENT.iter_unpack(
                    data[pos:pos + SEGMENT.size * n_segments]):
                segments.append(Segment(packs[pack_no], offset, length, pages, codec, checksum))
            pos += SEGMENT.size * n_segments
            (n_entries,) = struct.unpack_from("<I", data, pos)
            pos += 4
            # Columns: all ids, then all segment numbers (u32), then all page positions (u16).
            if len(data) != pos + (ID_LEN + 6) * n_entries:
                raise ValueError("truncated" if len(data) < pos + (ID_LEN + 6) * n_entries else "trailing bytes")
            base = len(self.segment_list)
            columns = _IndexColumns(data, pos, n_entries, base)
            if n_entries and int(columns.segs.max()) >= len(segments):
                raise ValueError("an entry names a segment the file does not have")
        except (struct.error, ValueError, UnicodeDecodeError, IndexError) as exc:
            raise DamagedCheckpoint(f"index file {name} is damaged ({exc})") from None
        self.segment_list += segments
        self.segment_file += [name] * len(segments)
        self._columns.append(columns)
        self._pages = None
        self._suspect = None
        self.files.append(name)


def _fits(earlier: tuple, rows: int) -> bool:
    """Whether (earlier page list, stretches) can describe a page list of `rows` rows: every
    stretch within both lists (another image's stretches would not be)."""
    earlier_list, pieces = earlier
    if not len(pieces):
        return True
    if pieces.ndim != 2 or pieces.shape[1] != 3 or (pieces < 0).any() or (pieces[:, 2] == 0).any():
        return False
    return bool((pieces[:, 0] + pieces[:, 2]).max() <= rows
                and (pieces[:, 1] + pieces[:, 2]).max() <= len(earlier_list) // ID_LEN)


def search_ids(hay_high, hay_low, needle_high, needle_low) -> tuple[np.ndarray, np.ndarray]:
    """Finds needles in a haystack sorted by its high halves: (haystack rows, needle rows) of
    the needles found. Ids whose high halves are equal but whose low halves differ (one in
    four billion for a million ids) are settled one by one."""
    at = np.searchsorted(hay_high, needle_high)
    inside = at < len(hay_high)
    candidates = np.flatnonzero(inside)
    at_c = at[candidates]
    same_high = hay_high[at_c] == needle_high[candidates]
    hit = same_high & (hay_low[at_c] == needle_low[candidates])
    hay_rows, needle_rows = at_c[hit], candidates[hit]
    # A run of equal high halves in the haystack: the match may be further along it.
    odd = candidates[same_high & ~hit]
    if len(odd):
        extra_hay, extra_needle = [], []
        for k in odd.tolist():
            row = int(at[k]) + 1
            while row < len(hay_high) and hay_high[row] == needle_high[k]:
                if hay_low[row] == needle_low[k]:
                    extra_hay.append(row)
                    extra_needle.append(k)
                    break
                row += 1
        hay_rows = np.concatenate([hay_rows, np.array(extra_hay, dtype=np.int64)])
        needle_rows = np.concatenate([needle_rows, np.array(extra_needle, dtype=np.int64)])
    return hay_rows, needle_rows


def argsort(keys: np.ndarray) -> np.ndarray:
    """np.argsort with the stable kind (a merge sort without SIMD). numpy's default argsort of
    64-bit keys runs an AVX2 quicksort, which returned orders that were not sorted under the
    AVX2 emulation of QEMU 7.2 (the test VM, `-cpu max` under TCG): lookups then missed pages
    the store holds. The stable kind costs 0.03 s more for half a million keys."""
    return np.argsort(keys, kind="stable")


def id_order(ids: bytes) -> np.ndarray:
    """The permutation that puts 16-byte ids (one after the other) in their bytewise order."""
    halves = np.frombuffer(ids, dtype=">u8")
    high, low = halves[0::2], halves[1::2]
    order = argsort(high)
    sorted_high, sorted_low = high[order], low[order]
    same_high = sorted_high[1:] == sorted_high[:-1]
    # Equal ids (a page list repeats a zero page) are in order already; different ids that
    # share their high half need both halves (a two-key sort, five times slower).
    if (same_high & (sorted_low[1:] != sorted_low[:-1])).any():
        order = np.lexsort((low, high))
    return order


def in_id_order(ids: bytes, segment_numbers, positions) -> tuple[bytes, bytes, bytes]:
    """An index file's entry columns, in the order of their ids, as the bytes of the file. An
    id given twice (two merged files both named it) is kept once, at its first entry: the
    sort is stable."""
    order = id_order(ids)
    ordered = np.frombuffer(ids, dtype="V16")[order]
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    order = order[first]
    return (ordered[first].tobytes(),
            np.asarray(segment_numbers, dtype="<u4")[order].tobytes(),
            np.asarray(positions, dtype="<u2")[order].tobytes())
