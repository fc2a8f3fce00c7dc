"""Opening a store: from a location (a directory or an s3:// URL) to the stack of backends every
byte then goes through, and the facts the store needs about it (restic's model: opening a
location, its config and its key is a step of its own; ckpt/store/repository.py is the facade
over what is opened).

The stack, outermost first: the cache of a remote store's immutable blobs (backends/cache.py),
the encryption (backends/encrypted.py, unlocked with a password from a PasswordSource), and
the location itself (backends/local.py or backends/s3.py). On the way: the trust checks (a
store others can write is refused), the format check (store.json), and the local side of a
remote store (its staging, CRIU's logs and schedules, under the cache directory).

Every value that comes from the settings is a parameter: nothing here looks them up.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.errors import CheckpointNotFound, PermissionProblem, StoreError, UsageError
from ckpt.settings import Settings, StoreLocation, is_remote
from ckpt.store.backends import Backend, BlobNotFound, LocalBackend
from ckpt.store.fsutil import check_safe_ancestors, check_trusted_dir, translate_os_error
from ckpt.store.manifest import FORMAT
from ckpt.store.password import PasswordSource
from ckpt.system.files import DIR_MODE, make_private_dir

if TYPE_CHECKING:  # imported when needed: the encryption's (cryptography) costs a plain store's commands
    from ckpt.store.backends.cache import CachingBackend
    from ckpt.store.backends.encrypted import EncryptedBackend

STORE_DIRS = ("checkpoints", "objects", "packs", "index", "logs", "tmp", "holders", "damaged", "schedules", "keys",
              "journal")
# The local side of a remote store (under the cache directory): what is local by nature.
LOCAL_SIDE_DIRS = ("tmp", "logs", "schedules")
# What an interrupted creation can have left (store.json comes last): a dump finishes it.
STORE_ENTRIES = (*STORE_DIRS, "lock")
# Blob names (see "On-disk tree" and "Storage backends" in docs/design.md).
STORE_META = "store.json"


@dataclass(frozen=True)
class OpenedStore:
    """A store once opened: the backend stack its blobs go through, and what it is."""

    # How the user names the store: its directory, or its s3:// URL.
    location: str
    # Its local directory (for a remote store, its local side under the cache directory).
    root: Path
    backend: Backend  # the outermost layer of the stack: every blob goes through it
    remote: bool
    # The unlocked encryption layer (behind the cache, for a remote store), or None.
    encryption: EncryptedBackend | None = None
    # The cache in front of a remote store, or None (a local store, or CKPT_CACHE_SIZE=0).
    cache: CachingBackend | None = None


def open_store(location: StoreLocation, settings: Settings, passwords: PasswordSource,
               create: bool = False) -> OpenedStore:
    """Opens the store at location: a directory (see open_local), or an s3:// URL (see
    open_remote). An encrypted store (one with keys/) is unlocked with a password from
    passwords (ckpt/store/keys.py)."""
    if is_remote(location):
        return open_remote(str(location), settings, passwords)
    return open_local(Path(location), passwords, create=create)


# ---- a remote store -------------------------------------------------------------------------

def open_remote(url: str, settings: Settings, passwords: PasswordSource) -> OpenedStore:
    """A store in an S3 bucket: its blobs there, encrypted (a remote store is always created
    encrypted, by `ckpt init`), read through the local cache; its local side (staging, CRIU's
    logs, schedules) in the cache directory. Opening never creates one: that needs a
    password, which `ckpt init` asks for."""
    from ckpt.store import keys
    from ckpt.store.backends.cache import CachingBackend
    from ckpt.store.backends.s3 import S3Backend

    remote = S3Backend.from_url(url, lock_ttl=settings.lock_ttl, timeout=settings.s3_timeout)
    listed = keys.key_files(remote)
    if not listed:
        if remote.exists(STORE_META):
            keys.check_keys_not_lost(remote)
            raise StoreError(f"the store at {url} is not encrypted; ckpt keeps remote stores encrypted only",
                             hint="copy its checkpoints into a store made by `ckpt init` (ckpt copy)")
        raise CheckpointNotFound(f"no ckpt store at {url}",
                                 hint=f"create one with `ckpt init {url}`, or pass the right --store")
    root = local_side(url, settings.cache)
    encryption = keys.unlock(remote, passwords.password_for(url), listed)
    backend = cached(encryption, url, settings)
    check_format(backend, url)
    return OpenedStore(url, root, backend, True, encryption,
                       backend if isinstance(backend, CachingBackend) else None)


def local_dir(location: StoreLocation, cache: Path) -> Path:
    """Where the store at location keeps what is local by nature: its directory, or the local
    side of a remote store (under the cache directory)."""
    return local_side(location, cache) if isinstance(location, str) else location


def local_side(url: str, cache: Path) -> Path:
    """The local directory of the remote store at url: <cache>/stores/<tag>/{tmp,logs,schedules}."""
    from ckpt.store.backends.cache import store_cache_dir

    root = store_cache_dir(cache / "stores", url)  # the cache's blobs/ go beside tmp/ and logs/
    try:
        check_safe_ancestors(cache)
        # The cache root may be a directory the user chose (CKPT_CACHE): made 0700 when
        # missing, only checked when it exists (never chmod'ed: a 0777 one is refused, as a
        # store others can write is). What is below it is ckpt's own, and made 0700.
        if not os.path.isdir(cache):
            make_private_dir(cache)
        check_trusted_dir(cache, "the cache directory", follow=True, elsewhere="choose another CKPT_CACHE")
        for directory in (cache / "stores", root, *(root / sub for sub in LOCAL_SIDE_DIRS)):
            make_private_dir(directory)
            check_trusted_dir(directory, "the cache directory")
        marker = root / "url"
        if not marker.exists():
            marker.write_text(url + "\n")  # for whoever looks into the cache
    except OSError as exc:
        raise translate_os_error(exc, f"preparing the cache directory {root}") from exc
    return root


def cached(remote: Backend, url: str, settings: Settings) -> Backend:
    """The remote (decrypted) store behind the local cache of its immutable blobs
    (ckpt/store/backends/cache.py), which shares the local side's directory: staged files are
    hard-linked into it. CKPT_CACHE_SIZE=0: no cache."""
    from ckpt.store.backends.cache import CachingBackend, cache_bytes

    cap = cache_bytes(settings.cache_size, settings.cache)
    if cap == 0:
        return remote
    return CachingBackend(remote, settings.cache / "stores", url, cap)


# ---- what every store is checked for --------------------------------------------------------

def check_format(backend: Backend, where: str) -> None:
    """Refuses what is not a ckpt store, or one of a format newer than this ckpt understands."""
    try:
        info = json.loads(backend.get(STORE_META))
    except BlobNotFound:
        raise CheckpointNotFound(f"no ckpt store at {where} (no store.json there)",
                                 hint="pass the right --store") from None
    except ValueError as exc:
        raise StoreError(f"store.json of {where} is not valid JSON: {exc}") from exc
    if not isinstance(info, dict):
        raise StoreError(f"store.json of {where} is not a ckpt store description", hint="pass the right --store")
    if int(info.get("format", 0)) > FORMAT:
        raise StoreError(f"the store at {where} has format {info['format']}, newer than this ckpt "
                         f"understands ({FORMAT})", hint="upgrade ckpt")


def find_encryption(backend: Backend) -> EncryptedBackend | None:
    """The EncryptedBackend in a stack (behind the cache, for a remote store), or None."""
    from ckpt.store.backends.encrypted import EncryptedBackend

    layer: object = backend
    while layer is not None and not isinstance(layer, EncryptedBackend):
        layer = getattr(layer, "inner", None)
    return layer


def past_the_cache(backend: Backend) -> Backend:
    """The stack without its cache: what `verify` checks is the remote copy."""
    from ckpt.store.backends.cache import CachingBackend

    return backend.inner if isinstance(backend, CachingBackend) else backend


# ---- a local store ----------------------------------------------------------------------------

def open_local(root: Path, passwords: PasswordSource, create: bool = False,
               password: bytes | None = None) -> OpenedStore:
    """Opens the store at root. Only create=True (a dump) makes one, and only where nothing or
    an empty directory is; it never changes the mode of a directory it did not make. With a
    password (ckpt init --encrypt), the store it creates is encrypted.

    A store that another user owns or others may write (the root, a directory in it, or a
    directory above it that someone else could rename it out of) is refused: whoever can
    write a store can plant a checkpoint that its owner restores, and so run code as root for
    root's store."""
    if not str(root).strip():
        raise UsageError("the store path is empty", hint="pass --store DIR, or unset an empty CKPT_STORE")
    root = Path(os.path.abspath(root))
    try:
        real = _store_directory(root, create)
        plain: Backend = LocalBackend(real)
        backend = plain
        check_trusted_dir(real, "the store")
        if not os.path.lexists(real / STORE_META):
            backend = _finish_creating(root, real, plain, password)
        for sub in STORE_DIRS:
            if os.path.lexists(real / sub):
                check_trusted_dir(real / sub, "the store directory")
        if backend is plain and password is None and os.path.isdir(real / "keys") and os.listdir(real / "keys"):
            from ckpt.store import keys

            backend = keys.unlock(plain, passwords.password_for(str(root)))
        check_format(backend, str(root))
    except FileExistsError:
        return open_local(root, passwords, create=False)  # another dump finished creating it first
    except OSError as exc:
        raise translate_os_error(exc, f"opening the store at {root}") from exc
    if create and not os.access(real, os.W_OK):
        raise PermissionProblem(f"the store at {root} is not writable",
                                hint="run as its owner (root) or choose another store with --store")
    return OpenedStore(str(real), real, backend, False, find_encryption(backend) if backend is not plain else None)


