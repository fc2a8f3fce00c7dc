"""ckpt/commands/forget.py: the retention of a schedule or of `ckpt run` judges only the
checkpoints of its own origin, and says what it removed (issue 24)."""

import json
import time

import pytest

from ckpt.commands.forget import forget
from ckpt.dump.commit import DumpRecord, ingest_and_commit
from ckpt.schedule.retention import Policy
from ckpt.store import Origin, Store, ids
from tests.helpers import env_settings

HAND = Origin("dump")
API = Origin("api")
SCHEDULE = Origin("schedule", "keepme")
RUN = Origin("run", "keepme")
OTHER_RUN = Origin("run", "other")

# (label, name, origin), oldest first; None: a manifest from before origins were recorded.
MADE = [("hand", "keepme", HAND), ("old", "keepme", None), ("api", "keepme", API),
        ("sched1", "keepme", SCHEDULE), ("run1", "keepme", RUN), ("sched2", "keepme", SCHEDULE),
        ("run2", "keepme", RUN), ("other1", "other", OTHER_RUN), ("run3", "keepme", RUN),
        ("other2", "other", OTHER_RUN), ("sched3", "keepme", SCHEDULE)]


class Recorder:
    def __init__(self):
        self.infos: list[str] = []

    def step(self, message): pass

    def progress(self, done, total, what): pass

    def info(self, message):
        self.infos.append(message)

    def warn(self, message): pass


def made(store: Store, name: str, origin: Origin | None) -> str:
    """A checkpoint committed by the dump's own path (ckpt/dump/commit.py), without CRIU."""
    checkpoint_id = ids.new_id()
    staging = store.begin_dump(checkpoint_id)
    (staging.images_dir / "core-4242.img").write_bytes(checkpoint_id.encode())
    record = DumpRecord(checkpoint_id=checkpoint_id, pid=4242, command="x", started=time.monotonic(), name=name,
                        origin=origin, processes=[{"pid": 4242, "threads": [4242]}])
    try:
        ingest_and_commit(store, staging, record, "zstd")
    finally:
        staging.remove()
    time.sleep(0.002)  # ids and times in order
    return checkpoint_id


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_STAGING", "disk")
    return Store.open(tmp_path / "store", create=True, settings=env_settings())


@pytest.fixture
def checkpoints(store) -> dict[str, str]:
    return {label: made(store, name, origin) for label, name, origin in MADE}


@pytest.mark.parametrize("origin,name,removed", [
    # `ckpt run --name keepme --keep-last 1`: its own older two, nothing else of the name
    (RUN, "keepme", ["run1", "run2"]),
    # `schedule run keepme` with --keep-last 1
    (SCHEDULE, "keepme", ["sched1", "sched2"]),
    # another run's retention never sees keepme's checkpoints
    (OTHER_RUN, "other", ["other1"]),
    # `ckpt forget --name keepme --keep-last 1`: the user's own command judges every origin
    (None, "keepme", ["hand", "old", "api", "sched1", "run1", "sched2", "run2", "run3"]),
])
def test_retention_judges_only_its_own_origin(store, checkpoints, origin, name, removed):
    result = forget(store, Policy(keep_last=1), name=name, origin=origin)
    label_of = {v: k for k, v in checkpoints.items()}
    assert [label_of[r["id"]] for r in result["remove"]] == removed
    assert sorted(store.checkpoint_ids()) == sorted(v for k, v in checkpoints.items() if k not in removed)


def test_what_is_forgotten_is_said(store, checkpoints):
    said = Recorder()
    forget(store, Policy(keep_last=1), name="keepme", origin=RUN, reporter=said, dry_run=True)
    assert said.infos == [f"would forget 2 checkpoints of 'keepme' (keep-last 1): {checkpoints['run1']}, "
                          f"{checkpoints['run2']}"]
    said = Recorder()
    forget(store, Policy(keep_last=2), name="keepme", origin=SCHEDULE, reporter=said)
    assert said.infos == [f"forgot 1 checkpoint of 'keepme' (keep-last 2): {checkpoints['sched1']}"]
    said = Recorder()
    forget(store, Policy(keep_last=2), name="keepme", origin=SCHEDULE, reporter=said)
    assert said.infos == [], "nothing removed, nothing said"


def test_many_forgotten_are_counted_and_the_first_named(store):
    made_ids = [made(store, "many", RUN) for _ in range(8)]
    said = Recorder()
    forget(store, Policy(keep_last=1), name="many", origin=RUN, reporter=said)
    assert said.infos == [f"forgot 7 checkpoints of 'many' (keep-last 1): {', '.join(made_ids[:5])} and 2 more"]


def test_origin_is_recorded_and_read_back(store, checkpoints):
    assert store.load(checkpoints["run1"]).origin == RUN
    assert store.load(checkpoints["hand"]).origin == HAND
    path = store.root / "checkpoints" / f"{checkpoints['sched1']}.json"
    raw = json.loads(path.read_text())
    assert raw["origin"] == {"kind": "schedule", "name": "keepme"}
    del raw["origin"]  # as an older ckpt wrote it
    path.write_text(json.dumps(raw))
    assert store.load(checkpoints["sched1"]).origin is None


@pytest.mark.parametrize("recorded,read", [
    ({"kind": "run", "name": "a"}, Origin("run", "a")),
    ({"kind": "dump", "name": None}, Origin("dump")),
    ({"kind": "dump"}, Origin("dump")),
    ({"kind": "migration", "name": "x", "host": "b"}, Origin("migration", "x")),  # a newer ckpt's: nobody's
    ("run keepme", None),
    ({"name": "keepme"}, None),
    (None, None),
])
def test_origins_as_recorded(recorded, read):
    assert Origin.from_json(recorded) == read
