"""ckpt/commands/key.py: the passwords of an encrypted store (here in memory, made without a
terminal: the password is passed in)."""

import pytest

from ckpt.commands import key
from ckpt.errors import KeyNotFound, UsageError
from ckpt.store import Store, keys, opening
from ckpt.store.backends.memory import MemoryBackend
from tests.commands.conftest import Checkpoints

CHEAP = keys.KdfParams(n=1 << 10, r=8, p=1)  # scrypt at the tests' pace


@pytest.fixture
def encrypted(tmp_path) -> Store:
    root = tmp_path / "encrypted"
    root.mkdir(mode=0o700)
    backend, _ = keys.initialize(MemoryBackend("memory://encrypted"), b"first password", CHEAP)
    return Store(root, backend, location="memory://encrypted")


def test_keys_are_listed_with_the_one_in_use(encrypted):
    (only,) = key.list_keys(encrypted)
    assert only["current"] is True and only["kdf"] == "scrypt" and only["n"] == CHEAP.n


def test_an_added_password_opens_the_same_data(encrypted, tmp_path):
    made = Checkpoints(encrypted, tmp_path).make("web")
    added = key.add_key(encrypted, b"second password")
    listed = {row["id"]: row["current"] for row in key.list_keys(encrypted)}
    assert listed[added] is False and sorted(listed.values()) == [False, True]
    inner = opening.find_encryption(encrypted.backend).inner
    reopened = Store(encrypted.root, keys.unlock(inner, b"second password"), location="memory://encrypted")
    assert reopened.load(made.id).files == made.files
    assert not any(b'"web"' in inner.get(info.name) for info in inner.list("")), "a manifest stored in clear"


def test_the_key_in_use_and_the_last_key_are_never_removed(encrypted):
    (current,) = [row["id"] for row in key.list_keys(encrypted)]
    with pytest.raises(UsageError, match="only key"):
        key.remove_key(encrypted, current)
    other = key.add_key(encrypted, b"second password")
    with pytest.raises(UsageError, match="the one this command opened the store with"):
        key.remove_key(encrypted, current)
    with pytest.raises(KeyNotFound):
        key.remove_key(encrypted, "ffffffff")
    assert key.remove_key(encrypted, other[:8]) == other
    assert [row["id"] for row in key.list_keys(encrypted)] == [current]


def test_a_changed_password_replaces_the_old_one(encrypted):
    new_id = key.change_password(encrypted, b"new password")
    assert [(row["id"], row["current"]) for row in key.list_keys(encrypted)] == [(new_id, True)]
    inner = opening.find_encryption(encrypted.backend).inner
    keys.unlock(inner, b"new password")
    with pytest.raises(Exception, match="password"):
        keys.unlock(inner, b"first password")


def test_a_plain_store_has_no_keys(store):
    with pytest.raises(UsageError, match="not encrypted"):
        key.list_keys(store)
