"""Use case: remove checkpoints, then reclaim the objects nothing references any more."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.commands.results import JsonResult
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.prune import collect_garbage


@dataclass(frozen=True)
class RemoveResult(JsonResult):
    removed: list[str]  # checkpoint IDs (those a dry run would remove)
    dry_run: bool
    objects_removed: int = 0
    bytes_freed: int = 0

    def to_json(self) -> dict:
        return {"removed": self.removed, "dry_run": self.dry_run, "objects_removed": self.objects_removed,
                "bytes_freed": self.bytes_freed}


def remove(store: Store, refs: list[str], dry_run: bool = False,
           reporter: Reporter = NullReporter()) -> RemoveResult:
    """Resolves every reference first (all or nothing), then removes the manifests and collects garbage."""
    with store.lock(exclusive=True):
        checkpoint_ids = []
        for ref in refs:
            checkpoint_id = store.resolve(ref)
            if checkpoint_id not in checkpoint_ids:
                checkpoint_ids.append(checkpoint_id)
        if dry_run:
            return RemoveResult(checkpoint_ids, dry_run=True)
        store.remove(checkpoint_ids)
        phase("rm.removed")
        objects, freed = collect_garbage(store)
    tell_copies_read_again(store, reporter)
    return RemoveResult(checkpoint_ids, dry_run=False, objects_removed=objects, bytes_freed=freed)
