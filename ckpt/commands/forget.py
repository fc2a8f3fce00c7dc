"""Use case: forget checkpoints by a retention policy, optionally reclaiming their space."""

from __future__ import annotations

from datetime import datetime, timezone

from ckpt.errors import UsageError
from ckpt.phases import phase
from ckpt.schedule.retention import Item, Policy, apply_policy, emptied_groups
from ckpt.store import Manifest, Store
from ckpt.store.prune import collect_garbage


def group_of(manifest: Manifest) -> str:
    """Checkpoints are grouped by name; unnamed ones by the command line of their target."""
    return manifest.name or f"command: {manifest.command}"


def forget(store: Store, policy: Policy, name: str | None = None, prune: bool = False, dry_run: bool = False,
           allow_remove_all: bool = False, now: datetime | None = None) -> dict:
    """Plans with the policy, refuses to empty a group unless allowed, then removes."""
    if policy.empty():
        raise UsageError("no retention rule given",
                         hint="give at least one of --keep-last, --keep-within, --keep-hourly, --keep-daily, "
                              "--keep-weekly")
    now = now or datetime.now(timezone.utc)
    with store.lock(exclusive=True):
        manifests = [m for m in store.manifests() if name is None or m.name == name]
        decisions = apply_policy([Item(m.id, group_of(m), m.created_at) for m in manifests], policy, now)
        emptied = emptied_groups(decisions)
        if emptied and not allow_remove_all:
            raise UsageError(f"the policy would remove every checkpoint of {', '.join(repr(g) for g in emptied)}",
                             hint="loosen the policy, or pass --allow-remove-all if that is what you want")
        to_remove = [d.id for d in decisions if not d.keep]
        freed = objects = 0
        if not dry_run:
            phase("forget.planned")
            store.remove(to_remove, on_removed=lambda _id: phase("forget.removing"))
            if prune:
                objects, freed = collect_garbage(store)
    return {
        "policy": policy.to_json(),
        "dry_run": dry_run,
        "keep": [{"id": d.id, "group": d.group, "reasons": d.reasons} for d in decisions if d.keep],
        "remove": [{"id": d.id, "group": d.group} for d in decisions if not d.keep],
        "pruned": prune and not dry_run,
        "objects_removed": objects,
        "bytes_freed": freed,
    }