def _store_directory(root: Path, create: bool) -> Path:
    """The store's directory, made when create=True and there is none; its real place (an
    administrator's link followed), checked for safe ancestors. Without create=True, a
    directory that is not a store (no store.json) is refused."""
    check_safe_ancestors(root)
    if not os.path.lexists(root):
        if not create:
            raise CheckpointNotFound(f"no ckpt store at {root}, so no checkpoints",
                                     hint="dump a process first, or pass the right --store")
        os.makedirs(root.parent, mode=DIR_MODE, exist_ok=True)
        try:
            os.mkdir(root, DIR_MODE)
        except FileExistsError:
            pass  # another dump made it meanwhile: checked below like any directory
    real = root.resolve()
    if real != root:
        check_safe_ancestors(real)  # an administrator's link to the store's real place
    if not create and not os.path.lexists(real / STORE_META):
        raise CheckpointNotFound(f"no ckpt store at {root} (no store.json there)",
                                 hint="pass the right --store; `ckpt init DIR` or a first `ckpt dump` "
                                      "creates a store")
    return real


def _finish_creating(root: Path, real: Path, backend: Backend, password: bytes | None) -> Backend:
    """Makes (or finishes making) a store in real, an empty directory or one an interrupted
    creation left; with a password, an encrypted one. Returns the backend to use.
    FileExistsError if another dump finished making it since the caller looked (its
    store.json is there now): the caller opens it as the store it is."""
    names = os.listdir(real)
    if STORE_META in names:  # (six first dumps into one new directory: one of 300 saw this)
        raise FileExistsError(errno.EEXIST, "another dump made the store meanwhile", str(real / STORE_META))
    foreign = sorted(n for n in names if n not in STORE_ENTRIES and not n.startswith(".store.json."))
    if foreign:
        raise UsageError(f"{root} is not a ckpt store and is not empty (it holds {foreign[0]}"
                         f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''})",
                         hint="choose a new or empty directory with --store")
    for sub in STORE_DIRS:
        make_private_dir(real / sub)
    if password is not None or os.listdir(real / "keys"):
        from ckpt.store import keys

        if password is None:
            raise UsageError(f"an interrupted `ckpt init --encrypt` left keys in {root}",
                             hint=f"remove {root} and run `ckpt init --encrypt` again")
        backend, _ = keys.initialize(backend, password)
    # Written last: a directory without it, holding only these, is a store whose creation was
    # interrupted, and the next dump finishes it.
    backend.put_if_absent(STORE_META, json.dumps(
        {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat()}).encode())
    return backend
