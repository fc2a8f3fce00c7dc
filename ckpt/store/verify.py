"""Verifying a checkpoint: every image read back from the store and its hash recomputed."""

from __future__ import annotations

from pathlib import Path

from ckpt.errors import DamagedCheckpoint
from ckpt.reporting import NullReporter, Reporter
from ckpt.store.bundles import read_bundle
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
    unusable = _unusable_bundled(objects, manifest)
    if unusable:
        # Not a problem of the checkpoint: the bundle only holds copies (ckpt/store/bundles.py).
        reporter.warn(f"checkpoint {manifest.id}: {unusable} of the copies in its bundle cannot be used (the bundle "
                      "is missing or damaged): its restores read those images one by one, as from a store without "
                      "bundles")
    return problems


def _unusable_bundled(objects: Objects, manifest: Manifest) -> int:
    """How many of the copies the checkpoint's bundle is to hold (in a remote store) are not
    there intact."""
    bundle = manifest.bundle
    if not objects.remote or not isinstance(bundle, dict) or not isinstance(bundle.get("spans"), dict):
        return 0
    found = read_bundle(objects.backend, bundle)
    return sum(1 for digest in bundle["spans"] if digest not in found)
