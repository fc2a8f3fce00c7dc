"""Stores and staging directories that someone else controls are refused or left alone
(issue 13: a root-owned tool must not be made to delete files or restore a planted checkpoint)."""

import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest

from ckpt.errors import CheckpointNotFound, PermissionProblem, StoreError, UsageError
from ckpt.store import Store, opening
from ckpt.store import staging as staging_module
from ckpt.store.staging import StagingArea
from tests.helpers import env_settings, ROOT

NOBODY = pwd.getpwnam("nobody")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "ckpt", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=60)


def snapshot(path):
    """Every entry under path with its mode: what a read-only command must leave as it was."""
    result = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            result[os.path.relpath(full, path)] = os.lstat(full).st_mode
    return result, os.lstat(path).st_mode


@pytest.mark.parametrize("command", [["list"], ["show", "latest"], ["verify", "--all"], ["prune"],
                                     ["forget", "--keep-last", "1"], ["rm", "latest"], ["diff", "a", "b"]])
def test_commands_other_than_dump_never_turn_a_directory_into_a_store(tmp_path, command):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "somebody's file").write_text("hello")
    before = snapshot(shared)
    proc = run_cli(*command, "--store", shared)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("Error: no ckpt store at") and proc.stderr.count("\n") == 1
    assert snapshot(shared) == before
    missing = tmp_path / "missing"
    assert run_cli(*command, "--store", missing).returncode == 3
    assert not missing.exists()


def test_an_empty_store_path_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckpt", "list", "--store", ""], capture_output=True, text=True,
                          cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "CKPT_STORE"}, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_store_is_created_only_where_nothing_or_an_empty_directory_is(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="not a ckpt store and is not empty"):
        Store.open(busy, create=True, settings=env_settings())
    assert os.listdir(busy) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    Store.open(empty, create=True, settings=env_settings())
    assert (empty / "store.json").exists()
    assert os.lstat(empty).st_mode & 0o777 == 0o755, "the mode of a directory ckpt did not make is kept"
    new = tmp_path / "a" / "b" / "new"
    Store.open(new, create=True, settings=env_settings())
    assert os.lstat(new).st_mode & 0o777 == 0o700


def test_an_interrupted_creation_is_finished_by_the_next_dump(tmp_path):
    root = tmp_path / "store"
    Store.open(root, create=True, settings=env_settings())
    (root / "store.json").unlink()
    with pytest.raises(CheckpointNotFound):
        Store.open(root, settings=env_settings())
    Store.open(root, create=True, settings=env_settings())
    assert json.loads((root / "store.json").read_text())["format"] == 2


def test_a_store_another_dump_finishes_making_meanwhile_is_opened_as_it_is(tmp_path, monkeypatch):
    """Six first dumps into one new directory: one saw no store.json, then found one when it
    listed the directory to make the store (one in 300 failed, "not a ckpt store")."""
    root = tmp_path / "store"
    Store.open(root, create=True, settings=env_settings())
    real_lexists = os.path.lexists
    looked = []

    def not_yet(path):  # the first look at store.json: before the other dump wrote it
        if str(path).endswith("store.json") and not looked:
            looked.append(path)
            return False
        return real_lexists(path)

    monkeypatch.setattr(opening.os.path, "lexists", not_yet)
    store = Store.open(root, create=True, settings=env_settings())
    assert looked and store.root == root
    assert json.loads((root / "store.json").read_text())["format"] == 2


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_store_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "store"
    Store.open(root, create=True, settings=env_settings())
    os.chmod(root, mode)
    with pytest.raises(PermissionProblem, match="writable by others"):
        Store.open(root, settings=env_settings())
    os.chmod(root, 0o700)
    os.chmod(root / "checkpoints", mode)
    with pytest.raises(PermissionProblem, match="checkpoints is writable by others"):
        Store.open(root, settings=env_settings())
    proc = run_cli("list", "--store", root)
    assert proc.returncode == 4 and "chmod go-w" in proc.stderr and proc.stderr.count("\n") == 1


