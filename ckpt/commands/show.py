"""Use case: describe what a checkpoint holds, read from its images, or what a group
checkpoint is made of (its members and how close together they were frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckpt.commands.clone import running_copies
from ckpt.commands.results import JsonResult
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazywatch import failures
from ckpt.store import Manifest, Store
from ckpt.errors import DamagedCheckpoint, StoreError
from ckpt.store.groups import GroupManifest, group_of
from ckpt.store.materialize import materialize
from ckpt.store.staging import discard


@dataclass(frozen=True)
class CheckpointDescription(JsonResult):
    manifest: Manifest
    processes: list[dict]  # per process, what its images hold (criu.images.describe)
    lazy_restore_failures: list[dict]  # what the page servers of its lazy restores could not fill in
    group: GroupManifest | None = None  # the group checkpoint it is a member of
    running_copies: list[dict] = field(default_factory=list)  # copies of it that clones run

    def to_json(self) -> dict:
        # The manifest's own "group" ({"id", "name"}) says which group a member belongs to.
        return {**self.manifest.to_json(), "processes": self.processes,
                "lazy_restore_failures": self.lazy_restore_failures, "running_copies": self.running_copies}


@dataclass(frozen=True)
class GroupDescription(JsonResult):
    """A group checkpoint: its group manifest (docs/design.md, "Groups"), read as it is."""

    group: GroupManifest

    def to_json(self) -> dict:
        return self.group.to_json()


def inspect(store: Store, ref: str, reporter: Reporter = NullReporter(),
            copies_dir: Path | None = None) -> CheckpointDescription | GroupDescription:
    """What ref names: a group checkpoint (its ID, a prefix, its name), described by its group
    manifest; else a checkpoint: its manifest and, read from its images, each process, and
    the copies of it that clones run (their registries in copies_dir, when given)."""
    from ckpt.criu import images  # deferred: imports pycriu

    with store.lock(exclusive=False):
        group_id = store.resolve_group(ref)
        if group_id is not None:
            return GroupDescription(store.groups.load(group_id))
        manifest = store.load(store.resolve(ref))
        group = _group(store, manifest)
        image_dir = materialize(store.objects, store.staging_area(), manifest, reporter, skip_pages=True)
        try:
            processes = images.describe(image_dir, manifest.processes)
        finally:
            discard(image_dir)
    running = running_copies(copies_dir, manifest.id).get(manifest.id, []) if copies_dir is not None else []
    return CheckpointDescription(manifest, processes, failures(store.logs_root / manifest.id), group, running)


def _group(store: Store, manifest: Manifest) -> GroupManifest | None:
    """The group a member belongs to; None for a plain checkpoint, and for a member whose group
    manifest cannot be read (its manifest's own "group" still names it; verify reports it)."""
    group_id = group_of(manifest)
    try:
        return store.groups.load(group_id) if group_id is not None else None
    except (DamagedCheckpoint, StoreError):
        return None
