"""Fixtures of the fast use-case tests (tests/commands/test_<verb>.py): stores on the in-memory
backend (ckpt/store/backends/memory.py) and checkpoints committed into them without CRIU,
through the dump's own ingest-and-commit (tests/unit/test_store.py's fake_dump), from images
written as CRIU writes them (pycriu's encoder): a process's mappings, its pagemap, its pages
and its open files. No root, no CRIU, no S3 server."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pytest

from ckpt.store import Manifest, Origin, Store, ids
from ckpt.store.groups import GroupManifest, GroupMember, skew_stats
from ckpt.store.backends.memory import MemoryBackend
from tests.unit.test_store import fake_dump

PAGE = 4096
PID = 4242  # fake_dump's process: every image below is of this PID
FILES_ID = 7
BASE = 0x7f0000000000  # where a built checkpoint's mapping starts


def as_json(result):
    """A use case's result as `--json` prints it: typed results have to_json(), others are
    still plain dicts (or lists of them)."""
    return result.to_json() if hasattr(result, "to_json") else result


def page(label: str | int) -> bytes:
    """A page of known, distinct bytes."""
    return (f"page {label} ".encode() * PAGE)[:PAGE]


@dataclass
class Images:
    """What CRIU leaves of one process (PID): its pages by address, in one mapping from BASE
    of `mapped_pages` pages, and its open files as (fd, path)."""

    pages: dict[int, bytes]
    mapped_pages: int = 16
    open_files: list[tuple[int, str]] = field(default_factory=list)

    def files(self, tmp_path: Path) -> dict[str, bytes]:
        from tests.unit.test_store import pagemap_bytes

        addresses = sorted(self.pages)
        runs = [(address, 1) for address in addresses]
        return {
            "pagemap-4242.img": pagemap_bytes(tmp_path, 1, runs),
            "pages-1.img": b"".join(self.pages[address] for address in addresses),
            "mm-4242.img": _image("MM", [_mm_entry(BASE, BASE + self.mapped_pages * PAGE)]),
            "ids-4242.img": _image("IDS", [{"files_id": FILES_ID, "vm_id": 1, "fs_id": 1, "sighand_id": 1}]),
            "files.img": _image("FILES", [_reg_file(100 + fd, path) for fd, path in self.open_files]),
            f"fdinfo-{FILES_ID}.img": _image("FDINFO", [{"id": 100 + fd, "flags": 0, "type": "REG", "fd": fd}
                                                        for fd, path in self.open_files]),
        }


def _image(magic: str, entries: list[dict]) -> bytes:
    from pycriu import images  # deferred, as ckpt defers it: importing pycriu costs ~0.1 s

    out = io.BytesIO()
    images.dump({"magic": magic, "entries": entries}, out)
    return out.getvalue()


def _mm_entry(start: int, end: int) -> dict:
    fields = ("mm_start_code mm_end_code mm_start_data mm_end_data mm_start_stack mm_start_brk mm_brk "
              "mm_arg_start mm_arg_end mm_env_start mm_env_end").split()
    vma = {"start": start, "end": end, "pgoff": 0, "shmid": 0, "prot": "PROT_READ | PROT_WRITE",
           "flags": "MAP_PRIVATE | MAP_ANON", "status": "VMA_AREA_REGULAR | VMA_ANON_PRIVATE", "fd": -1}
    return {**dict.fromkeys(fields, 0), "exe_file_id": 1, "vmas": [vma]}


def _reg_file(id_: int, path: str) -> dict:
    return {"type": "REG", "id": id_, "reg": {"id": id_, "flags": "O_RDWR", "pos": 0, "name": path,
                                              "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}}}


class Checkpoints:
    """Commits checkpoints into a store, as a dump of PID would: `make(name, images)`."""

    def __init__(self, store: Store, tmp_path: Path):
        self.store = store
        self._scratch = tmp_path / "scratch"
        self._scratch.mkdir(exist_ok=True)

    def make(self, name: str | None = None, images: Images | None = None, codec: str = "zstd") -> Manifest:
        images = images or Images({BASE: page(len(self.store.checkpoint_ids()))})
        return fake_dump(self.store, images.files(self._scratch), name=name, codec=codec)


def memory_store(tmp_path: Path, label: str, **backend_options) -> Store:
    """A Store on a MemoryBackend(**backend_options); its local side (staging, logs) in a
    directory of the test."""
    root = tmp_path / label
    root.mkdir(mode=0o700)
    return Store(root, MemoryBackend(f"memory://{label}", **backend_options), location=f"memory://{label}")


@pytest.fixture
def store(tmp_path) -> Store:
    return memory_store(tmp_path, "mem")


@pytest.fixture
def checkpoints(store, tmp_path) -> Checkpoints:
    return Checkpoints(store, tmp_path)


class Heard:
    """A reporter that keeps what it is told, in order, by kind ("step", "info", "warn")."""

    def __init__(self):
        self.said: list[tuple[str, str]] = []

    def step(self, message: str) -> None:
        self.said.append(("step", message))

    def progress(self, done: int, total: int, what: str) -> None:
        pass

    def info(self, message: str) -> None:
        self.said.append(("info", message))

    def warn(self, message: str) -> None:
        self.said.append(("warn", message))

    def of(self, kind: str) -> list[str]:
        return [message for said_kind, message in self.said if said_kind == kind]


def flip_byte(backend, name: str, at: int) -> None:
    """Damages a blob as a bad disk would: one byte changed, the size the same."""
    data = bytearray(backend.get(name))
    data[at] ^= 0xFF
    backend.put(name, bytes(data))


class Groups:
    """Makes group checkpoints as the coordinator leaves them (docs/design.md, "Groups"): member
    checkpoints committed through the dump's own path (Checkpoints.make), each manifest naming the
    group, then (commit=True) the group manifest, last. commit=False: a group dump that died
    before its commit point (its members unfinished)."""

    def __init__(self, store: Store, checkpoints: Checkpoints):
        self.store = store
        self.checkpoints = checkpoints

    def make(self, name: str | None = "agent", members: int = 2, commit: bool = True,
             hosts: tuple[str, ...] = ("host-a", "host-b")) -> GroupManifest:
        group_id = ids.new_id()
        made = []
        for n in range(members):
            manifest = self.checkpoints.make(name, Images({BASE: page(f"{group_id} member {n}")}))
            manifest.group = {"id": group_id, "name": name}
            manifest.host = hosts[n % len(hosts)]
            self.store.backend.put(Store.manifest_name(manifest.id),
                                   json.dumps(manifest.to_json(), indent=2).encode())
            made.append(manifest)
        start = 1796324462.0
        group = GroupManifest(
            id=group_id, created=datetime.now(timezone.utc).isoformat(), name=name, origin=Origin("dump"),
            members=[GroupMember(checkpoint=m.id, pid=m.pid, command=m.command, host=m.host, hostname=m.host,
                                 frozen_at=start + n * 0.002, dumped_at=start + 0.1, thawed_at=start + 0.15,
                                 freeze_ms=140.0) for n, m in enumerate(made)])
        group.stats = skew_stats(group.members)
        if commit:
            self.store.groups.commit(group)
        time.sleep(0.002)  # the next group's ID sorts after this one's
        return group


@pytest.fixture
def groups(store, checkpoints) -> Groups:
    return Groups(store, checkpoints)
