"""Use case: copy checkpoints to another store, sending only what it lacks (the copying itself:
ckpt/store/transfer.py; docs/design.md, "Copying between stores"), and the copies that
schedules and `ckpt run` with --copy-to still owe."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.settings import Settings, store_from_flag
from ckpt.store.password import PasswordSource
from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.errors import CheckpointNotFound, CkptError, DamagedCheckpoint, StoreError, UsageError
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store, pending
from ckpt.store.fsutil import translate_os_error
from ckpt.store.groups import group_of
from ckpt.store.transfer import CheckpointCopier, CopyResult, GroupCopyResult, location_of, share_seed


@dataclass
class CopyReport:
    source: str
    destination: str
    same_seed: bool
    results: list[CopyResult] = field(default_factory=list)
    groups: list[GroupCopyResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CopyResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def failed_groups(self) -> list[GroupCopyResult]:
        return [g for g in self.groups if g.status == "failed"]

    def to_json(self) -> dict:
        return {"source": self.source, "destination": self.destination, "same_seed": self.same_seed,
                "bytes_sent": sum(r.bytes_sent for r in self.results) + sum(g.bytes_sent for g in self.groups),
                "copied": sum(r.status == "copied" for r in self.results),
                "present": sum(r.status == "present" for r in self.results),
                "failed": len(self.failed),
                "checkpoints": [r.to_json() for r in self.results],
                "groups": [g.to_json() for g in self.groups]}


@dataclass(frozen=True)
class Selection:
    """What a copy copies: checkpoints (the members of its groups among them) and group
    checkpoints, whose manifests go after every member's."""

    checkpoints: list[str]  # IDs, oldest first
    groups: list[str] = field(default_factory=list)  # group IDs, oldest first


def open_destination(spec: str, settings: Settings, passwords: PasswordSource | None = None) -> Store:
    """The store `--to`/`--copy-to` names, made if there is none (as a dump makes its store)."""
    return Store.open(store_from_flag(spec), create=True, settings=settings, passwords=passwords)


def select(store: Store, refs: list[str], all_: bool, name: str | None = None) -> Selection:
    """What to copy: each ref resolved (a group checkpoint's ID, prefix or name: the group with
    its members; a checkpoint's ID, prefix, name: its newest, latest), or every checkpoint and
    group (of that name). A member is copied with its group only; unfinished ones never."""
    if all_ == bool(refs):
        raise UsageError("give checkpoint IDs or names, or --all", hint="e.g. 'ckpt copy latest --to /backup/ckpt'")
    if name is not None and not all_:
        raise UsageError("--name goes with --all", hint="e.g. 'ckpt copy --all --name agent --to /backup/ckpt'")
    if all_:
        return _select_all(store, name)
    checkpoint_ids: set[str] = set()
    group_ids: set[str] = set()
    for ref in refs:
        group_id = store.resolve_group(ref)
        if group_id is not None:
            group_ids.add(group_id)
            checkpoint_ids.update(store.members_of(store.groups.load(group_id)))
        else:
            checkpoint_ids.add(_not_a_member(store, store.resolve(ref)))
    return Selection(sorted(checkpoint_ids), sorted(group_ids))


def _select_all(store: Store, name: str | None) -> Selection:
    groups = {g.id for g in store.groups.all() if name is None or g.name == name}
    manifests = store.manifests()  # what a reader sees: no unfinished member
    return Selection([m.id for m in manifests if (group_of(m) is None and (name is None or m.name == name))
                      or group_of(m) in groups], sorted(groups))


def _not_a_member(store: Store, checkpoint_id: str) -> str:
    """A member alone would be an unfinished member in the destination (hidden, then pruned)."""
    try:
        group = store.group_of_checkpoint(checkpoint_id)
    except (DamagedCheckpoint, StoreError):
        return checkpoint_id  # copy reports it failed
    if group is not None:
        named = group.name if group.name and store.groups.resolve(group.name) == group.id else group.id
        raise UsageError(f"checkpoint {checkpoint_id} is a member of group {group.label}: copy the group with "
                         f"'ckpt copy {named}'")
    return checkpoint_id


