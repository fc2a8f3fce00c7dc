"""Named phases of ckpt's commands: a test-only hook for fault injection.

ckpt promises that a `kill -9` at any moment leaves the target running (never frozen), shows
no half-written checkpoint and keeps every committed one intact. To test that at a known
moment rather than after a guessed sleep, the code calls phase(NAME) at each moment worth
killing it at, and tests/integration/test_kill_phases.py kills it at every name in PHASES.

TEST ONLY, not a setting: with CKPT_TEST_PAUSE_AT=NAME in its environment, ckpt announces
reaching phase NAME by creating the file CKPT_TEST_PAUSE_FILE (O_EXCL, holding "NAME PID")
and then sleeps there, up to PAUSE_S, waiting to be killed, or to go on once the test deletes
that file (to change the world at that moment: stop a server). Without the variable phase()
does nothing (the environment is read once). These variables are deliberately left out of
ckpt's settings and their table in docs/commands.md.
"""

from __future__ import annotations

import os
import time

PAUSE_AT = "CKPT_TEST_PAUSE_AT"
PAUSE_FILE = "CKPT_TEST_PAUSE_FILE"
PAUSE_S = 120.0

# Every phase, in the order a command reaches it, with what holds there. The test kills ckpt
# at each: a name added here is tested by that alone.
PHASES = {
    # dump (plain and --stop)
    "dump.staged": "pre-flight done, staging directory created, CRIU not started",
    "dump.streaming": "receiving the pages CRIU streams: the tree is frozen, CRIU waits for ckpt",
    "dump.frozen": "CRIU's post-dump notification: the tree is dumped and still frozen",
    "dump.ingest": "storing the pages: the new pack is partly written (--stop: the tree is frozen)",
    "dump.before-commit": "pack, index and objects durable; the manifest not written yet",
    "dump.committed": "manifest committed, staging not removed (--stop: the tree is still frozen)",
    "dump.after-criu": "CRIU has exited (plain: tree running, nothing stored yet; --stop: tree gone)",
    # group dump (plain and --stop) of two trees
    "group.prepared": "every member prepared (staged, locked): nothing frozen",
    "group.held": "every member frozen, dumped and held (--stop: each member's checkpoint committed)",
    "group.released": "every member let go (plain: thawed, nothing committed; --stop: group committed, ended)",
    "group.members-committed": "every member's checkpoint committed (plain: the group manifest not yet)",
    # migrate (to another host, over ssh)
    "migrate.precopy": "before a pre-copy round: the tree runs, the destination's agent waits",
    "migrate.frozen": "the final dump held: the tree frozen, its checkpoint committed, nothing restored",
    "migrate.restored-held": "the destination's tree restored and held; the source frozen",
    "migrate.decided": "the source ended, the decision recorded; the destination's tree held",
    "migrate.running": "the destination's tree runs; its agent not finished, the decision not removed",
    # restore (eager and lazy)
    "restore.materialized": "images verified and written to the staging area; CRIU not started",
    "restore.before-criu": "PIDs free (lazy: page server started); CRIU not started",
    "restore.post-restore": "CRIU's post-restore notification: the tree is restored, not yet resumed",
    "restore.restored": "CRIU has returned, the tree runs; images and relays not cleaned up",
    # forget (without --prune)
    "forget.planned": "policy applied, nothing removed yet",
    "forget.removing": "one manifest removed, others still to remove",
    # rm
    "rm.removed": "manifests removed, garbage not collected",
    # prune
    "prune.planned": "plan computed, nothing deleted",
    "prune.repacking": "copying live segments: the new pack is partly written",
    "prune.before-index": "new pack durable, new index not written",
    "prune.index-written": "new index written, old index files not deleted",
    "prune.deleting": "one unreferenced pack or object deleted, others still to delete",
    # copy (of two checkpoints, into another store)
    "copy.packing": "the pages the destination lacks: its new pack is partly written",
    "copy.before-commit": "pack, index file and objects durable in the destination; no manifest yet",
    "copy.committed": "the first checkpoint committed in the destination, the second not copied yet",
}

_wanted = os.environ.get(PAUSE_AT) or None
_paused = False


def phase(name: str) -> None:
    """Marks reaching phase `name`; pauses there (once per process) if a test asked for it."""
    global _paused  # noqa: PLW0603 (once per process)
    if _wanted is None or name != _wanted or _paused:
        return
    _paused = True
    announced = os.environ[PAUSE_FILE]
    fd = os.open(announced, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"{name} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    deadline = time.monotonic() + PAUSE_S
    while time.monotonic() < deadline and os.path.exists(announced):
        time.sleep(0.05)
