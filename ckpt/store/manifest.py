"""A checkpoint's manifest: what it holds (its image files) and where it comes from.

The manifest is the commit point of a checkpoint (see "Manifests" in docs/design.md): these
classes are its JSON, read and written by the store's facade (ckpt/store/repository.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime

from ckpt.errors import StoreError

FORMAT = 2


@dataclass
class FileEntry:
    """One image file. kind "file": `hash` names an object holding the file. kind "pages": a
    pages-*.img kept in the block store; `hash` names the object holding its page list."""

    name: str
    size: int
    hash: str
    codec: str
    stored_size: int
    kind: str = "file"


@dataclass(frozen=True)
class Origin:
    """Who made a checkpoint (docs/design.md, "Origins"): `ckpt dump` by hand ("dump"), a
    program's ckpt.checkpoint() through a detached dumper ("api"), schedule NAME ("schedule"),
    `ckpt run --name NAME` ("run"), or `ckpt migrate` ("migrate"). The retention of a schedule
    or a run touches only its own."""

    kind: str
    name: str | None = None

    @classmethod
    def from_json(cls, data: object) -> Origin | None:
        """None for a manifest without one (taken before origins were recorded) or with one
        that cannot be read: either is nobody's, never forgotten by a schedule or a run."""
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            return None
        name = data.get("name")
        return cls(data["kind"], name if isinstance(name, str) else None)

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name}

    def describe(self) -> str:
        if self.kind == "dump":
            return "ckpt dump (by hand)"
        if self.kind == "api":
            return "ckpt.checkpoint() of the program"
        if self.kind == "schedule":
            return f"schedule '{self.name}'"
        if self.kind == "run":
            return f"ckpt run --name {self.name}"
        if self.kind == "migrate":
            return "ckpt migrate (the final checkpoint of a move)"
        return f"{self.kind} {self.name or ''}".strip()  # a kind a newer ckpt wrote


@dataclass
class Manifest:
    id: str
    created: str
    pid: int
    command: str
    processes: list[dict]
    files: list[FileEntry]
    name: str | None = None
    # Who made it; None in checkpoints taken before it was recorded.
    origin: Origin | None = None
    host: str = ""
    # The system it was taken on: machine_id, kernel, arch (ckpt.system.procfs.host_facts);
    # empty in checkpoints taken before it was recorded.
    system: dict = field(default_factory=dict)
    criu: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    bytes_total: int = 0
    bytes_stored: int = 0
    # A member of a group checkpoint: {"id": the group's ID, "name": its name or null}; a reader
    # sees the member only once that group's manifest exists (ckpt/store/groups.py).
    group: dict | None = None
    # A dump into a remote store: {"blob": "bundles/<id>", "size": bytes, "spans": {hash:
    # [offset, length]}}, where a copy of each small object is (ckpt/store/bundles.py).
    bundle: dict | None = None
    format: int = FORMAT

    def to_json(self) -> dict:
        data = asdict(self)
        if data["bundle"] is None:
            del data["bundle"]  # (only dumps into a remote store write one)
        # Keep "format" and "id" first so the file reads well.
        return {"format": data.pop("format"), "id": data.pop("id"), **data}

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """The manifest in a manifest file's JSON. Raises KeyError for a missing field, and
        TypeError or ValueError for JSON that is not a manifest (not an object, a field of the
        wrong type): Store.load makes each a DamagedCheckpoint; StoreError for a newer format."""
        if not isinstance(data, dict):
            raise TypeError(f"its JSON is {_json_kind(data)}, not an object")
        if int(data.get("format", 0)) > FORMAT:
            raise StoreError(f"checkpoint {data.get('id')} has format {data['format']}, newer than this ckpt "
                             f"understands ({FORMAT})", hint="upgrade ckpt")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        # Positional, not **kwargs per entry: `ckpt list` reads a thousand manifests of ~20 files.
        kwargs["files"] = [FileEntry(f["name"], f["size"], f["hash"], f["codec"], f["stored_size"],
                                     f.get("kind", "file")) for f in data["files"]]
        kwargs["origin"] = Origin.from_json(data.get("origin"))
        return cls(**kwargs)

    @property
    def created_at(self) -> datetime:
        return datetime.fromisoformat(self.created)

    @property
    def all_pids(self) -> list[int]:
        """Every PID and TID the tree needs on restore."""
        pids: set[int] = set()
        for proc in self.processes:
            pids.add(int(proc["pid"]))
            pids.update(int(t) for t in proc.get("threads", []))
        return sorted(pids)


def _json_kind(data: object) -> str:
    """What a JSON value is, in JSON's words."""
    if data is None:
        return "null"
    if isinstance(data, bool):
        return "a boolean"
    if isinstance(data, (int, float)):
        return "a number"
    if isinstance(data, str):
        return "a string"
    return "an array" if isinstance(data, list) else type(data).__name__