def test_an_existing_cache_root_others_can_write_is_refused_not_chmoded(tmp_path, monkeypatch):
    """Issue 23: a CKPT_CACHE of mode 0777 was silently made 0700 (by the local side of a remote
    store); it is refused with the fix instead, and one that ckpt makes is 0700."""
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    os.chmod(chosen, 0o777)
    monkeypatch.setenv("CKPT_CACHE", str(chosen))
    with pytest.raises(PermissionProblem, match="writable by others") as info:
        opening.local_side("s3://bucket/prefix", env_settings().cache)
    assert f"chmod 700 {chosen}, or choose another CKPT_CACHE" in str(info.value)
    assert "\n" not in str(info.value)
    assert os.lstat(chosen).st_mode & 0o7777 == 0o777, "an existing cache root is only checked"
    assert os.listdir(chosen) == []
    made = tmp_path / "a" / "cache"
    monkeypatch.setenv("CKPT_CACHE", str(made))
    local = opening.local_side("s3://bucket/prefix", env_settings().cache)
    assert local.is_dir() and os.lstat(made).st_mode & 0o7777 == 0o700


def test_a_store_directory_replaced_by_a_link_is_refused(tmp_path):
    root = tmp_path / "store"
    Store.open(root, create=True, settings=env_settings())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    shutil.rmtree(root / "checkpoints")
    os.symlink(elsewhere, root / "checkpoints")
    with pytest.raises(PermissionProblem, match="symbolic link"):
        Store.open(root, settings=env_settings())


def test_a_link_to_a_store_is_followed_to_a_store_that_passes_the_checks(tmp_path):
    real = tmp_path / "real"
    Store.open(real, create=True, settings=env_settings())
    os.symlink(real, tmp_path / "link")
    assert Store.open(tmp_path / "link", settings=env_settings()).root == real


