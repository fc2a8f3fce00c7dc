"""The end of every dump: the staged images into the store, then the manifest, committed last.

Apart from the dump use case (ckpt/commands/dump.py) so that the store's tests commit their
checkpoints by this very path, with staged files and no CRIU.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Manifest, Origin, Store
from ckpt.store.bundles import write_bundle
from ckpt.store.ingest import ingest
from ckpt.store.blocks.segments import PAGE
from ckpt.store.staging import DumpStaging
from ckpt.system import procfs


@dataclass
class DumpRecord:
    """What a checkpoint's manifest says besides its images: all known before the ingest."""

    checkpoint_id: str
    pid: int
    command: str
    processes: list[dict]
    started: float  # time.monotonic() when the dump began: the manifest's duration_ms
    name: str | None = None
    origin: Origin | None = None  # who asked for it (None only in tests: as in an old manifest)
    criu: dict = field(default_factory=dict)  # the manifest's "criu" facts: version, options, tty, pipes...
    # From CRIU's stats-dump image: freeze_ms, pages_written, pages_scanned (None where unknown).
    criu_stats: dict = field(default_factory=dict)
    # Dirty-page tracking: {"target": key, "parent": id or None}; the ingest adds pages_from_parent.
    tracking: dict | None = None
    group: dict | None = None  # a member of a group checkpoint: {"id", "name"} of the group
    clock: Callable[[], float] = time.monotonic  # the one `started` was read from (a test's own)


def ingest_and_commit(store: Store, staging: DumpStaging, record: DumpRecord, codec: str,  # noqa: PLR0913
                      reporter: Reporter = NullReporter(), complete_page_lists=None,
                      earlier: dict | None = None, before_commit=None, ahead=None) -> Manifest:
    """Ingests every staged image (only pages the store lacks are written), then commits the
    manifest: the checkpoint exists from that moment on, and not before. complete_page_lists
    earlier and ahead are ingest.ingest's (dirty-page tracking; the read-ahead of an earlier
    checkpoint; pages images stored while CRIU wrote the others).
    before_commit(manifest), when given, runs right before the commit (a dump with --copy-to
    writes its pending-copy record there: no committed checkpoint is without it)."""
    entries, added, block_stats, bundle_contents = ingest(store.objects, staging, codec, reporter,
                                                          complete_page_lists, earlier=earlier, ahead=ahead)
    bundle, bundled_bytes = (None, 0) if bundle_contents is None else write_bundle(
        store.backend, record.checkpoint_id, bundle_contents.contents, [entry.hash for entry in entries])
    criu = dict(record.criu)
    if record.tracking is not None:
        criu["tracking"] = {**record.tracking, "pages_from_parent": block_stats.pages_from_parent}
    manifest = Manifest(
        id=record.checkpoint_id,
        name=record.name,
        origin=record.origin,
        created=datetime.now(timezone.utc).isoformat(),
        host=socket.gethostname(),
        system=procfs.host_facts(),
        pid=record.pid,
        command=record.command,
        processes=record.processes,
        files=entries,
        criu=criu,
        group=record.group,
        stats={"freeze_ms": record.criu_stats.get("freeze_ms"), "frozen_at": record.criu_stats.get("frozen_at"),
               "pages_written": record.criu_stats.get("pages_written"),
               "pages_scanned": record.criu_stats.get("pages_scanned"),
               "pages": block_stats.pages, "pages_new": block_stats.new_pages,
               # what CRIU read while the tree was frozen (with dirty tracking: the dirty pages)
               "pages_dumped": block_stats.pages - block_stats.pages_from_parent,
               "bytes_dedup": block_stats.bytes_dedup,
               "compression_ratio": round(block_stats.new_pages * PAGE / block_stats.bytes_new, 2)
               if block_stats.bytes_new else None,
               "duration_ms": round((record.clock() - record.started) * 1000, 1)},
        bytes_total=sum(e.size for e in entries),
        bytes_stored=added + bundled_bytes,
        bundle=bundle,
    )
    phase("dump.before-commit")
    if before_commit is not None:
        before_commit(manifest)
    store.commit(manifest)
    phase("dump.committed")
    return manifest
