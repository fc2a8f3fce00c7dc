"""Use case: forget checkpoints by a retention policy, optionally reclaiming their space."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.commands.results import JsonResult
from ckpt.errors import UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.schedule.retention import Decision, Item, Policy, apply_policy, emptied_groups
from ckpt.store import Manifest, Origin, Store
from ckpt.store.prune import collect_garbage


def group_of(manifest: Manifest) -> str:
    """Checkpoints are grouped by name; unnamed ones by the command line of their target."""
    return manifest.name or f"command: {manifest.command}"


@dataclass(frozen=True)
class ForgetResult(JsonResult):
    policy: Policy
    dry_run: bool
    decisions: list[Decision]  # every checkpoint judged: kept (with the rules that keep it) or not
    pruned: bool
    objects_removed: int
    bytes_freed: int

    @property
    def kept(self) -> list[Decision]:
        return [d for d in self.decisions if d.keep]

    @property
    def removed(self) -> list[Decision]:
        return [d for d in self.decisions if not d.keep]

    def to_json(self) -> dict:
        return {
            "policy": self.policy.to_json(),
            "dry_run": self.dry_run,
            "keep": [{"id": d.id, "group": d.group, "reasons": d.reasons} for d in self.kept],
            "remove": [{"id": d.id, "group": d.group} for d in self.removed],
            "pruned": self.pruned,
            "objects_removed": self.objects_removed,
            "bytes_freed": self.bytes_freed,
        }


def forget(store: Store, policy: Policy, name: str | None = None, prune: bool = False,  # noqa: PLR0913
           dry_run: bool = False, allow_remove_all: bool = False, now: datetime | None = None,
           origin: Origin | None = None, reporter: Reporter = NullReporter()) -> ForgetResult:
    """Plans with the policy, refuses to empty a group unless allowed, then removes.

    origin: only the checkpoints that origin made are judged (the retention of a schedule or of
    `ckpt run`); the others, and those of no recorded origin, are not even seen. What was
    removed is told to the reporter, a line per group."""
    if policy.empty():
        raise UsageError("no retention rule given",
                         hint="give at least one of --keep-last, --keep-within, --keep-hourly, --keep-daily, "
                              "--keep-weekly")
    now = now or datetime.now(timezone.utc)
    with store.lock(exclusive=True):
        manifests = [m for m in store.manifests() if (name is None or m.name == name)
                     and (origin is None or m.origin == origin)]
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
                tell_copies_read_again(store, reporter)
    _report(decisions, policy, dry_run, reporter)
    return ForgetResult(policy, dry_run, decisions, pruned=prune and not dry_run, objects_removed=objects,
                        bytes_freed=freed)


SHOWN_IDS = 5


def _report(decisions: list[Decision], policy: Policy, dry_run: bool, reporter: Reporter) -> None:
    """'forgot 2 checkpoints of 'agent' (keep-last 3): ID, ID': nothing is removed unsaid."""
    removed: dict[str, list[str]] = {}
    for d in decisions:
        if not d.keep:
            removed.setdefault(d.group, []).append(d.id)
    for group, gone in removed.items():
        shown = ", ".join(gone[:SHOWN_IDS]) + (f" and {len(gone) - SHOWN_IDS} more" if len(gone) > SHOWN_IDS else "")
        reporter.info(f"{'would forget' if dry_run else 'forgot'} {len(gone)} checkpoint{'s' * (len(gone) != 1)} "
                      f"of '{group}' ({policy.flags()}): {shown}")
