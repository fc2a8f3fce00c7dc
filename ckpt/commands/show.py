"""Use case: describe what a checkpoint holds, read from its images."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.commands.results import JsonResult
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazywatch import failures
from ckpt.store import Manifest, Store
from ckpt.store.materialize import materialize
from ckpt.store.staging import discard


@dataclass(frozen=True)
class CheckpointDescription(JsonResult):
    manifest: Manifest
    processes: list[dict]  # per process, what its images hold (criu.images.describe)
    lazy_restore_failures: list[dict]  # what the page servers of its lazy restores could not fill in

    def to_json(self) -> dict:
        return {**self.manifest.to_json(), "processes": self.processes,
                "lazy_restore_failures": self.lazy_restore_failures}


def inspect(store: Store, ref: str, reporter: Reporter = NullReporter()) -> CheckpointDescription:
    """What checkpoint ref holds: its manifest and, read from its images, each process."""
    from ckpt.criu import images  # deferred: imports pycriu

    with store.lock(exclusive=False):
        manifest = store.load(store.resolve(ref))
        image_dir = materialize(store.objects, store.staging_area(), manifest, reporter, skip_pages=True)
        try:
            processes = images.describe(image_dir, manifest.processes)
        finally:
            discard(image_dir)
    return CheckpointDescription(manifest, processes, failures(store.logs_root / manifest.id))
