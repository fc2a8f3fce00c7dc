"""RestoreBackoff: the pause `ckpt run` makes before a restore (ckpt/commands/run.py)."""

from ckpt.commands.run import RestoreBackoff


def test_pauses_grow_for_trees_that_die_soon_after_their_restore_and_reset_after_a_stable_run():
    backoff = RestoreBackoff(first=1.0, cap=8.0, stable_after=60.0)
    # (how long the dead tree ran after its restore (None: never restored), the pause before the next)
    table = [
        (None, 0.0),   # the command as started died: restored at once
        (0.2, 1.0), (0.3, 2.0), (59.0, 4.0), (1.0, 8.0), (1.0, 8.0),  # died soon after each restore: capped
        (60.0, 0.0),   # ran a minute: the streak is over
        (0.5, 1.0),    # and a new one starts from the first pause
        (None, 0.0),
    ]
    assert [backoff.pause(ran) for ran, _ in table] == [pause for _, pause in table]
