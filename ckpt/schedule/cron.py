"""Cron expressions as Debian's cron reads them: from --every, validation, and the next run time.

The next run is cronsim's, a library written to match Debian's cron (Vixie cron 3.0 with Debian's
patches), quirks included: when day-of-month and day-of-week are both restricted a day matching
either runs, but a field that starts with '*' ('*/2' too) makes both have to match; and jobs at
fixed hours are not lost or doubled across DST changes. cronsim reads more than Debian's cron
(seconds, 'L', 'W', '#', '5/10'): those are refused here first, since cron would refuse the line
("bad minute") and never run it, or, for '#', silently read only the number before it.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

from ckpt.errors import UsageError

FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")

# Debian's cron reads these by exact (lower-case) name. @reboot is refused in check().
MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
          "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}

# One item of a comma list, in Debian's grammar (entry.c get_range): '*' or a range, either
# with an optional step, or a single value without one. Values are numbers or, in the month and
# day-of-week fields, three-letter names; cronsim checks ranges and names.
def _item_re(value: str) -> re.Pattern[str]:
    return re.compile(rf"\*(?:/[0-9]+)?|{value}-{value}(?:/[0-9]+)?|{value}")


_NUMBERS, _NAMED = _item_re("[0-9]+"), _item_re("(?:[0-9]+|[A-Za-z]{3})")
_SINGLE_WITH_STEP = re.compile(r"(?:[0-9]+|[A-Za-z]{3})/[0-9]+")

SYNTAX_HINT = ("each field is *, a number, a name in month and day-of-week (jan, mon), a range a-b, "
               "*/n or a-b/n, or a comma list of these; or give @hourly, @daily, @weekly, @monthly or @yearly")


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


def _check_grammar(expr: str, fields: list[str]) -> None:
    if len(fields) != 5:
        raise UsageError(f"'{expr}' is not a cron expression",
                         hint="give five fields: minute hour day-of-month month day-of-week, e.g. '*/5 * * * *', "
                              "or @hourly, @daily, @weekly, @monthly or @yearly")
    for text, name in zip(fields, FIELDS, strict=True):
        grammar = _NAMED if name in ("month", "day-of-week") else _NUMBERS
        for item in text.split(","):
            if grammar.fullmatch(item):
                continue
            if _SINGLE_WITH_STEP.fullmatch(item):
                start = item.split("/")[0]
                raise UsageError(f"cron {name} field '{text}': cron reads a step only after * or a range",
                                 hint=f"write {start}-LAST/{item.split('/')[1]} (e.g. 5-59/10 for minutes)")
            raise UsageError(f"invalid cron {name} field '{text}'", hint=SYNTAX_HINT)


def _simulate(expr: str, after: datetime) -> CronSim:
    fields = MACROS.get(expr, expr).split()
    try:
        return CronSim(" ".join(fields), after)
    except CronSimError as exc:
        # cronsim says which field ("Bad day-of-week"): a value out of range, an unknown name, a
        # step of 0, a range that runs downwards (Debian's cron accepts 'fri-sun' but reads it as
        # no day at all), or days no month has (31 2).
        name = str(exc).removeprefix("Bad ")
        text = fields[FIELDS.index(name)] if name in FIELDS else expr
        raise UsageError(f"cron {name} field '{text}' is out of range or can never match",
                         hint="minute 0-59, hour 0-23, day-of-month 1-31, month 1-12 or jan-dec, day-of-week "
                              "0-7 or sun-sat (0 and 7 are Sunday); ranges go upwards (fri-sun is 5-7); "
                              "steps are 1 or more") from None


def fields(expr: str) -> CronSim:
    """How Debian's cron reads a checked expression: the sets of minutes, hours, days, months and
    weekdays (0-7, 0 and 7 Sunday) that cronsim parsed, and day_and (False: a day matching
    either day field runs)."""
    return _simulate(expr, datetime(2000, 1, 1))


def check(expr: str) -> str:
    """The expression as it will be written to cron (whitespace normalized); refuses what Debian's
    cron would refuse or read differently from what `next_run` computes."""
    expr = " ".join(expr.split())
    if expr == "@reboot":
        raise UsageError("'@reboot' runs once when cron starts, not periodically: it cannot checkpoint a process",
                         hint="give a period, e.g. --every 1h or --cron '@daily'")
    if expr.startswith("@"):
        if expr not in MACROS:
            raise UsageError(f"'{expr}' is not a cron schedule",
                             hint="cron knows @hourly, @daily (@midnight), @weekly, @monthly, @yearly (@annually), "
                                  "in lower case")
        return expr
    _check_grammar(expr, expr.split())
    next_run(expr, datetime(2000, 1, 1))  # values and ranges; an expression that never runs
    return expr


def next_run(expr: str, after: datetime) -> datetime:
    """The first time strictly after `after` (to the minute) at which cron would run `expr`.

    `after` should carry the time zone cron runs in (a zoneinfo zone, for DST to be handled as
    Debian's cron does); a naive datetime is taken as is.
    """
    try:
        return next(_simulate(expr, after))
    except StopIteration:  # cronsim looks 50 years ahead
        raise UsageError(f"cron expression '{expr}' never runs",
                         hint="check the day-of-month and month fields (e.g. 30 2 is never)") from None


def cron_now() -> datetime:
    """Now, in the zone cron runs in: the system's (/etc/localtime), as a zone with its DST rules
    rather than today's fixed offset, so that a next run across a DST change is cron's."""
    try:
        with open("/etc/localtime", "rb") as f:
            return datetime.now(ZoneInfo.from_file(f, key="localtime"))
    except (OSError, ValueError):
        return datetime.now().astimezone()
