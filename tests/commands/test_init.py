"""ckpt/commands/init.py: a local store created, plain or encrypted, and never over another."""

import os
from dataclasses import replace

import pytest

from ckpt.commands.init import init
from ckpt.errors import UsageError
from ckpt.store import Store, keys
from ckpt.store.backends import LocalBackend
from tests.commands.conftest import as_json
from tests.helpers import env_settings


def test_a_plain_store_is_created_once(tmp_path):
    where = tmp_path / "new"
    created = as_json(init(where, env_settings()))
    assert created == {"store": str(where), "encrypted": False, "key": None, "local_dir": str(where)}
    assert Store.open_local(where, settings=env_settings()).checkpoint_ids() == []
    assert os.stat(where).st_mode & 0o777 == 0o700
    with pytest.raises(UsageError, match="already a ckpt store"):
        init(where, env_settings())


def test_a_directory_holding_something_else_is_refused(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not a ckpt store and is not empty"):
        init(tmp_path / "busy", env_settings())
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]


def test_an_encrypted_store_gets_a_key_for_the_password(tmp_path):
    where = tmp_path / "secret"
    created = as_json(init(where, replace(env_settings(), password="a good long password"), encrypt=True))
    assert created["encrypted"] is True
    assert [k.id for k in keys.list_keys(LocalBackend(where))] == [created["key"]]
    assert keys.unlock(LocalBackend(where), b"a good long password").key_id == created["key"]
