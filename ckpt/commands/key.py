"""`ckpt key`: the passwords of an encrypted store (after restic's `key`).

Each password wraps the same master key in a key file of its own (keys/<id>.json, see
"Encryption" in docs/design.md): adding, removing or changing a password rewrites key files
only, never the data."""

from __future__ import annotations

from dataclasses import asdict

from ckpt.errors import UsageError
from ckpt.store import Store, keys
from ckpt.store.backends.encrypted import EncryptedBackend


def _encrypted(store: Store) -> EncryptedBackend:
    if not isinstance(store.encryption, EncryptedBackend):
        raise UsageError(f"the store at {store.location} is not encrypted, so it has no keys",
                         hint="`ckpt init` makes encrypted stores (remote ones always, local ones with --encrypt)")
    return store.encryption


def list_keys(store: Store) -> list[dict]:
    backend = _encrypted(store)
    return [{**asdict(key), "current": key.id == backend.key_id} for key in keys.list_keys(backend.inner)]


def add_key(store: Store, new_password: bytes) -> str:
    backend = _encrypted(store)
    with store.lock(exclusive=False):
        return keys.add_key(backend.inner, backend.master_key, new_password)


def remove_key(store: Store, key_id: str) -> str:
    backend = _encrypted(store)
    with store.lock(exclusive=True):
        return keys.remove_key(backend.inner, key_id, in_use=backend.key_id)


def change_password(store: Store, new_password: bytes) -> str:
    backend = _encrypted(store)
    with store.lock(exclusive=True):
        return keys.change_password(backend, new_password)
