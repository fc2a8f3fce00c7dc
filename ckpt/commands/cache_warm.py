"""Use case: warm a standby host's cache (`ckpt cache warm`). Everything a restore of the
checkpoints will read from the bucket is pulled into this host's local cache of the remote
store (ckpt/store/backends/cache.py, "Local cache" in docs/design.md), only what the cache
lacks, so that a failover restore here runs at local speed and downloads no content.

What a restore reads, and so what is warmed (docs/design.md, "Read order"): every index file
(the block index is loaded whole), the objects the manifests name (image files and page
lists), and the packs that hold a segment of their pages. Manifests, `store.json`, keys, damage
markers and locks are never cached: a restore still asks the bucket for those (small).

The plan is made before the bulk comes down: the index files and objects are named by the
manifests and a listing, so their sizes are known before anything is downloaded; which packs
are needed is known only from the index and the page lists, so once those are in the packs
are sized, and the whole must fit the cache's cap before any pack is downloaded.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable

from ckpt.errors import DamagedCheckpoint, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Manifest, Store
from ckpt.store.backends.cache import LOW_WATER, CachingBackend
from ckpt.store.blocks.segments import INDEX_PREFIX, pack_name, segment_key
from ckpt.store.fsutil import translate_os_error
from ckpt.store.objects import codecs_from
from ckpt.system.textutil import human_bytes

# Blobs downloaded at once. Each download is itself parallel (the S3 backend's ranged GETs of
# 16 MiB parts): a few blobs at once keep the link busy through the many small objects and
# index files without oversubscribing the two to eight cores that decrypt and hash them.
THREADS = 4
WHAT = "warming the cache"


@dataclass
class WarmReport:
    """What warming did: the blobs a restore of the checkpoints reads, and how many of them
    were downloaded now or were in the cache already."""

    store: str
    checkpoints: list[Manifest]
    cap: int  # the cache's cap (CKPT_CACHE_SIZE), all remote stores together
    blobs: int = 0  # index files, objects and packs a restore of the checkpoints reads
    bytes: int = 0
    fetched_blobs: int = 0  # downloaded now
    fetched_bytes: int = 0
    cached_blobs: int = 0  # in the cache already
    cached_bytes: int = 0
    duration_ms: float = 0.0

    def to_json(self) -> dict:
        return {"store": self.store, "checkpoints": [{"id": m.id, "name": m.name} for m in self.checkpoints],
                "blobs": self.blobs, "bytes": self.bytes, "fetched_blobs": self.fetched_blobs,
                "fetched_bytes": self.fetched_bytes, "cached_blobs": self.cached_blobs,
                "cached_bytes": self.cached_bytes, "cap": self.cap, "duration_ms": round(self.duration_ms, 1)}


@dataclass
class _Plan:
    """Blob name -> size, in the order they are warmed (index files and objects, then packs)."""

    sizes: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, size: int) -> None:
        self.sizes.setdefault(name, size)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def cache_of(store: Store) -> CachingBackend:
    """The local cache in front of the store; a one-line UsageError when it has none."""
    if not store.remote:
        raise UsageError(f"the store at {store.location} is a local directory: it has no cache to warm (a restore "
                         "reads it at local speed already)",
                         hint="give the standby's remote store, e.g. --store s3://BUCKET/PREFIX")
    if not isinstance(store.backend, CachingBackend):
        raise UsageError("the local cache is off (CKPT_CACHE_SIZE=0): there is nothing to warm",
                         hint="set CKPT_CACHE_SIZE to a size (20G) or a share of the disk (10%)")
    return store.backend


def select(store: Store, refs: list[str]) -> list[str]:
    """The checkpoints refs name, as `ckpt restore` takes them (an ID, a unique prefix, a name:
    its newest, 'latest'; a group checkpoint: its members), oldest first, each once."""
    if not refs:
        raise UsageError("give the checkpoints to warm", hint="e.g. 'ckpt cache warm agent --store s3://BUCKET/PREFIX'")
    found: set[str] = set()
    for ref in refs:
        group_id = store.resolve_group(ref)
        if group_id is not None:
            found.update(store.members_of(store.groups.load(group_id)))
        else:
            found.add(store.resolve(ref))
    return sorted(found)


def warm(store: Store, refs: list[str], reporter: Reporter = NullReporter(), threads: int = THREADS,
         clock: Callable[[], float] = time.monotonic) -> WarmReport:
    """Pulls into the store's local cache every blob a restore of the checkpoints refs name
    reads from the bucket, only those the cache lacks, under the store's shared lock (a prune
    waits). UsageError (before anything is downloaded) if the store has no cache, or if what
    the checkpoints need does not fit the cache's cap with the room eviction leaves."""
    cache = cache_of(store)
    started = clock()
    on_wait = lambda _holders: reporter.info("waiting for the lock of the store")  # noqa: E731
    try:
        with store.lock(exclusive=False, on_wait=on_wait):
            manifests = [store.load(checkpoint_id) for checkpoint_id in select(store, refs)]
            report = WarmReport(store.location, manifests, cache.max_bytes)
            _Warming(store, cache, report, reporter, threads).run()
    except OSError as exc:
        raise translate_os_error(exc, f"warming the cache {cache.directory}") from exc
    report.duration_ms = (clock() - started) * 1000
    return report


