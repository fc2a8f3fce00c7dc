"""Use case: recompute the hashes of one checkpoint or of all of them."""

from __future__ import annotations

from ckpt.errors import DamagedCheckpoint
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.verify import verify as verify_checkpoint


def verify(store: Store, ref: str | None, reporter: Reporter = NullReporter()) -> list[dict]:
    """One result per checkpoint: {"id", "files", "problems": [...]} (no problems: intact)."""
    results = []
    store = store.uncached()  # a remote store's own bytes, not the local cache's copies
    with store.lock(exclusive=False):
        checkpoint_ids = [store.resolve(ref)] if ref else store.checkpoint_ids()
        for checkpoint_id in checkpoint_ids:
            try:
                manifest = store.load(checkpoint_id)
            except DamagedCheckpoint as exc:
                results.append({"id": checkpoint_id, "files": 0, "problems": [exc.message]})
                continue
            reporter.step(f"verifying {checkpoint_id}")
            problems = verify_checkpoint(store.objects, manifest, reporter)
            results.append({"id": checkpoint_id, "files": len(manifest.files), "problems": problems})
    return results
