"""Key files of an encrypted store: the master key, wrapped by keys derived from passwords.

An encrypted store has one random master key (32 bytes) that encrypts everything
(ckpt/store/backends/encrypted.py). It is kept, unencrypted on the inner backend next to the
blobs, as one key file per password under keys/<id>.json: the master key sealed with
AES-256-GCM under a key derived from the password by scrypt. Adding, removing or changing a
password writes or deletes a key file only; no data is encrypted again (like restic's `key`).
See "Encryption" in docs/design.md.

Passwords are bytes and are never logged nor put into messages.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ckpt.errors import KeyNotFound, StoreError, UsageError, WrongPassword
from ckpt.store.backends.base import Backend, BlobExists, BlobInfo, BlobNotFound
from ckpt.store.backends.encrypted import KEY_LEN, MAGIC, EncryptedBackend

KEYS_PREFIX = "keys/"
# scrypt's cost: N=2^15, r=8, p=1 takes 0.13 s and 32 MiB here (N=2^16: 0.26 s). Every
# command opening an encrypted store pays it once per key file it tries.
SCRYPT_N = 1 << 15
SCRYPT_R = 8
SCRYPT_P = 1
SALT_LEN = 16
NONCE_LEN = 12
# Bounds on what a key file may ask for: a planted one must not make ckpt allocate gigabytes
# (scrypt's memory is 128 * r * N bytes; this allows up to 1 GiB).
MAX_N, MAX_R, MAX_P = 1 << 20, 64, 16
_AAD = b"ckpt master key v1"
PASSWORD_HINT = "check CKPT_PASSWORD / --password-file"


@dataclass(frozen=True)
class KdfParams:
    n: int = SCRYPT_N
    r: int = SCRYPT_R
    p: int = SCRYPT_P


@dataclass(frozen=True)
class KeyInfo:
    """A key file, without its secret: what `ckpt key list` shows."""

    id: str
    created: str
    host: str
    user: str
    kdf: str
    n: int
    r: int
    p: int


def _derive(password: bytes, salt: bytes, params: KdfParams) -> bytes:
    return Scrypt(salt=salt, length=KEY_LEN, n=params.n, r=params.r, p=params.p).derive(password)


def _where(inner: Backend) -> str:
    """Where the key files are, for messages (names the store's location)."""
    return inner.where(KEYS_PREFIX.rstrip("/"))


def _key_name(key_id: str) -> str:
    return f"{KEYS_PREFIX}{key_id}.json"


def _check_password(password: bytes) -> None:
    if not isinstance(password, bytes):
        raise TypeError("passwords are bytes")
    if not password:
        raise UsageError("the password is empty", hint="give a non-empty password (CKPT_PASSWORD / --password-file)")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def is_encrypted(inner: Backend) -> bool:
    """Whether the store on this (raw) backend is encrypted: it has key files."""
    return bool(key_files(inner))


def key_files(inner: Backend) -> list[BlobInfo]:
    """The blobs under keys/ (for unlock(listed=...): from S3, one listing for both)."""
    return inner.list(KEYS_PREFIX)


def check_keys_not_lost(inner: Backend) -> None:
    """Refuses a store on this (raw) backend that was encrypted but has lost every key file:
    its store.json, always written through the encryption layer, is then an encrypted blob
    (it starts with the magic of one). Without this check such a store reads as one that is
    not encrypted."""
    if is_encrypted(inner):
        return
    try:
        head = bytes(inner.get("store.json", 0, len(MAGIC)))
    except BlobNotFound:
        return
    if head == MAGIC:
        raise StoreError(f"the store is encrypted but its key files are missing (none in {_where(inner)}): "
                         "nothing in it can be read without one",
                         hint=f"put its key files back into {_where(inner)} from a copy")


def initialize(inner: Backend, password: bytes, params: KdfParams = KdfParams()) -> tuple[EncryptedBackend, str]:
    """Makes the store on `inner` an encrypted one: a new random master key and its first key
    file. Returns the backend to use (blobs through it are encrypted) and the key file's id.
    Refuses a store that has key files already, or unencrypted blobs (store.json)."""
    _check_password(password)
    if is_encrypted(inner):
        raise UsageError(f"the store is encrypted already (it has key files in {_where(inner)})",
                         hint="open it with its password; `ckpt key add` adds another password")
    if inner.exists("store.json"):
        raise UsageError(f"the store at {inner.where('store.json')} exists and is not encrypted",
                         hint="encryption is chosen when a store is created: use a new store and `ckpt copy`")
    master = secrets.token_bytes(KEY_LEN)
    key_id = add_key(inner, master, password, params)
    return EncryptedBackend(inner, master, key_id=key_id), key_id


def add_key(inner: Backend, master: bytes, password: bytes, params: KdfParams = KdfParams()) -> str:
    """Writes a new key file wrapping the master key (EncryptedBackend.master_key) under
    password; returns its id."""
    _check_password(password)
    salt, nonce = os.urandom(SALT_LEN), os.urandom(NONCE_LEN)
    sealed = AESGCM(_derive(password, salt, params)).encrypt(nonce, master, _AAD)
    record = {"version": 1, "kdf": "scrypt", "n": params.n, "r": params.r, "p": params.p,
              "salt": base64.b64encode(salt).decode(),
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "host": socket.gethostname(), "user": _user(),
              "data": base64.b64encode(nonce + sealed).decode()}
    for _attempt in range(3):
        key_id = secrets.token_hex(8)
        try:
            inner.put_if_absent(_key_name(key_id), json.dumps(record, indent=1).encode())
            return key_id
        except BlobExists:
            continue  # 64 random bits taken: draw again
    raise StoreError(f"could not find a free key file name under {_where(inner)}")


def _load(inner: Backend, key_id: str) -> dict:
    """A key file's record; ValueError if it is not one."""
    record = json.loads(inner.get(_key_name(key_id)))
    if not isinstance(record, dict) or record.get("kdf") != "scrypt":
        raise ValueError("not a scrypt key file")
    params = KdfParams(int(record["n"]), int(record["r"]), int(record["p"]))
    if not (1 < params.n <= MAX_N and params.n & (params.n - 1) == 0 and 0 < params.r <= MAX_R
            and 0 < params.p <= MAX_P):
        raise ValueError("scrypt parameters out of range")
    record["params"] = params
    record["salt_bytes"] = base64.b64decode(record["salt"], validate=True)
    record["data_bytes"] = base64.b64decode(record["data"], validate=True)
    return record


def _key_ids(inner: Backend, listed: list[BlobInfo] | None = None) -> list[str]:
    ids = []
    for info in inner.list(KEYS_PREFIX) if listed is None else listed:
        stem = info.name[len(KEYS_PREFIX):]
        if stem.endswith(".json") and "/" not in stem:
            ids.append(stem[:-5])
    return ids


def unlock(inner: Backend, password: bytes, listed: list[BlobInfo] | None = None) -> EncryptedBackend:
    """The encrypted backend of the store on `inner`, its master key unwrapped by the first key
    file the password opens (EncryptedBackend.key_id names it). WrongPassword if none does;
    StoreError if the store has no (readable) key file. listed: key_files(inner), if read."""
    _check_password(password)
    ids = _key_ids(inner, listed)
    if not ids:
        check_keys_not_lost(inner)
        raise StoreError(f"the store is not encrypted (no key files in {_where(inner)})",
                         hint="open it without a password, or check the store's location")
    unreadable = []
    for key_id in ids:
        try:
            record = _load(inner, key_id)
        except BlobNotFound:
            continue  # removed in between
        except (ValueError, KeyError, TypeError):
            unreadable.append(key_id)
            continue
        data = record["data_bytes"]
        try:
            master = AESGCM(_derive(password, record["salt_bytes"], record["params"])).decrypt(
                data[:NONCE_LEN], data[NONCE_LEN:], _AAD)
        except InvalidTag:
            continue
        if len(master) == KEY_LEN:
            return EncryptedBackend(inner, master, key_id=key_id)
    if listed is not None and set(_key_ids(inner)) - set(ids):
        return unlock(inner, password)  # a key file added since the listing (while a password was typed)
    if unreadable and len(unreadable) == len(ids):
        raise StoreError(f"no key file in {_where(inner)} can be read "
                         f"({', '.join(unreadable)})", hint="they are damaged; restore them from a copy")
    also = f" ({len(unreadable)} key file(s) could not be read: {', '.join(unreadable)})" if unreadable else ""
    raise WrongPassword(f"wrong password: no key file in {_where(inner)} opens with it{also}",
                        hint=PASSWORD_HINT)


def list_keys(inner: Backend) -> list[KeyInfo]:
    """The store's key files (unreadable ones left out), oldest first."""
    found = []
    for key_id in _key_ids(inner):
        try:
            record = _load(inner, key_id)
        except (BlobNotFound, ValueError, KeyError, TypeError):
            continue
        params = record["params"]
        found.append(KeyInfo(key_id, str(record.get("created", "")), str(record.get("host", "")),
                             str(record.get("user", "")), "scrypt", params.n, params.r, params.p))
    return sorted(found, key=lambda key: (key.created, key.id))


def _resolve(inner: Backend, key_id: str) -> tuple[str, list[str]]:
    """The full id of key_id (a unique prefix of at least 4 characters will do) and every id."""
    ids = _key_ids(inner)
    if key_id in ids:
        return key_id, ids
    matches = [i for i in ids if len(key_id) >= 4 and i.startswith(key_id)]
    if len(matches) == 1:
        return matches[0], ids
    if matches:
        raise UsageError(f"key id {key_id!r} is ambiguous ({', '.join(matches)})", hint="give more of it")
    raise KeyNotFound(f"the store has no key {key_id!r}", hint="see `ckpt key list`")


def remove_key(inner: Backend, key_id: str, in_use: str | None = None) -> str:
    """Deletes a key file (its password no longer opens the store); returns its full id.
    Never the last one; never in_use (the key that opened the store: unlock with another
    password to remove it, or use change_password)."""
    full, ids = _resolve(inner, key_id)
    if len(ids) <= 1:
        raise UsageError("refusing to remove the store's only key: its data could never be read again",
                         hint="add another key first (`ckpt key add`)")
    if full == in_use:
        raise UsageError(f"refusing to remove key {full}: it is the one this command opened the store with",
                         hint="open the store with another password to remove it, or change this password")
    inner.delete([_key_name(full)])
    return full


def change_password(backend: EncryptedBackend, password: bytes, params: KdfParams = KdfParams()) -> str:
    """Replaces the key file that opened `backend` by one for the new password: the new one is
    written first, then the old one deleted (a crash in between leaves both, never none).
    Returns the new key's id."""
    if backend.key_id is None:
        raise UsageError("this store was opened without a key file", hint="use add_key instead")
    new_id = add_key(backend.inner, backend.master_key, password, params)
    backend.inner.delete([_key_name(backend.key_id)])
    backend.key_id = new_id
    return new_id


class Keyring:
    """The passwords of an opened encrypted store (what `ckpt key` manages): its key files, and
    the one it was opened with. The master key stays inside; callers hold the store's lock."""

    def __init__(self, encryption: EncryptedBackend):
        self._encryption = encryption

    @property
    def in_use(self) -> str | None:
        """The id of the key file the store was opened with."""
        return self._encryption.key_id

    def list(self) -> list[KeyInfo]:
        """The store's key files (unreadable ones left out), oldest first."""
        return list_keys(self._encryption.inner)

    def add(self, password: bytes) -> str:
        """Adds a password (a key file wrapping the same master key); returns its key's id."""
        return add_key(self._encryption.inner, self._encryption.master_key, password)

    def remove(self, key_id: str) -> str:
        """Removes a password (never the one in use, never the last); returns its key's full id."""
        return remove_key(self._encryption.inner, key_id, in_use=self.in_use)

    def change_password(self, password: bytes) -> str:
        """Replaces the password in use by a new one; returns the new key's id."""
        return change_password(self._encryption, password)
