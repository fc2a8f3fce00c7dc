"""Use case: recompute the hashes of one checkpoint, of a group checkpoint's members, or of
all of them (and check that every group still has every member)."""

from __future__ import annotations

from ckpt.errors import CheckpointNotFound, DamagedCheckpoint, StoreError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.groups import GroupManifest, group_of
from ckpt.store.staging import discard
from ckpt.store.verify import verify as verify_checkpoint


def verify(store: Store, ref: str | None, reporter: Reporter = NullReporter()) -> list[dict]:
    """One result per checkpoint: {"id", "files", "problems": [...]} (no problems: intact).
    ref None: every checkpoint a reader sees, then every group (a group with a member missing
    is one result under the group's ID). ref naming a group: its members, each verified."""
    store = store.uncached()  # a remote store's own bytes, not the local cache's copies
    with store.lock(exclusive=False):
        if ref is None:
            return _verify_all(store, reporter)
        group_id = store.resolve_group(ref)
        if group_id is not None:
            return _verify_group(store, store.groups.load(group_id), reporter)
        return [_verify_one(store, store.resolve(ref), reporter)]


def _verify_one(store: Store, checkpoint_id: str, reporter: Reporter) -> dict:
    try:
        manifest = store.load(checkpoint_id)
    except DamagedCheckpoint as exc:
        return {"id": checkpoint_id, "files": 0, "problems": [exc.message]}
    reporter.step(f"verifying {checkpoint_id}")
    if not store.objects.remote:
        problems = verify_checkpoint(store.objects, manifest, reporter)
    else:
        # A remote store's segments come down ahead, in large parallel requests, into a spool here.
        work = store.staging_area().new_dir("verify")
        try:
            problems = verify_checkpoint(store.objects, manifest, reporter, spool_dir=work / "spool")
        finally:
            discard(work)
    return {"id": checkpoint_id, "files": len(manifest.files), "problems": problems}


def _verify_all(store: Store, reporter: Reporter) -> list[dict]:
    """Every checkpoint a reader sees (unfinished members are prune's), then every group."""
    results = []
    visibility = store.visibility()
    for checkpoint_id in store.checkpoint_ids():
        try:
            seen = visibility.finished(store.load(checkpoint_id))
        except CheckpointNotFound:
            continue  # removed since the listing
        except (DamagedCheckpoint, StoreError):
            seen = True  # said by _verify_one
        if seen:
            results.append(_verify_one(store, checkpoint_id, reporter))
    damaged_groups: list[dict] = []
    present = set(store.checkpoint_ids())
    for group in store.groups.all(on_damaged=lambda group_id, exc: damaged_groups.append(
            {"id": group_id, "files": 0, "problems": [str(exc)]})):
        problems = _group_problems(store, group, present)
        if problems:
            results.append({"id": group.id, "files": 0, "problems": problems})
    return results + damaged_groups


def _verify_group(store: Store, group: GroupManifest, reporter: Reporter) -> list[dict]:
    """The group's own problems (a member missing, or naming another group) under its ID, then
    each member there, verified."""
    present = set(store.checkpoint_ids())
    problems = _group_problems(store, group, present)
    results = [{"id": group.id, "files": 0, "problems": problems}] if problems else []
    return results + [_verify_one(store, checkpoint_id, reporter) for checkpoint_id in group.checkpoint_ids
                      if checkpoint_id in present]


def _group_problems(store: Store, group: GroupManifest, present: set[str]) -> list[str]:
    """What makes a group checkpoint less than whole: a member's manifest missing (not among
    present, the store's checkpoint IDs), or naming another group (a member that cannot be read
    is its own result)."""
    problems = []
    for checkpoint_id in group.checkpoint_ids:
        if checkpoint_id not in present:
            problems.append(f"group {group.label}: the manifest of its member {checkpoint_id} is missing")
            continue
        try:
            named = group_of(store.load(checkpoint_id))
        except (DamagedCheckpoint, StoreError, CheckpointNotFound):
            continue
        if named != group.id:
            problems.append(f"group {group.label}: its member {checkpoint_id} names "
                            + (f"group {named}" if named else "no group") + " in its manifest")
    return problems
