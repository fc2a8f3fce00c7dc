"""ckpt/commands/list.py: the rows of `ckpt list`, and what a name that matches nothing is told."""

from ckpt.commands.list import absent_name, list_checkpoints
from tests.commands.conftest import Heard, as_json


def test_rows_are_oldest_first_with_their_figures(store, checkpoints):
    first = checkpoints.make("web")
    second = checkpoints.make("db")
    rows = as_json(list_checkpoints(store))
    assert [(r["id"], r["name"]) for r in rows] == [(first.id, "web"), (second.id, "db")]
    assert rows[0]["pid"] == 4242 and rows[0]["processes"] == 1 and rows[0]["origin"] is None
    assert rows[0]["bytes_total"] == first.bytes_total > 0
    assert rows[0]["bytes_stored"] == first.bytes_stored and rows[0]["lazy_restore_failures"] == 0


def test_a_name_keeps_only_its_checkpoints(store, checkpoints):
    checkpoints.make("web")
    db = checkpoints.make("db")
    checkpoints.make(None)
    assert [r["id"] for r in as_json(list_checkpoints(store, name="db"))] == [db.id]
    assert as_json(list_checkpoints(store, name="nothing")) == []


def test_an_unreadable_manifest_is_warned_about_and_left_out(store, checkpoints):
    kept = checkpoints.make("web")
    broken = checkpoints.make("web")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{not json")
    heard = Heard()
    assert [r["id"] for r in as_json(list_checkpoints(store, reporter=heard))] == [kept.id]
    (warning,) = heard.of("warn")
    assert broken.id in warning and "not valid JSON" in warning


def test_a_name_that_matches_nothing_says_what_there_is_and_what_was_meant(store, checkpoints):
    assert "no checkpoints in the store yet" in absent_name(store, "web")
    checkpoints.make("webserver")
    checkpoints.make("database")
    said = absent_name(store, "webservr")
    assert "the store holds 2" in said and "names: database, webserver" in said
    assert "did you mean" in said and "webserver" in said.split("did you mean", 1)[1]
    assert "did you mean" not in absent_name(store, "zzzzzz")
