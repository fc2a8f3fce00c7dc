"""A checkpoint's small objects bundled into one blob by a dump into S3 (ckpt/store/bundles.py),
read back by a restore in one request, never trusted beyond what their hashes say. Against the
real SeaweedFS, requests counted by a relay in front of it."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest

from ckpt.settings import Settings
from ckpt.store import Store
from ckpt.store.blocks.segments import PAGE
from ckpt.store.bundles import BUNDLES_PREFIX, MIN_OBJECTS, read_bundle
from ckpt.store.password import PasswordSource
from ckpt.store.prune import collect_garbage
from ckpt.reporting import NullReporter
from ckpt.store.transfer import CheckpointCopier
from ckpt.store.verify import verify
from tests.helpers import ckpt_json
from tests.s3count import CountingRelay
from tests.unit.test_store import fake_dump, laid_out

PASSWORD = "bundle test password"
SMALL_IMAGES = MIN_OBJECTS + 4


def open_store(url: str, cache) -> Store:
    return Store.open(url, settings=Settings(store=url, cache=cache), passwords=PasswordSource(PASSWORD))


@pytest.fixture
def s3_store_url(s3_url, monkeypatch):
    monkeypatch.setenv("CKPT_PASSWORD", PASSWORD)
    monkeypatch.setenv("CKPT_STAGING", "disk")
    ckpt_json("init", s3_url)
    return s3_url


@pytest.fixture
def relay(s3_server, monkeypatch):
    upstream = urlsplit(s3_server.endpoint)
    counting = CountingRelay((upstream.hostname, upstream.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", counting.endpoint)
    yield counting
    counting.stop()


def images() -> dict[str, bytes]:
    files = {f"core-{i}.img": os.urandom(500) * (i + 2) for i in range(SMALL_IMAGES)}
    files["ghost-file-1.img"] = os.urandom(1 << 20)  # larger than a bundle takes: its object alone
    files |= {f"pages-{i}.img": os.urandom(PAGE * 3) for i in range(3)}
    return files


def gets(relay: CountingRelay, kind: str) -> int:
    return len([r for r in relay.requests if r.method == "GET" and f"/{kind}/" in r.path])


def test_a_restore_reads_the_small_objects_of_a_dump_into_s3_in_one_request(s3_store_url, relay, tmp_path):
    files = images()
    dumped = fake_dump(open_store(s3_store_url, tmp_path / "cache-a"), files)
    spans = dumped.bundle["spans"]
    assert dumped.bundle["blob"] == BUNDLES_PREFIX + dumped.id
    # every image but the large one, and the three page lists
    assert len(spans) == SMALL_IMAGES + 3 and all(e.hash in spans for e in dumped.files if e.name != "ghost-file-1.img")
    relay.requests.clear()
    store = open_store(s3_store_url, tmp_path / "cache-b")  # another host: an empty cache
    manifest = store.load(dumped.id)
    assert store.objects.take_bundle(manifest.bundle, manifest.files) == len(spans)
    directory = laid_out(store, manifest)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    assert relay.unparsed == 0 and gets(relay, "bundles") == 1
    assert gets(relay, "objects") == 1, "only the object too large for the bundle is read on its own"


def test_a_damaged_or_missing_bundle_falls_back_to_the_objects(s3_store_url, s3_server, relay, tmp_path):
    from ckpt.store.backends.s3 import S3Backend

    files = images()
    dumped = fake_dump(open_store(s3_store_url, tmp_path / "cache-a"), files)
    raw = S3Backend.from_url(s3_store_url)
    (blob,) = raw.list(BUNDLES_PREFIX)
    stored = raw.get(blob.name)
    for damage in (stored[:-1] + bytes([stored[-1] ^ 1]), None):  # a flipped bit, then gone
        if damage is None:
            raw.delete([blob.name])
        else:
            raw.put(blob.name, damage)
        relay.requests.clear()
        store = open_store(s3_store_url, tmp_path / f"cache-{damage is None}")
        manifest = store.load(dumped.id)
        assert store.objects.take_bundle(manifest.bundle, manifest.files) == 0
        assert {p.name: p.read_bytes() for p in laid_out(store, manifest).iterdir()} == files
        assert gets(relay, "objects") >= SMALL_IMAGES
        # verify says so, and finds the checkpoint itself intact
        warnings = Warnings()
        assert verify(store.objects, manifest, warnings) == []
        assert len(warnings.said) == 1 and f"{len(manifest.bundle['spans'])} of the copies" in warnings.said[0]


class Warnings(NullReporter):
    def __init__(self) -> None:
        self.said: list[str] = []

    def warn(self, message: str) -> None:
        self.said.append(message)


def test_verify_of_an_intact_bundle_warns_of_nothing(s3_store_url, tmp_path):
    store = open_store(s3_store_url, tmp_path / "cache")
    dumped = fake_dump(store, images())
    warnings = Warnings()
    assert verify(store.objects, dumped, warnings) == [] and warnings.said == []


def test_a_bundle_is_taken_only_where_its_bytes_match_their_hash(s3_store_url, tmp_path):
    store = open_store(s3_store_url, tmp_path / "cache")
    dumped = fake_dump(store, images())
    spans = dict(dumped.bundle["spans"])
    first, second = list(spans)[:2]
    spans[first] = spans[second]  # a span pointing at another object's bytes
    found = read_bundle(store.backend, {**dumped.bundle, "spans": spans})
    assert first not in found and second in found and len(found) == len(spans) - 1
    for broken in ({**dumped.bundle, "size": dumped.bundle["size"] + 1}, {**dumped.bundle, "blob": "bundles/x"},
                   {"spans": spans}, {**dumped.bundle, "size": 1 << 40}):
        assert read_bundle(store.backend, broken) == {}


def test_a_copy_into_s3_writes_a_bundle_of_its_own(s3_store_url, relay, tmp_path):
    """A checkpoint copied from a local store (a schedule's --copy-to) gets a bundle made by the
    copy, of the destination's page lists (another seed: other page ids)."""
    files = images()
    local = Store.open(tmp_path / "local", create=True, settings=Settings(store=tmp_path / "local"))
    dumped = fake_dump(local, files)
    assert dumped.bundle is None, "a local store's dump wrote a bundle"
    CheckpointCopier(local, open_store(s3_store_url, tmp_path / "cache-a"), NullReporter(), "zstd",
                     same_seed=False).copy_one(dumped.id)
    relay.requests.clear()
    store = open_store(s3_store_url, tmp_path / "cache-b")
    copied = store.load(dumped.id)
    assert copied.bundle is not None and len(copied.bundle["spans"]) == SMALL_IMAGES + 3
    assert {e.hash for e in copied.files if e.kind == "pages"} <= copied.bundle["spans"].keys()
    assert store.objects.take_bundle(copied.bundle, copied.files) == SMALL_IMAGES + 3
    assert {p.name: p.read_bytes() for p in laid_out(store, copied).iterdir()} == files
    assert gets(relay, "bundles") == 1 and gets(relay, "objects") == 1


def test_prune_removes_the_bundle_with_its_checkpoint_and_a_copy_takes_none(s3_store_url, tmp_path, monkeypatch):
    store = open_store(s3_store_url, tmp_path / "cache")
    kept, gone = fake_dump(store, images()), fake_dump(store, images())
    store.remove([gone.id])
    monkeypatch.setattr(store.backend, "gc_margin", lambda: 0.0)
    collect_garbage(store)
    assert [info.name for info in store.backend.list(BUNDLES_PREFIX)] == [BUNDLES_PREFIX + kept.id]
    local = Store.open(tmp_path / "local", create=True, settings=Settings(store=tmp_path / "local"))
    CheckpointCopier(store, local, NullReporter(), "zstd", same_seed=False).copy_one(kept.id)
    assert local.load(kept.id).bundle is None


def test_a_copy_whose_source_object_cannot_be_read_again_still_copies(s3_store_url, tmp_path, monkeypatch):
    """The bundle's copy of an object is read after the object was copied: where the source's
    cannot be read (damaged since, or gone), the destination's is taken; never a failed copy."""
    from ckpt.errors import DamagedCheckpoint

    files = images()
    local = Store.open(tmp_path / "local", create=True, settings=Settings(store=tmp_path / "local"))
    dumped = fake_dump(local, files)
    broken = next(e for e in dumped.files if e.name == "core-0.img")

    def content(entry):
        raise DamagedCheckpoint(f"image {entry.name} is damaged")

    monkeypatch.setattr(local.objects, "content", content)
    dest = open_store(s3_store_url, tmp_path / "cache-a")
    CheckpointCopier(local, dest, NullReporter(), "zstd", same_seed=False).copy_one(dumped.id)
    copied = open_store(s3_store_url, tmp_path / "cache-b").load(dumped.id)
    assert broken.hash in copied.bundle["spans"] and len(copied.bundle["spans"]) == SMALL_IMAGES + 3


@pytest.mark.parametrize("bundle", [["not", "a", "dict"], "bundles/x", 7, {"spans": []}, {}])
def test_a_manifest_bundle_of_another_shape_is_ignored(s3_store_url, tmp_path, bundle):
    store = open_store(s3_store_url, tmp_path / "cache")
    dumped = fake_dump(store, images())
    assert store.objects.take_bundle(bundle, dumped.files) == 0 and store.objects.bundled == {}
