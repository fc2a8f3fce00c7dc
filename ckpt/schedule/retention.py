"""Retention: a pure function of (checkpoints, policy, now) that says which to keep and why.

Checkpoints are grouped (by name, or by command line when unnamed) and each group is judged on
its own, newest first. The rules follow restic's `forget`: keep-last N keeps the N newest;
keep-within D keeps all newer than now - D; keep-hourly/daily/weekly N keep the newest
checkpoint of each of the N most recent hours/days/ISO weeks that have one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ckpt.errors import UsageError

DURATION_RE = re.compile(r"^(\d+)([smhdw])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """'90s', '5m', '2h', '7d', '4w' -> timedelta."""
    match = DURATION_RE.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise UsageError(f"invalid duration '{text}'", hint="use a number and a unit: 30s, 5m, 2h, 7d, 4w")
    return timedelta(seconds=int(match.group(1)) * UNIT_SECONDS[match.group(2)])


@dataclass(frozen=True)
class Policy:
    keep_last: int = 0
    keep_within: timedelta | None = None
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0

    def __post_init__(self) -> None:
        for rule in ("keep_last", "keep_hourly", "keep_daily", "keep_weekly"):
            count = getattr(self, rule)
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise UsageError(f"--{rule.replace('_', '-')} {count!r} is not a count",
                                 hint="give a whole number of 0 or more")

    def empty(self) -> bool:
        return not (self.keep_last or self.keep_within or self.keep_hourly or self.keep_daily or self.keep_weekly)

    def describe(self) -> str:
        parts = []
        if self.keep_last:
            parts.append(f"last {self.keep_last}")
        if self.keep_within:
            parts.append(f"within {format_duration(self.keep_within)}")
        for label, n in (("hourly", self.keep_hourly), ("daily", self.keep_daily), ("weekly", self.keep_weekly)):
            if n:
                parts.append(f"{label} {n}")
        return ", ".join(parts) or "keep everything"

    def flags(self) -> str:
        """The policy as the flags that give it: 'keep-last 3, keep-within 2d'."""
        parts = [f"keep-{rule} {n}" for rule, n in (
            ("last", self.keep_last), ("within", format_duration(self.keep_within) if self.keep_within else 0),
            ("hourly", self.keep_hourly), ("daily", self.keep_daily), ("weekly", self.keep_weekly)) if n]
        return ", ".join(parts) or "keep everything"

    def to_json(self) -> dict:
        return {"keep_last": self.keep_last,
                "keep_within": format_duration(self.keep_within) if self.keep_within else None,
                "keep_hourly": self.keep_hourly, "keep_daily": self.keep_daily, "keep_weekly": self.keep_weekly}

    @classmethod
    def from_json(cls, data: dict) -> Policy:
        within = data.get("keep_within")
        return cls(keep_last=data.get("keep_last", 0), keep_within=parse_duration(within) if within else None,
                   keep_hourly=data.get("keep_hourly", 0), keep_daily=data.get("keep_daily", 0),
                   keep_weekly=data.get("keep_weekly", 0))


def format_duration(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit in ("w", "d", "h", "m"):
        if seconds % UNIT_SECONDS[unit] == 0:
            return f"{seconds // UNIT_SECONDS[unit]}{unit}"
    return f"{seconds}s"


@dataclass(frozen=True)
class Item:
    id: str
    group: str
    created: datetime


@dataclass
class Decision:
    id: str
    group: str
    created: datetime
    keep: bool
    reasons: list[str] = field(default_factory=list)


BUCKETS = (
    ("hourly", lambda t: (t.year, t.month, t.day, t.hour), "keep_hourly"),
    ("daily", lambda t: (t.year, t.month, t.day), "keep_daily"),
    ("weekly", lambda t: tuple(t.isocalendar()[:2]), "keep_weekly"),
)


def apply_policy(items: list[Item], policy: Policy, now: datetime) -> list[Decision]:
    """Decides for every item; the result is ordered like the input."""
    decisions = {item.id: Decision(item.id, item.group, item.created, False) for item in items}
    groups: dict[str, list[Item]] = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    for members in groups.values():
        newest_first = sorted(members, key=lambda i: (i.created, i.id), reverse=True)
        for rank, item in enumerate(newest_first[:policy.keep_last]):
            decisions[item.id].reasons.append(f"last {rank + 1} of {policy.keep_last}")
        if policy.keep_within is not None:
            for item in newest_first:
                if item.created >= now - policy.keep_within:
                    decisions[item.id].reasons.append(f"within {format_duration(policy.keep_within)}")
        for label, bucket_of, attr in BUCKETS:
            wanted = getattr(policy, attr)
            seen: list[tuple] = []
            for item in newest_first:
                if len(seen) >= wanted:
                    break
                bucket = bucket_of(item.created)
                if bucket not in seen:
                    seen.append(bucket)
                    decisions[item.id].reasons.append(f"{label} {len(seen)} of {wanted}")
    for decision in decisions.values():
        decision.keep = bool(decision.reasons)
    return [decisions[item.id] for item in items]


def emptied_groups(decisions: list[Decision]) -> list[str]:
    """Groups in which the plan keeps nothing: the safety net refuses those unless told."""
    kept = {d.group for d in decisions if d.keep}
    return sorted({d.group for d in decisions} - kept)
