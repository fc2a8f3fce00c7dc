"""`ckpt key`: the passwords of an encrypted store (after restic's `key`).

Each password wraps the same master key in a key file of its own (keys/<id>.json, see
"Encryption" in docs/design.md): adding, removing or changing a password rewrites key files
only, never the data."""

from __future__ import annotations

from dataclasses import asdict

from ckpt.errors import UsageError
from ckpt.store import Store, opening
from ckpt.store.keys import Keyring


def _keyring(store: Store) -> Keyring:
    encryption = opening.find_encryption(store.backend)
    if encryption is None:
        raise UsageError(f"the store at {store.location} is not encrypted, so it has no keys",
                         hint="`ckpt init` makes encrypted stores (remote ones always, local ones with --encrypt)")
    return Keyring(encryption)


def list_keys(store: Store) -> list[dict]:
    keyring = _keyring(store)
    return [{**asdict(key), "current": key.id == keyring.in_use} for key in keyring.list()]


def add_key(store: Store, new_password: bytes) -> str:
    keyring = _keyring(store)
    with store.lock(exclusive=False):
        return keyring.add(new_password)


def remove_key(store: Store, key_id: str) -> str:
    keyring = _keyring(store)
    with store.lock(exclusive=True):
        return keyring.remove(key_id)


def change_password(store: Store, new_password: bytes) -> str:
    keyring = _keyring(store)
    with store.lock(exclusive=True):
        return keyring.change_password(new_password)