class _Warming:
    """One `warm`: the plan, made in two steps, and its downloads (threads of one pool)."""

    def __init__(self, store: Store, cache: CachingBackend, report: WarmReport, reporter: Reporter, threads: int):
        self.store, self.cache, self.report, self.reporter = store, cache, report, reporter
        self.threads = max(1, threads)
        self.plan = _Plan()
        self.fetched: dict[str, int] = {}  # blob name -> bytes downloaded now

    def run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-warm") as pool:
            self.pool = pool
            for info in self.store.backend.list(INDEX_PREFIX):
                self.plan.add(info.name, info.size)
            objects = sorted({(entry.hash, entry.codec) for m in self.report.checkpoints for entry in m.files})
            for name, size in pool.map(self._object_blob, objects):
                self.plan.add(name, size)
            self._check_fits(packs_known=False)
            small = list(self.plan.sizes)
            self._warm(small, f"{WHAT}: {len(small)} index files and objects")
            packs = self._packs()
            for name, size in pool.map(lambda name: (name, self.store.backend.stat(name).size), packs):
                self.plan.add(name, size)
            self._check_fits(packs_known=True)
            self._warm(packs, f"{WHAT}: {len(packs)} packs")
            # Once more over everything, now cheap (a copy found is only marked used): a copy
            # another process's eviction took meanwhile is downloaded again.
            self._warm(list(self.plan.sizes), None)
        report = self.report
        report.blobs, report.bytes = len(self.plan.sizes), self.plan.total
        report.fetched_blobs, report.fetched_bytes = len(self.fetched), sum(self.fetched.values())
        cached = [size for name, size in self.plan.sizes.items() if name not in self.fetched]
        report.cached_blobs, report.cached_bytes = len(cached), sum(cached)

    def _object_blob(self, named: tuple[str, str]) -> tuple[str, int]:
        """The blob holding an object (hash, codec its manifest records), and its size: the
        name a restore reads first, if the store has it (Objects.read_into)."""
        digest, codec = named
        found = self.store.objects.find(digest, codecs=codecs_from(codec))
        if found is not None:
            return found.name, found.size
        raise DamagedCheckpoint(f"object {digest[:16]}… is missing from the store: its checkpoint cannot be restored",
                                hint="run `ckpt verify`")

    def _packs(self) -> list[str]:
        """The packs holding a segment of a page of the checkpoints (from the index and the
        page lists, both in the cache now)."""
        from ckpt.system.arrays import distinct, np

        blocks = self.store.blocks
        index = blocks.index()
        keys: set[int] = set()
        for manifest in self.report.checkpoints:
            for entry in manifest.files:
                if entry.kind == "pages":
                    locations = blocks.locate(entry.name, self.store.objects.load_page_list(entry))
                    keys.update(distinct(segment_key(np.asarray(locations, dtype=np.int64))).tolist())
        return sorted({pack_name(index.segment_list[key].pack) for key in keys})

    def _check_fits(self, packs_known: bool) -> None:
        """What the checkpoints need must fit the cap with the room eviction leaves (it brings the
        cache down to LOW_WATER of the cap, least recently used first: the copies warmed are the
        most recent, so they stay), or the restore would download what eviction took."""
        room = int(self.cache.max_bytes * LOW_WATER)
        if self.plan.total <= room:
            return
        ids = ", ".join(m.id for m in self.report.checkpoints)
        needed = human_bytes(self.plan.total) if packs_known else f"more than {human_bytes(self.plan.total)}"
        raise UsageError(f"the cache cannot hold what a restore of {ids} reads: {needed}, and CKPT_CACHE_SIZE caps "
                         f"the cache at {human_bytes(self.cache.max_bytes)} (eviction keeps {human_bytes(room)}); "
                         f"{'no pack' if packs_known else 'nothing'} was downloaded",
                         hint="raise CKPT_CACHE_SIZE (e.g. 20G or 10%), or warm fewer checkpoints")

    def _warm(self, names: list[str], what: str | None) -> None:
        """Warms the blobs in parallel; with what, says so and tells the bytes done (from this
        thread, as each blob is warmed, in order)."""
        total = sum(self.plan.sizes[name] for name in names)
        if what is not None:
            self.reporter.step(f"{what}, {human_bytes(total)}")
        done = 0
        warmed = self.pool.map(lambda name: self.cache.warm(name, self.plan.sizes[name]), names)
        for name, fetched in zip(names, warmed, strict=True):
            if fetched:
                self.fetched[name] = self.fetched.get(name, 0) + fetched
            done += self.plan.sizes[name]
            if what is not None:
                self.reporter.progress(done, total, what)