def copy(source: Store, dest: Store, checkpoint_ids: list[str], reporter: Reporter = NullReporter(),
         codec: str = "zstd", groups: list[str] | None = None) -> CopyReport:
    """Copies the checkpoints (oldest first) from source to dest under both stores' shared
    locks, then the group checkpoints' manifests (groups: their members are among
    checkpoint_ids), each once all its members are there. A checkpoint damaged in the source
    is reported failed and the others are copied (its group too is then failed); an error of a
    store itself (unreachable, refused, full) stops the copy."""
    where_from, where_to = location_of(source), location_of(dest)
    if where_from == where_to:
        raise UsageError(f"the source and the destination are the same store ({where_from})",
                         hint="give another store with --to")
    try:
        return _copy(source, dest, Selection(checkpoint_ids, list(groups or [])), reporter, codec, where_from,
                     where_to)
    except OSError as exc:
        raise translate_os_error(exc, f"copying to {where_to}") from exc


def _copy(source: Store, dest: Store, selection: Selection, reporter: Reporter, codec: str,
          where_from: str, where_to: str) -> CopyReport:
    on_wait = lambda what: lambda _holders: reporter.info(f"waiting for the lock of the {what} store")  # noqa: E731
    with source.lock(exclusive=False, on_wait=on_wait("source")), dest.lock(exclusive=False,
                                                                            on_wait=on_wait("destination")):
        same_seed = share_seed(source, dest)
        # Read under the locks: an index loaded before them may miss what a dump added since.
        source.blocks.forget_index()
        dest.blocks.forget_index()
        report = CopyReport(where_from, where_to, same_seed)
        copier = CheckpointCopier(source, dest, reporter, codec, same_seed)
        for checkpoint_id in sorted(selection.checkpoints):
            try:
                report.results.append(copier.copy_one(checkpoint_id))
            except (DamagedCheckpoint, CheckpointNotFound) as exc:
                reporter.warn(f"{checkpoint_id} not copied: {exc}")
                report.results.append(CopyResult(checkpoint_id, "failed", error=str(exc)))
        for group_id in sorted(selection.groups):  # last: each group's commit point in the destination
            try:
                report.groups.append(copier.copy_group(group_id))
            except (DamagedCheckpoint, CheckpointNotFound) as exc:
                reporter.warn(f"group {group_id} not copied: {exc}")
                report.groups.append(GroupCopyResult(group_id, "failed", error=str(exc)))
    tell_copies_read_again(source, reporter)
    return report


# ---- pending copies (--copy-to of schedules and `ckpt run`) ------------------------------------


def finish_pending(store: Store, origin: str | None, reporter: Reporter = NullReporter(),
                   passwords: PasswordSource | None = None) -> list[dict]:
    """Copies what the store's pending records (of origin, or all) name, oldest first, and
    deletes each record once its copy has committed. A record whose checkpoint is gone from
    the source (forgotten before it could be copied) is deleted with a warning; a failed copy
    leaves its record (with the error) for the next run. Returns one outcome per record:
    {"id", "to", "status": "copied"/"present"/"gone"/"failed", "bytes_sent", "error"}.
    The destinations are opened with the store's settings and passwords (None: the settings')."""
    outcomes: list[dict] = []
    by_destination: dict[str, list[dict]] = {}
    for record in pending.records(store.root, origin):
        by_destination.setdefault(record["to"], []).append(record)
    for to, recorded in by_destination.items():
        existing = set(store.checkpoint_ids())
        gone = [r for r in recorded if r["id"] not in existing]
        for record in gone:
            reporter.warn(f"checkpoint {record['id']} was removed before it was copied to {to}")
            pending.remove(store.root, record["id"])
            outcomes.append({"id": record["id"], "to": to, "status": "gone", "bytes_sent": 0, "error": None})
        records = [r for r in recorded if r["id"] in existing]
        if not records:
            continue
        try:
            report = copy(store, open_destination(to, store.settings, passwords), [r["id"] for r in records], reporter)
        except (CkptError, OSError) as exc:
            for record in records:
                pending.update(store.root, record, str(exc))
                outcomes.append({"id": record["id"], "to": to, "status": "failed", "bytes_sent": 0,
                                 "error": str(exc)})
            continue
        results = {r.id: r for r in report.results}
        for record in records:
            result = results[record["id"]]
            if result.status == "failed":
                pending.update(store.root, record, result.error or "failed")
            else:
                pending.remove(store.root, record["id"])
            outcomes.append({"id": record["id"], "to": to, "status": result.status,
                             "bytes_sent": result.bytes_sent, "error": result.error})
    return outcomes
