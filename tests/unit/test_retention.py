from datetime import datetime, timedelta, timezone

import pytest

from ckpt.errors import UsageError
from ckpt.schedule.retention import Item, Policy, apply_policy, emptied_groups, format_duration, parse_duration

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def items(*hours_ago, group="agent"):
    return [Item(f"{group}-{h}", group, NOW - timedelta(hours=h)) for h in hours_ago]


def kept(decisions):
    return sorted(d.id for d in decisions if d.keep)


@pytest.mark.parametrize("policy,hours_ago,expected", [
    (Policy(keep_last=2), [1, 2, 3, 4], ["agent-1", "agent-2"]),
    (Policy(keep_last=10), [1, 2], ["agent-1", "agent-2"]),
    (Policy(keep_within=timedelta(hours=2)), [1, 2, 3], ["agent-1", "agent-2"]),
    # One per hour: 1.0 and 1.5 hours ago fall in different clock hours (11:00 and 10:30).
    (Policy(keep_hourly=2), [0.25, 0.5, 1.5, 2.5], ["agent-0.25", "agent-1.5"]),
    (Policy(keep_daily=2), [1, 5, 25, 26, 50], ["agent-1", "agent-25"]),
    (Policy(keep_weekly=1), [1, 24 * 8], ["agent-1"]),
    (Policy(keep_last=1, keep_daily=2), [1, 2, 30], ["agent-1", "agent-30"]),
])
def test_policy_table(policy, hours_ago, expected):
    assert kept(apply_policy(items(*hours_ago), policy, NOW)) == sorted(expected)


def test_reasons_say_why_each_is_kept():
    decisions = apply_policy(items(1, 2, 30), Policy(keep_last=1, keep_daily=2), NOW)
    by_id = {d.id: d for d in decisions}
    assert by_id["agent-1"].reasons == ["last 1 of 1", "daily 1 of 2"]
    assert by_id["agent-30"].reasons == ["daily 2 of 2"]
    assert by_id["agent-2"].reasons == [] and not by_id["agent-2"].keep


def test_groups_are_judged_separately_and_emptied_groups_are_reported():
    all_items = items(1, 2, group="a") + items(30, 40, group="b")
    decisions = apply_policy(all_items, Policy(keep_within=timedelta(hours=3)), NOW)
    assert kept(decisions) == ["a-1", "a-2"]
    assert emptied_groups(decisions) == ["b"]
    decisions = apply_policy(all_items, Policy(keep_last=1), NOW)
    assert kept(decisions) == ["a-1", "b-30"] and emptied_groups(decisions) == []


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("5m", 300), ("2h", 7200), ("7d", 604800), ("1w", 604800)])
def test_durations(text, seconds):
    assert parse_duration(text).total_seconds() == seconds
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)


@pytest.mark.parametrize("bad", ["", "5", "m", "0m", "-1h", "1y", "1.5h"])
def test_bad_durations(bad):
    with pytest.raises(UsageError):
        parse_duration(bad)


def test_policy_json_round_trip():
    policy = Policy(keep_last=3, keep_within=timedelta(days=2), keep_daily=7)
    assert Policy.from_json(policy.to_json()) == policy
    assert Policy().empty() and not policy.empty()


@pytest.mark.parametrize("rule", ["keep_last", "keep_hourly", "keep_daily", "keep_weekly"])
def test_negative_counts_are_refused(rule):
    """A schedule with --keep-last -1 used to be installed, and kept 'last 1 of -1'."""
    with pytest.raises(UsageError, match=f"--{rule.replace('_', '-')} -1 is not a count"):
        Policy(**{rule: -1})
    with pytest.raises(UsageError):
        Policy.from_json({rule: -1})


@pytest.mark.parametrize("policy,flags", [
    (Policy(keep_last=3), "keep-last 3"),
    (Policy(keep_within=timedelta(days=2), keep_daily=7), "keep-within 2d, keep-daily 7"),
    (Policy(keep_last=1, keep_hourly=24, keep_weekly=4), "keep-last 1, keep-hourly 24, keep-weekly 4"),
    (Policy(), "keep everything"),
])
def test_policy_as_the_flags_that_give_it(policy, flags):
    # What a schedule's or a run's retention says it applied: forgot 2 checkpoints of 'a' (keep-last 3)
    assert policy.flags() == flags
