"""`ckpt init`: creates a store, local or remote, and says what it created.

A remote store (s3://) is always encrypted; a local one is encrypted when asked (--encrypt).
`ckpt dump` still creates a plain local store by itself, as before: init is what a store that
needs a password, or lives in a bucket, starts with.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ckpt.settings import Settings, StoreLocation, is_remote
from ckpt.errors import StoreError, UsageError
from ckpt.store import Store, opening
from ckpt.store.password import PasswordSource


@dataclass
class InitResult:
    location: str
    encrypted: bool
    key_id: str | None
    local_dir: str

    def to_json(self) -> dict:
        return {"store": self.location, "encrypted": self.encrypted, "key": self.key_id,
                "local_dir": self.local_dir}


def init(location: StoreLocation, settings: Settings, passwords: PasswordSource | None = None,
         encrypt: bool = False) -> InitResult:
    """Makes the store at location (an s3:// store is always encrypted); the new password comes
    from passwords (None: the settings', CKPT_PASSWORD or CKPT_PASSWORD_FILE)."""
    from ckpt.store import keys
    from ckpt.store.repository import FORMAT, STORE_META

    passwords = PasswordSource.passed_or_settings(passwords, settings)
    meta = json.dumps({"format": FORMAT, "created": datetime.now(timezone.utc).isoformat()}).encode()
    if is_remote(location):
        from ckpt.store.backends.s3 import S3Backend

        url = str(location)
        remote = S3Backend.from_url(url, timeout=settings.s3_timeout)
        existing = [info.name for info in remote.list("")][:1]
        if existing:
            what = "a ckpt store" if existing[0] in (STORE_META,) or existing[0].startswith("keys/") else "objects"
            raise UsageError(f"{url} already holds {what} ({existing[0]})",
                             hint="choose another prefix (s3://BUCKET/PREFIX), or use the store that is there")
        backend, key_id = keys.initialize(remote, passwords.password_for(url, confirm=True))
        backend.put_if_absent(STORE_META, meta)  # last: the store exists once this is there
        return InitResult(url, True, key_id, str(opening.local_side(url, settings.cache)))
    root = Path(location)
    if os.path.lexists(root / STORE_META):
        raise UsageError(f"{root} is already a ckpt store", hint="use it as it is, or choose another directory")
    if not encrypt:
        store = Store.open_local(root, create=True, settings=settings)
        return InitResult(str(store.root), False, None, str(store.root))
    store = Store.open_local(root, create=True, password=passwords.password_for(str(root), confirm=True),
                             settings=settings)
    from ckpt.store.backends import LocalBackend

    key_ids = [key.id for key in keys.list_keys(LocalBackend(store.root))]
    if not key_ids:
        raise StoreError(f"creating the encrypted store at {root} left no key")
    return InitResult(str(store.root), True, key_ids[0], str(store.root))
