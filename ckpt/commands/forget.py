"""Use case: forget checkpoints by a retention policy, optionally reclaiming their space."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.commands.results import JsonResult
from ckpt.errors import UsageError
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.schedule.retention import Decision, Item, Policy, apply_policy, emptied_groups
from ckpt.store import Manifest, Origin, Store
from ckpt.store.groups import GroupManifest, group_of
from ckpt.store.prune import collect_garbage


def series_of(manifest: Manifest) -> str:
    """Checkpoints are judged in series by name; unnamed ones by the command line of their target."""
    return manifest.name or f"command: {manifest.command}"


def group_series(group: GroupManifest) -> str:
    """Group checkpoints are judged apart from plain ones: by their name, unnamed ones by their
    members' command lines."""
    return f"group: {group.name}" if group.name else f"group of: {' + '.join(m.command for m in group.members)}"


@dataclass(frozen=True)
class ForgetResult(JsonResult):
    policy: Policy
    dry_run: bool
    decisions: list[Decision]  # every checkpoint and group judged: kept (with the rules that keep it) or not
    pruned: bool
    objects_removed: int
    bytes_freed: int
    members: dict[str, list[str]] = field(default_factory=dict)  # group ID -> its members' checkpoint IDs

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
            "keep": [{"id": d.id, "group": d.group, "reasons": d.reasons, **self._members(d)} for d in self.kept],
            "remove": [{"id": d.id, "group": d.group, **self._members(d)} for d in self.removed],
            "pruned": self.pruned,
            "objects_removed": self.objects_removed,
            "bytes_freed": self.bytes_freed,
        }

    def _members(self, decision: Decision) -> dict:
        return {"members": self.members[decision.id]} if decision.id in self.members else {}


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
        items, groups = _judged(store, name, origin)
        decisions = apply_policy(items, policy, now)
        emptied = emptied_groups(decisions)
        if emptied and not allow_remove_all:
            raise UsageError(f"the policy would remove every checkpoint of {', '.join(repr(g) for g in emptied)}",
                             hint="loosen the policy, or pass --allow-remove-all if that is what you want")
        members = {group.id: store.members_of(group) for group in groups.values()}
        freed = objects = 0
        if not dry_run:
            phase("forget.planned")
            _remove(store, [d.id for d in decisions if not d.keep], groups)
            if prune:
                objects, freed = collect_garbage(store)
                tell_copies_read_again(store, reporter)
    _report(decisions, policy, dry_run, members, reporter)
    return ForgetResult(policy, dry_run, decisions, pruned=prune and not dry_run, objects_removed=objects,
                        bytes_freed=freed, members=members)


def _judged(store: Store, name: str | None, origin: Origin | None) -> tuple[list[Item], dict[str, GroupManifest]]:
    """What retention judges (of that name and origin): each plain checkpoint, and each group
    checkpoint as one item (its name, its time); a member is never judged alone."""
    plain = [m for m in store.manifests() if group_of(m) is None and (name is None or m.name == name)
             and (origin is None or m.origin == origin)]
    groups = {g.id: g for g in store.groups.all() if (name is None or g.name == name)
              and (origin is None or g.origin == origin)}
    items = [Item(m.id, series_of(m), m.created_at) for m in plain]
    items += [Item(g.id, group_series(g), datetime.fromisoformat(g.created)) for g in groups.values()]
    return sorted(items, key=lambda item: (item.created, item.id)), groups


def _remove(store: Store, forgotten: list[str], groups: dict[str, GroupManifest]) -> None:
    """Each forgotten checkpoint; each forgotten group whole: its group manifest, then its members."""
    for forgotten_id in forgotten:
        if forgotten_id in groups:
            store.remove_group(groups[forgotten_id], on_removed=lambda _id: phase("forget.removing"))
        else:
            store.remove([forgotten_id], on_removed=lambda _id: phase("forget.removing"))


SHOWN_IDS = 5


def _report(decisions: list[Decision], policy: Policy, dry_run: bool, members: dict[str, list[str]],
            reporter: Reporter) -> None:
    """'forgot 2 checkpoints of 'agent' (keep-last 3): ID, ID', and for group checkpoints
    'forgot 1 group checkpoint of 'group: agent' (keep-last 1), with its 3 members: ID':
    nothing is removed unsaid."""
    removed: dict[str, list[str]] = {}
    for d in decisions:
        if not d.keep:
            removed.setdefault(d.group, []).append(d.id)
    for series, gone in removed.items():
        shown = ", ".join(gone[:SHOWN_IDS]) + (f" and {len(gone) - SHOWN_IDS} more" if len(gone) > SHOWN_IDS else "")
        kind = "group checkpoint" if gone[0] in members else "checkpoint"
        with_members = sum(len(members[i]) for i in gone if i in members)
        reporter.info(f"{'would forget' if dry_run else 'forgot'} {len(gone)} {kind}{'s' * (len(gone) != 1)} "
                      f"of '{series}' ({policy.flags()})"
                      + (f", with their {with_members} member checkpoint(s)" if kind != "checkpoint" else "")
                      + f": {shown}")
