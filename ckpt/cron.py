"""Cron expressions: from --every, validation, and the next run time. Pure functions."""

from __future__ import annotations

from datetime import datetime, timedelta

from ckpt.errors import UsageError

FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7))


def every_to_cron(every: timedelta) -> str:
    """A cron expression for 'every DURATION'. Cron's granularity is one minute."""
    minutes = int(every.total_seconds() // 60)
    if every.total_seconds() % 60 or minutes < 1:
        raise UsageError(f"cron cannot run every {int(every.total_seconds())} s",
                         hint="use whole minutes (1m or more), or 'ckpt run --every' for shorter periods")
    if minutes < 60 and 60 % minutes == 0:
        return "* * * * *" if minutes == 1 else f"*/{minutes} * * * *"
    if minutes % 60 == 0 and minutes // 60 < 24 and 24 % (minutes // 60) == 0:
        hours = minutes // 60
        return "0 * * * *" if hours == 1 else f"0 */{hours} * * *"
    if minutes == 1440:
        return "0 0 * * *"
    if minutes == 10080:
        return "0 0 * * 0"
    raise UsageError(f"cron cannot express 'every {minutes} minutes' exactly",
                     hint="use a divisor of an hour (1m, 5m, 15m, 30m) or of a day (1h, 2h, 6h, 12h), 1d, 1w, "
                          "or give --cron 'EXPR'")


def _parse_field(text: str, name: str, lo: int, hi: int) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/", 1)
            if not step_text.isdigit() or int(step_text) == 0:
                raise UsageError(f"invalid step in cron {name} field '{text}'")
            step = int(step_text)
        if part == "*":
            start, end = lo, hi
        elif "-" in part:
            a, b = part.split("-", 1)
            if not (a.isdigit() and b.isdigit()):
                raise UsageError(f"invalid range in cron {name} field '{text}'")
            start, end = int(a), int(b)
        elif part.isdigit():
            start = end = int(part)
            if step != 1:
                end = hi
        else:
            raise UsageError(f"invalid cron {name} field '{text}'", hint="use numbers, *, a-b, */n and commas")
        if start < lo or end > hi or start > end:
            raise UsageError(f"cron {name} field '{text}' is out of range {lo}-{hi}")
        values.update(range(start, end + 1, step))
    return values


def parse(expr: str) -> list[set[int]]:
    parts = expr.split()
    if len(parts) != 5:
        raise UsageError(f"'{expr}' is not a cron expression",
                         hint="give five fields: minute hour day-of-month month day-of-week, e.g. '*/5 * * * *'")
    fields = [_parse_field(p, name, lo, hi) for p, (name, lo, hi) in zip(parts, FIELDS)]
    if 7 in fields[4]:
        fields[4] = (fields[4] - {7}) | {0}
    return fields


def next_run(expr: str, after: datetime) -> datetime:
    """The first time strictly after `after` (to the minute) at which cron would run expr."""
    minutes, hours, days, months, weekdays = parse(expr)
    dom_any, dow_any = expr.split()[2] == "*", expr.split()[4] == "*"
    t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    limit = t + timedelta(days=366 * 5)
    while t < limit:
        if t.month not in months:
            t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
            continue
        dom_ok, dow_ok = t.day in days, (t.isoweekday() % 7) in weekdays
        day_ok = (dom_ok and dow_ok) if (dom_any or dow_any) else (dom_ok or dow_ok)
        if not day_ok:
            t = t.replace(hour=0, minute=0) + timedelta(days=1)
            continue
        if t.hour not in hours:
            t = t.replace(minute=0) + timedelta(hours=1)
            continue
        if t.minute not in minutes:
            t += timedelta(minutes=1)
            continue
        return t
    raise UsageError(f"cron expression '{expr}' never runs")
