"""Verifying a checkpoint: every image read back from the store and its hash recomputed."""

from __future__ import annotations

from pathlib import Path

from ckpt.errors import DamagedCheckpoint
from ckpt.reporting import NullReporter, Reporter
from ckpt.store.manifest import Manifest
from ckpt.store.objects import Objects


def verify(objects: Objects, manifest: Manifest, reporter: Reporter = NullReporter(),
           spool_dir: Path | None = None) -> list[str]:
    """Recomputes every file's hash. Returns the problems found (empty: the checkpoint is intact).
    spool_dir: where a remote store's segments are fetched ahead (see BlockStore.write_image)."""
    problems = []
    total = manifest.bytes_total or 1
    done = 0
    for entry in manifest.files:
        try:
            objects.check_entry(entry, thorough=True, spool_dir=spool_dir)
        except DamagedCheckpoint as exc:
            problems.append(exc.message)
        done += entry.size
        reporter.progress(done, total, f"verifying {manifest.id}")
    return problems
