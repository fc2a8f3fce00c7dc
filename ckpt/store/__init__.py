"""The checkpoint store (see docs/design.md). Standard library plus hashing/compression only."""

from ckpt.store.repository import Store, FileEntry, Manifest

__all__ = ["Store", "FileEntry", "Manifest"]
