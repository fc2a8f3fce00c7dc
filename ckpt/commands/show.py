"""Use case: describe what a checkpoint holds, read from its images."""

from __future__ import annotations


from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazywatch import failures
from ckpt.store import Store
from ckpt.store.staging import discard


def inspect(store: Store, ref: str, reporter: Reporter = NullReporter()) -> dict:
    from ckpt.criu import images  # deferred: imports pycriu

    with store.lock(exclusive=False):
        manifest = store.load(store.resolve(ref))
        image_dir = store.materialize(manifest, reporter, skip_pages=True)
        try:
            processes = images.describe(image_dir, manifest.processes)
        finally:
            discard(image_dir)
    data = manifest.to_json()
    data["processes"] = processes
    data["lazy_restore_failures"] = failures(store.logs_root / manifest.id)
    return data
