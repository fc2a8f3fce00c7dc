"""The store's invariants, on real files (no CRIU): commit last, dedup, gc, leftovers, damage."""

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from ckpt.errors import CheckpointNotFound, DamagedCheckpoint, StoreBusy
from ckpt.store import Manifest, Store, ids


def fake_dump(store: Store, files: dict[str, bytes], name=None, codec="zstd") -> Manifest:
    checkpoint_id = ids.new_id()
    staging = store.begin_dump(checkpoint_id)
    for file_name, content in files.items():
        (staging.images_dir / file_name).write_bytes(content)
    entries, added = store.ingest(staging, codec)
    manifest = Manifest(id=checkpoint_id, created="2026-11-30T23:00:00+00:00", pid=4242, command="x",
                        processes=[{"pid": 4242, "threads": [4242, 4243]}], files=entries, name=name,
                        bytes_total=sum(e.size for e in entries), bytes_stored=added)
    store.commit(manifest)
    staging.remove()
    time.sleep(0.001)
    return manifest


@pytest.fixture
def store(tmp_path):
    return Store.open(tmp_path / "store")


def modes(root):
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            yield os.path.join(dirpath, d), stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode), 0o700
        for f in filenames:
            yield os.path.join(dirpath, f), stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode), 0o600


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_round_trip_dedup_and_owner_only(store, codec, tmp_path):
    big = os.urandom(1 << 20)
    first = fake_dump(store, {"pages-1.img": big, "core-1.img": b"core"}, codec=codec)
    second = fake_dump(store, {"pages-1.img": big, "core-1.img": b"core2"}, codec=codec)
    assert second.bytes_stored < 100, "identical pages must not be stored twice"
    assert first.bytes_stored >= (1 << 20 if codec == "none" else 1)
    for path, mode, want in modes(store.root):
        if not path.endswith("lock"):
            assert mode == want, path
    dest = store.materialize(second)
    assert (dest / "pages-1.img").read_bytes() == big and (dest / "core-1.img").read_bytes() == b"core2"
    assert second.all_pids == [4242, 4243]


def test_resolve_latest_name_prefix(store):
    a = fake_dump(store, {"a": b"1"}, name="agent")
    b = fake_dump(store, {"a": b"2"}, name="agent")
    c = fake_dump(store, {"a": b"3"}, name="other")
    assert store.resolve("latest") == c.id
    assert store.resolve("agent") == b.id
    assert store.resolve(a.id) == a.id
    assert store.resolve(a.id[:-2]) == a.id
    with pytest.raises(CheckpointNotFound):
        store.resolve("nobody")


def test_remove_never_breaks_a_remaining_checkpoint(store):
    shared = os.urandom(100000)
    a = fake_dump(store, {"pages": shared, "x": b"a"})
    b = fake_dump(store, {"pages": shared, "x": b"b"})
    store.remove([a.id])
    removed, freed = store.collect_garbage()
    assert removed == 1  # only a's own "x"
    assert store.verify(store.load(b.id)) == []
    store.remove([b.id])
    store.collect_garbage()
    assert list(store.iter_object_bytes()) == []


def test_uncommitted_dump_is_invisible_and_cleaned(store):
    staging = store.begin_dump(ids.new_id())
    (staging.images_dir / "pages-1.img").write_bytes(b"partial")
    assert store.checkpoint_ids() == []
    assert store.remove_leftovers() == 0, "a live dump's staging must not be removed"
    # Simulate the dumper dying: its flock goes away with its file descriptor.
    os.close(staging._owner_fd)
    assert store.remove_leftovers() == 1
    assert list(store.tmp_dir.iterdir()) == []


def test_damage_is_detected_and_named(store):
    m = fake_dump(store, {"pages-1.img": os.urandom(50000), "core-1.img": b"c"}, codec="none")
    path, _ = store.find_object(m.files[1].hash if m.files[1].name == "pages-1.img" else m.files[0].hash)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    problems = store.verify(m)
    assert len(problems) == 1 and "pages-1.img" in problems[0]
    with pytest.raises(DamagedCheckpoint, match="pages-1.img"):
        store.materialize(m)
    assert list(store.tmp_dir.glob("restore-*")) == []


def test_manifest_is_json_with_format_first(store):
    m = fake_dump(store, {"a": b"1"})
    data = json.loads(store.manifest_path(m.id).read_text())
    assert list(data)[:2] == ["format", "id"] and data["format"] == 1


def test_exclusive_lock_waits_and_names_holder(store, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ckpt.store import Store\n"
        f"s = Store.open(Path({str(store.root)!r}))\n"
        "with s.lock(exclusive=False):\n"
        "    print('held', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusy, match=f"pid {holder.pid}"):
            with store.lock(exclusive=True, timeout=0.5):
                pass
        with store.lock(exclusive=False, timeout=0.5):
            pass  # shared locks coexist
    finally:
        holder.kill()
        holder.wait()
    with store.lock(exclusive=True, timeout=2):
        pass  # released by the kernel when its holder died
