"""Use case: reclaim unreferenced space, as a plan and its execution."""

from __future__ import annotations

import time

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.prune import execute_prune, prune_plan, sweep_and_plan


def prune(store: Store, dry_run: bool = False, reporter: Reporter = NullReporter()) -> dict:
    started = time.monotonic()
    with store.lock(exclusive=True):
        # A dry run changes nothing, not even the staging directories dead commands left.
        plan = prune_plan(store) if dry_run else sweep_and_plan(store)
        if not dry_run:
            phase("prune.planned")
            execute_prune(store, plan)
    tell_copies_read_again(store, reporter)
    return {**plan.to_json(), "dry_run": dry_run, "duration_ms": round((time.monotonic() - started) * 1000, 1)}
