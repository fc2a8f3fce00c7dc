"""Use case: the checkpoints in the store, oldest first, with the lazy restores of each that
failed (each also said as a warning), and the group checkpoint each member belongs to."""

from __future__ import annotations

from pathlib import Path

from ckpt.commands.clone import running_copies
from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazywatch import describe, failures
from ckpt.errors import CheckpointNotFound, DamagedCheckpoint, StoreError
from ckpt.store import Manifest, Store
from ckpt.store.groups import GroupManifest, group_of
from ckpt.store.repository import did_you_mean


def list_checkpoints(store: Store, name: str | None = None, reporter: Reporter = NullReporter(),
                     copies_dir: Path | None = None) -> list[dict]:
    """One row a checkpoint, in the shape of `ckpt list --json` (docs/json.md); a member of a
    group checkpoint says which (`group`: its summary). A manifest that cannot be read, and a
    lazy restore whose page server died, are reported as warnings. name: the checkpoints of
    that name, and the members of the groups of that name. copies_dir: where the registries
    of clones are (`running_copies`: the copies of each checkpoint still running; none
    without it)."""
    running = running_copies(copies_dir) if copies_dir is not None else {}
    manifests = store.manifests(on_damaged=lambda _id, error: reporter.warn(str(error)))
    groups = _groups_of(store, manifests, reporter)
    if name:
        manifests = [m for m in manifests if m.name == name or _group_name(m, groups) == name]
    lost = {m.id: failures(store.logs_root / m.id) for m in manifests}
    for records in lost.values():
        for failure in records:
            reporter.warn(f"{describe(failure)} ({failure.get('time', '?')})")
    return [{
        "id": m.id, "name": m.name, "origin": m.origin.to_json() if m.origin else None,
        "created": m.created, "pid": m.pid, "command": m.command,
        "processes": len(m.processes), "bytes_total": m.bytes_total, "bytes_stored": m.bytes_stored,
        "lazy_restore_failures": len(lost[m.id]),
        "group": _summary(groups[group_id]) if (group_id := group_of(m)) in groups else None,
        "running_copies": running.get(m.id, []),
    } for m in manifests]


def _groups_of(store: Store, manifests: list[Manifest], reporter: Reporter) -> dict[str, GroupManifest]:
    """The group manifests the members among manifests name (one read per group, not per member)."""
    groups = {}
    for group_id in dict.fromkeys(g for m in manifests if (g := group_of(m)) is not None):
        try:
            groups[group_id] = store.groups.load(group_id)
        except (DamagedCheckpoint, StoreError, CheckpointNotFound) as exc:
            reporter.warn(str(exc))
    return groups


def _group_name(manifest: Manifest, groups: dict[str, GroupManifest]) -> str | None:
    group = groups.get(group_of(manifest) or "")
    return group.name if group else None


def _summary(group: GroupManifest) -> dict:
    """What `list` says of a member's group (docs/json.md, `group-summary`)."""
    return {"id": group.id, "name": group.name, "created": group.created, "members": len(group.members),
            "hosts": group.hosts, "stats": group.stats}


def absent_name(store: Store, name: str, shown: int = 10) -> str:
    """Why `ckpt list --name NAME` found nothing, in words: what the store holds instead (its
    checkpoints, their names, those NAME may be a typo of)."""
    manifests = store.manifests()
    if not manifests:
        return "no checkpoints in the store yet: create one with 'ckpt dump PID'"
    names = sorted({m.name for m in manifests if m.name})
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    hint = did_you_mean(name, names)
    return (f"no checkpoint named '{name}' (the store holds {len(manifests)}; "
            + (f"names: {listed}" if names else "none has a name") + ")"
            + (f"; {hint}" if hint.startswith("did you mean") else ""))
