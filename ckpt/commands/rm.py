"""Use case: remove checkpoints and group checkpoints, then reclaim the objects nothing
references any more."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.commands.results import JsonResult
from ckpt.errors import DamagedCheckpoint, StoreError, UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.groups import GroupManifest, GroupMember, group_of
from ckpt.store.prune import collect_garbage


@dataclass(frozen=True)
class RemoveResult(JsonResult):
    removed: list[str]  # checkpoint IDs (those a dry run would remove), the members of groups too
    dry_run: bool
    objects_removed: int = 0
    bytes_freed: int = 0
    groups: list[str] = field(default_factory=list)  # group checkpoint IDs

    def to_json(self) -> dict:
        return {"removed": self.removed, "groups": self.groups, "dry_run": self.dry_run,
                "objects_removed": self.objects_removed, "bytes_freed": self.bytes_freed}


def remove(store: Store, refs: list[str], dry_run: bool = False,
           reporter: Reporter = NullReporter()) -> RemoveResult:
    """Resolves every reference first (all or nothing), then removes the manifests and collects
    garbage. A reference to a group removes the group (its manifest first, then its members');
    one to a member of a group that stands is refused: members go with their group only."""
    with store.lock(exclusive=True):
        targets: dict[str, GroupManifest | None] = {}  # ID -> the group, or None for a checkpoint
        for ref in refs:
            group, checkpoint_id = _target(store, ref)
            targets.setdefault(group.id if group else checkpoint_id, group)
        groups = [group for group in targets.values() if group is not None]
        members = {group.id: store.members_of(group) for group in groups}
        removed = [i for target, group in targets.items() for i in (members[target] if group else [target])]
        if dry_run:
            return RemoveResult(removed, dry_run=True, groups=[g.id for g in groups])
        for target, group in targets.items():
            if group is not None:
                store.remove_group(group)
            else:
                store.remove([target])
        phase("rm.removed")
        objects, freed = collect_garbage(store)
    tell_copies_read_again(store, reporter)
    return RemoveResult(removed, dry_run=False, objects_removed=objects, bytes_freed=freed,
                        groups=[g.id for g in groups])


def _target(store: Store, ref: str) -> tuple[GroupManifest | None, str]:
    """(the group ref names, its ID) or (None, the checkpoint ref names); a member is refused."""
    group_id = store.resolve_group(ref)
    if group_id is not None:
        return _group_to_remove(store, group_id), group_id
    checkpoint_id = store.resolve(ref)
    try:
        group = store.group_of_checkpoint(checkpoint_id)
    except (DamagedCheckpoint, StoreError):
        group = None  # a manifest (or its group's) that cannot be read: rm is how it goes
    if group is not None:
        # The name removes the newest group of that name: give it only when that is this one.
        named = group.name if group.name and store.groups.resolve(group.name) == group.id else group.id
        raise UsageError(f"checkpoint {checkpoint_id} is a member of group {group.label}: remove the group "
                         f"with 'ckpt rm {named}'")
    return None, checkpoint_id


def _group_to_remove(store: Store, group_id: str) -> GroupManifest:
    """The group manifest; one that cannot be read goes all the same (verify's hint is rm), with
    the members whose manifests name it."""
    try:
        return store.groups.load(group_id)
    except DamagedCheckpoint:
        finished, unfinished = store.manifests_by_visibility()
        return GroupManifest(id=group_id, created="", members=[
            GroupMember(m.id, m.pid) for m in finished + unfinished if group_of(m) == group_id])
