"""ckpt/commands/journal.py as use cases over a memory store (the CLI's output and rm's rules
end to end: tests/cli/test_journal.py)."""

from datetime import datetime, timedelta, timezone

import pytest

from ckpt.commands import journal
from ckpt.errors import JournalRecordNotFound, UsageError
from ckpt.store.journal import Journal
from tests.commands.conftest import Heard, as_json
from tests.helpers import manifest_only_checkpoint

NOW = datetime.now(timezone.utc)


@pytest.fixture
def records(store) -> Journal:
    """Agent 'mailer': one action done yesterday, one done now, one only started."""
    mailer = Journal(store.backend, "mailer")
    mailer.record("mail-1", "sent", now=(NOW - timedelta(days=1)).isoformat())
    mailer.record("mail-2", "sent")
    mailer.intent("mail-3")
    Journal(store.backend, "poster").record("post-1", {"id": 7})
    return mailer


def test_agents_are_listed_with_their_counts_and_checkpoints(store, records):
    manifest_only_checkpoint(store, "mailer", NOW - timedelta(hours=1))
    manifest_only_checkpoint(store, "mailer", NOW - timedelta(minutes=1))
    rows = {row["agent"]: row for row in as_json(journal.list_agents(store))}
    assert sorted(rows) == ["mailer", "poster"]
    assert {k: rows["mailer"][k] for k in ("records", "done", "intents", "checkpoints")} == \
        {"records": 3, "done": 2, "intents": 1, "checkpoints": 2}
    assert rows["poster"]["checkpoints"] == 0 and rows["poster"]["newest"] is not None


def test_show_is_oldest_first_and_names_every_missing_key(store, records):
    assert [r["key"] for r in as_json(journal.show(store, "mailer"))][0] == "mail-1"
    assert [r["key"] for r in as_json(journal.show(store, "mailer", ["mail-3", "mail-1", "mail-3"]))] == \
        ["mail-3", "mail-1"]
    with pytest.raises(JournalRecordNotFound, match="'mail-8', 'mail-9'"):
        journal.show(store, "mailer", ["mail-1", "mail-8", "mail-9"])


def test_remove_refuses_what_a_checkpoint_needs_and_says_so_when_forced(store, records):
    manifest_only_checkpoint(store, "mailer", NOW - timedelta(hours=2))
    with pytest.raises(UsageError, match="2 of these records may be needed"):
        journal.remove(store, "mailer", ["mail-2", "mail-3"])
    planned = as_json(journal.remove(store, "mailer", ["mail-1"], dry_run=True))
    assert planned["dry_run"] is True and [r["key"] for r in planned["removed"]] == ["mail-1"]
    assert records.entry("mail-1") is not None, "a dry run removed a record"
    heard = Heard()
    journal.remove(store, "mailer", ["mail-3"], force=True, reporter=heard)
    assert records.entry("mail-3") is None and "may need" in heard.of("warn")[0]
    with pytest.raises(JournalRecordNotFound, match="no records of agent nobody"):
        journal.remove(store, "nobody")
