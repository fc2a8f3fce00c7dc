"""Group checkpoints: one consistent checkpoint of several process trees (docs/design.md,
"Groups"). Each member is an ordinary checkpoint whose manifest names its group; the group
manifest, groups/<id>.json, names every member and is the group's commit point: written once,
last, after every member's manifest is durable. A member whose group manifest does not exist
(a group checkpoint that failed, or is still being taken) is not there for any reader but
prune, which removes it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ckpt.errors import CheckpointNotFound, CkptError, DamagedCheckpoint, StoreError
from ckpt.store import ids
from ckpt.store.backends import Backend, BlobExists, BlobNotFound
from ckpt.store.manifest import Manifest, Origin

GROUPS_PREFIX = "groups/"
GROUP_FORMAT = 1


@dataclass
class GroupMember:
    """One member of a group checkpoint: its checkpoint, where and of what it was taken, and
    when (seconds since the epoch, by the member host's clock) it was frozen and let go."""

    checkpoint: str
    pid: int
    command: str = ""
    host: str = ""  # as the user named it (host-a of host-a:PID); "" on the coordinator's host
    hostname: str = ""  # the member host's own name (its manifest's host)
    frozen_at: float = 0.0  # CRIU's pre-dump notification: just before the freeze
    dumped_at: float = 0.0  # CRIU's post-dump notification: frozen and dumped, held
    thawed_at: float = 0.0  # released: thawed (ended with --stop)
    freeze_ms: float | None = None  # CRIU's own measure of the member's freeze

    @classmethod
    def from_json(cls, data: dict) -> GroupMember:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class GroupManifest:
    id: str
    created: str
    members: list[GroupMember]
    name: str | None = None
    origin: Origin | None = None
    stopped: bool = False  # --stop: every member was ended once the group was committed
    # The span from the first member's freeze to the last member's thaw (ms), and from the first
    # freeze to the last (the skew of the cut): see "Freeze skew" in docs/design.md.
    stats: dict = field(default_factory=dict)
    format: int = GROUP_FORMAT

    def to_json(self) -> dict:
        data = asdict(self)
        data["origin"] = self.origin.to_json() if self.origin else None
        return {"format": data.pop("format"), "id": data.pop("id"), **data}

    @classmethod
    def from_json(cls, data: object) -> GroupManifest:
        if not isinstance(data, dict):
            raise TypeError("its JSON is not an object")
        if int(data.get("format", 0)) > GROUP_FORMAT:
            raise StoreError(f"group {data.get('id')} has format {data['format']}, newer than this ckpt "
                             f"understands ({GROUP_FORMAT})", hint="upgrade ckpt")
        members = [GroupMember.from_json(m) for m in data["members"]]
        return cls(id=data["id"], created=data["created"], members=members, name=data.get("name"),
                   origin=Origin.from_json(data.get("origin")), stopped=bool(data.get("stopped", False)),
                   stats=dict(data.get("stats") or {}), format=int(data.get("format", GROUP_FORMAT)))

    @property
    def checkpoint_ids(self) -> list[str]:
        return [m.checkpoint for m in self.members]

    @property
    def hosts(self) -> list[str]:
        """The hosts its members were taken on (their own names), each once, in member order."""
        return list(dict.fromkeys(m.hostname or m.host or "(this host)" for m in self.members))

    @property
    def label(self) -> str:
        """How messages name it: 'agent (ID)', or its ID alone when it has no name."""
        return f"{self.name} ({self.id})" if self.name else self.id


def skew_stats(members: list[GroupMember]) -> dict:
    """What a group checkpoint records of its cut: from the first freeze to the last (the skew),
    and to the last thaw (how long some member was frozen while the group was taken)."""
    if not members:
        return {}
    first_freeze = min(m.frozen_at for m in members)
    return {"freeze_skew_ms": round((max(m.frozen_at for m in members) - first_freeze) * 1000, 1),
            "span_ms": round((max(m.thawed_at for m in members) - first_freeze) * 1000, 1),
            "longest_freeze_ms": round(max(m.thawed_at - m.frozen_at for m in members) * 1000, 1)}


def group_of(manifest: Manifest) -> str | None:
    """The ID of the group a member checkpoint belongs to (None: not a member)."""
    group = manifest.group
    if isinstance(group, dict) and isinstance(group.get("id"), str) and ids.is_id(group["id"]):
        return group["id"]
    return None


class Visibility:
    """Which member checkpoints a reader sees: those whose group manifest exists (docs/design.md,
    "Visibility"). groups/ is listed once, when the first member is met: reading a store
    without groups costs nothing more, and one with groups one listing, not a read per member."""

    def __init__(self, groups: Groups):
        self._groups = groups
        self._group_ids: set[str] | None = None

    def finished(self, manifest: Manifest) -> bool:
        """True for a plain checkpoint and for a member whose group is committed."""
        group_id = group_of(manifest)
        if group_id is None:
            return True
        if self._group_ids is None:
            self._group_ids = set(self._groups.ids())
        return group_id in self._group_ids


def listed_ids(backend: Backend, prefix: str) -> list[str]:
    """The IDs of the `<prefix><id>.json` blobs (manifests, group manifests), sorted (oldest
    first): one listing, nothing read."""
    found = (info.name[len(prefix):-5] for info in backend.list(prefix) if info.name.endswith(".json"))
    return sorted(i for i in found if ids.is_id(i))


def read_json(backend: Backend, name: str, missing: str, what: str, blob: bytes | None = None) -> object:
    """A manifest blob's JSON (blob: its bytes, if read already): CheckpointNotFound ("no
    <missing>") when it is not there, DamagedCheckpoint ("<what> <where> is not valid JSON")
    when it cannot be parsed."""
    try:
        return json.loads(read_blob(backend, name, missing) if blob is None else blob)
    except ValueError as exc:
        raise DamagedCheckpoint(f"{what} {backend.where(name)} is not valid JSON ({exc})") from exc


def read_blob(backend: Backend, name: str, missing: str) -> bytes:
    """A manifest blob's bytes; CheckpointNotFound ("no <missing>") when it is not there."""
    try:
        return backend.get(name)
    except BlobNotFound:
        raise CheckpointNotFound(f"no {missing}", hint="see 'ckpt list'") from None


class Groups:
    """The group manifests of a store (Store.groups), read and written through its backend."""

    def __init__(self, backend: Backend):
        self.backend = backend

    @staticmethod
    def blob_name(group_id: str) -> str:
        return f"{GROUPS_PREFIX}{ids.check_id(group_id)}.json"

    def ids(self) -> list[str]:
        return listed_ids(self.backend, GROUPS_PREFIX)

    def load(self, group_id: str) -> GroupManifest:
        name = self.blob_name(group_id)
        data = read_json(self.backend, name, f"group checkpoint with ID {group_id}", f"group {group_id}:")
        try:
            return GroupManifest.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise DamagedCheckpoint(f"group {group_id}: {self.backend.where(name)} is not a group manifest "
                                    f"({exc})") from exc

    def all(self, on_damaged=None) -> list[GroupManifest]:
        """Every readable group manifest, oldest first; on_damaged(id, error) hears of the others."""
        result = []
        for group_id in self.ids():
            try:
                result.append(self.load(group_id))
            except (DamagedCheckpoint, StoreError, CheckpointNotFound) as exc:
                if on_damaged:
                    on_damaged(group_id, exc)
        return result

    def commit(self, group: GroupManifest) -> None:
        """The group's commit point: written once (never replaced), after every member's manifest."""
        data = json.dumps(group.to_json(), indent=2).encode() + b"\n"
        try:
            self.backend.put_if_absent(self.blob_name(group.id), data)
        except BlobExists:
            raise StoreError(f"a group checkpoint with ID {group.id} already exists",
                             hint="take the group checkpoint again: it gets another ID") from None

    def remove(self, group_id: str) -> None:
        """Removes the group manifest: its members become unfinished (removed by rm or prune)."""
        self.backend.delete([self.blob_name(group_id)])

    def resolve(self, ref: str) -> str | None:
        """The group a reference names (its ID, a unique prefix of one, or a name: the newest
        group of that name), or None when it names no group (then it may name a checkpoint)."""
        try:
            kind = ids.classify_reference(ref)
        except CkptError:
            return None
        if kind == "latest":
            return None  # 'latest' is the newest checkpoint; a group is named
        all_ids = self.ids()
        if kind == "id":
            return ref if ref in all_ids else None
        if kind == "prefix":
            matches = [i for i in all_ids if i.startswith(ref)]
            if len(matches) > 1:
                raise CheckpointNotFound(f"'{ref}' matches {len(matches)} group checkpoints",
                                         hint="give more of the ID")
            return matches[0] if matches else None
        named = [g.id for g in self.all() if g.name == ref]
        return named[-1] if named else None
