"""The checkpoint store (see docs/design.md). Standard library plus hashing/compression only.

Store (repository.py) is the facade; opening.py opens a location into a backend stack
(OpenedStore), objects.py, ingest.py, materialize.py and verify.py do the work on objects,
keys.py manages passwords (Keyring), password.py says where they come from (PasswordSource).

Store, FileEntry, Manifest and Origin are imported on first use: ckpt.store.ids (what a program's
ckpt.checkpoint() needs) must not pay for the repository's imports (~0.2 s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt.store.repository import FileEntry, Manifest, Origin, Store

__all__ = ["Store", "FileEntry", "Manifest", "Origin"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ckpt.store import repository

        return getattr(repository, name)
    raise AttributeError(f"module 'ckpt.store' has no attribute {name!r}")