@needs_root
def test_a_store_another_user_owns_or_sits_in_is_refused(tmp_path):
    root = tmp_path / "store"
    Store.open(root, create=True, settings=env_settings())
    os.chown(root, NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(PermissionProblem, match="belongs to nobody"):
        Store.open(root, settings=env_settings())
    with pytest.raises(PermissionProblem, match="belongs to nobody"):
        Store.open(root, create=True, settings=env_settings())
    os.chown(root, 0, 0)
    os.chown(root / "objects", NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(PermissionProblem, match="objects belongs to nobody"):
        Store.open(root, settings=env_settings())
    os.chown(root / "objects", 0, 0)
    Store.open(root, settings=env_settings())
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(PermissionProblem, match="inside .*home, which belongs to nobody"):
        Store.open(home / "store", create=True, settings=env_settings())
    assert os.listdir(home) == []


# ---- staging in a directory everyone can write (/dev/shm)

def as_nobody(*argv):
    """Runs a command as user nobody (a separate, unprivileged user)."""
    def demote():
        os.setgid(NOBODY.pw_gid)
        os.setuid(NOBODY.pw_uid)
    subprocess.run(argv, check=True, preexec_fn=demote, timeout=30)


@pytest.fixture
def ram_store(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STAGING", "ram")
    store = Store.open(tmp_path / "store", create=True, settings=env_settings())
    area = StagingArea.in_ram(store.root)
    planted = []
    yield store, area, planted
    for path in planted:
        if os.path.islink(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
    for _, path in area.entries():
        shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_links_another_user_planted_in_dev_shm_are_never_followed(tmp_path, ram_store):
    store, area, planted = ram_store
    victim = tmp_path / "victim"
    (victim / "precious").mkdir(parents=True)
    (victim / "precious" / "data").write_text("keep me")
    os.chmod(victim, 0o755)
    os.chmod(tmp_path, 0o755)  # so that nobody can point at it; it cannot write there
    # The names ckpt used before (the store's directory, and a dump's under it) and names of
    # the shape it uses now, all pointing at the victim.
    for name in (f"{area.prefix[:-1]}", f"{area.prefix}dump-20260101-000000-000-abcdef-x1y2z3w4",
                 f"{area.prefix}restore-abcdefgh", f"{area.prefix}x.trash", f"{area.prefix}new-abcdefgh"):
        as_nobody("ln", "-s", str(victim), f"/dev/shm/{name}")
        planted.append(f"/dev/shm/{name}")
    store.remove_leftovers()
    store.remove_restore_leftovers()
    staging = store.begin_dump("20260101-000000-000-abcdef")
    try:
        assert staging.root.parent == staging_module.RAM_BASE and not staging.root.is_symlink()
        assert os.lstat(staging.root).st_uid == 0
    finally:
        staging.remove()
    assert (victim / "precious" / "data").read_text() == "keep me"
    assert os.lstat(victim).st_mode & 0o777 == 0o755, "ckpt changed the mode of what a planted link points to"
    for path in planted:
        assert os.path.islink(path), "another user's entry was removed or replaced"


@needs_root
def test_directories_another_user_made_in_dev_shm_are_not_used_or_chmodded(tmp_path, ram_store):
    store, area, planted = ram_store
    theirs = f"/dev/shm/{area.prefix}dump-20260101-000000-000-abcdef-qqqqqqqq"
    old_style = f"/dev/shm/{area.prefix[:-1]}"
    for path in (theirs, old_style):
        as_nobody("mkdir", "-m", "0777", path)
        planted.append(path)
    store.remove_leftovers()
    staging = store.begin_dump("20260101-000000-000-abcdef")
    try:
        assert not str(staging.root).startswith(old_style + "/")
        assert os.lstat(staging.root).st_uid == 0 and os.lstat(staging.root).st_mode & 0o777 == 0o700
    finally:
        staging.remove()
    for path in (theirs, old_style):
        st = os.lstat(path)
        assert st.st_uid == NOBODY.pw_uid and st.st_mode & 0o777 == 0o777


def test_a_staging_directory_appears_under_its_name_only_once_locked(ram_store):
    store, area, _ = ram_store
    staging = store.begin_dump("20260101-000000-000-abcdef")
    assert [kind for kind, _ in area.entries()] == ["dump"]
    assert store.remove_leftovers() == 0
    os.close(staging._lock_fd)  # as if the dump died
    assert store.remove_leftovers() == 1
    assert area.entries() == []


def test_an_abandoned_new_directory_is_removed_only_when_old(tmp_path):
    area = StagingArea(tmp_path)
    fresh = area.new_dir("new")
    assert area.sweep(restores=True) == 0
    old = os.lstat(fresh).st_mtime - staging_module.ABANDONED_NEW_S - 10
    os.utime(fresh, (old, old))
    assert area.sweep(restores=True) == 1 and not fresh.exists()


def test_a_dev_shm_without_the_sticky_bit_is_not_used_for_staging(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o777)
    monkeypatch.setattr(staging_module, "RAM_BASE", shm)
    with pytest.raises(StoreError, match="sticky"):
        StagingArea.in_ram(tmp_path / "store")
    os.chmod(shm, 0o1777)
    assert StagingArea.in_ram(tmp_path / "store").base == shm


def test_the_local_side_of_a_remote_store_is_under_the_cache_passed_in(tmp_path, monkeypatch):
    """Opening takes its settings as arguments (ckpt/store/opening.py): CKPT_CACHE is not read."""
    monkeypatch.setenv("CKPT_CACHE", str(tmp_path / "not-this-one"))
    local = opening.local_side("s3://bucket/prefix", tmp_path / "cache")
    assert local.parent.parent == tmp_path / "cache" and (local / "url").read_text() == "s3://bucket/prefix\n"
    assert sorted(p.name for p in local.iterdir()) == ["logs", "schedules", "tmp", "url"]
    assert opening.local_dir(tmp_path / "store", tmp_path / "cache") == tmp_path / "store"
    assert not (tmp_path / "not-this-one").exists()
