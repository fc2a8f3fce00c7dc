"""ckpt/commands/diff.py: what changed between two checkpoints of a process."""

from ckpt.commands.diff import diff
from tests.commands.conftest import BASE, PAGE, Images, as_json, page


def test_pages_mappings_and_files_that_changed_are_counted(store, checkpoints):
    before = checkpoints.make("web", Images({BASE: page("same"), BASE + PAGE: page("old"), BASE + 2 * PAGE: page(2)},
                                            mapped_pages=8, open_files=[(3, "/srv/data.db"), (4, "/srv/old.log")]))
    after = checkpoints.make("web", Images({BASE: page("same"), BASE + PAGE: page("new"), BASE + 5 * PAGE: page(5)},
                                           mapped_pages=12, open_files=[(3, "/srv/data.db"), (5, "/srv/new.log")]))
    result = as_json(diff(store, before.id, "web"))
    assert (result["from"], result["to"]) == (before.id, after.id)
    assert result["processes"] == {"added": [], "removed": []}
    (process,) = result["per_process"]
    assert process["pid"] == 4242 and process["threads"] == {"from": 2, "to": 2}
    assert process["pages"] == {"changed": 1, "added": 1, "removed": 1, "bytes_changed": PAGE, "bytes_added": PAGE,
                                "bytes_removed": PAGE}
    assert process["mappings"] == {"added": 1, "removed": 1, "bytes_added": 12 * PAGE, "bytes_removed": 8 * PAGE}
    assert [fd["path"] for fd in process["files"]["opened"]] == ["/srv/new.log"]
    assert [fd["path"] for fd in process["files"]["closed"]] == ["/srv/old.log"]
    assert process["files"]["changed"] == []
    assert result["totals"] == {"pages_changed": 1, "pages_added": 1, "pages_removed": 1}


def test_a_checkpoint_against_itself_changes_nothing(store, checkpoints):
    made = checkpoints.make("web", Images({BASE: page(1)}, open_files=[(3, "/srv/data.db")]))
    (process,) = as_json(diff(store, made.id, made.id))["per_process"]
    assert process["pages"]["changed"] == process["pages"]["added"] == process["pages"]["removed"] == 0
    assert process["mappings"]["added"] == process["mappings"]["removed"] == 0
    assert process["files"] == {"opened": [], "closed": [], "changed": []}
    assert not list(store.tmp_dir.iterdir()), "the images read for diff were left behind"
