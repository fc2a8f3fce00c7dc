"""Use case: reclaim unreferenced space, as a plan and its execution."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckpt.commands.cache_notes import tell_copies_read_again
from ckpt.commands.results import JsonResult
from ckpt.phases import phase
from ckpt.reporting import NullReporter, Reporter
from ckpt.store import Store
from ckpt.store.prune import PrunePlan, execute_prune, prune_plan, sweep_and_plan


@dataclass(frozen=True)
class PruneResult(JsonResult):
    plan: PrunePlan
    dry_run: bool
    duration_ms: float

    def to_json(self) -> dict:
        return {**self.plan.to_json(), "dry_run": self.dry_run, "duration_ms": self.duration_ms}


def prune(store: Store, dry_run: bool = False, reporter: Reporter = NullReporter()) -> PruneResult:
    started = time.monotonic()
    with store.lock(exclusive=True):
        # A dry run changes nothing, not even the staging directories dead commands left.
        plan = prune_plan(store) if dry_run else sweep_and_plan(store)
        if not dry_run:
            phase("prune.planned")
            execute_prune(store, plan)
    if plan.unfinished_members:
        reporter.info(f"{'would remove' if dry_run else 'removed'} {len(plan.unfinished_members)} unfinished "
                      f"group member(s) (their group checkpoint never committed): "
                      + ", ".join(plan.unfinished_members))
    tell_copies_read_again(store, reporter)
    return PruneResult(plan, dry_run, round((time.monotonic() - started) * 1000, 1))
