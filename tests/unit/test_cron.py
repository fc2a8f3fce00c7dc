from datetime import datetime, timedelta, timezone

import pytest

from ckpt.cron import every_to_cron, next_run, parse
from ckpt.errors import UsageError

T = datetime(2026, 11, 30, 10, 7, 30, tzinfo=timezone.utc)  # a Monday


@pytest.mark.parametrize("minutes,expr", [(1, "* * * * *"), (5, "*/5 * * * *"), (30, "*/30 * * * *"),
                                          (60, "0 * * * *"), (360, "0 */6 * * *"), (1440, "0 0 * * *"),
                                          (10080, "0 0 * * 0")])
def test_every_to_cron(minutes, expr):
    assert every_to_cron(timedelta(minutes=minutes)) == expr


@pytest.mark.parametrize("bad", [timedelta(seconds=30), timedelta(minutes=7), timedelta(minutes=90)])
def test_every_that_cron_cannot_express(bad):
    with pytest.raises(UsageError):
        every_to_cron(bad)


@pytest.mark.parametrize("expr,expected", [
    ("* * * * *", datetime(2026, 11, 30, 10, 8)),
    ("*/5 * * * *", datetime(2026, 11, 30, 10, 10)),
    ("0 * * * *", datetime(2026, 11, 30, 11, 0)),
    ("30 2 * * *", datetime(2026, 12, 1, 2, 30)),
    ("0 0 1 1 *", datetime(2027, 1, 1, 0, 0)),
    ("0 9 * * 0", datetime(2026, 12, 6, 9, 0)),  # next Sunday
    ("0 9 * * 7", datetime(2026, 12, 6, 9, 0)),  # 7 is Sunday too
    ("15 10-12 * * 1-5", datetime(2026, 11, 30, 10, 15)),
    ("0 0 13 * 5", datetime(2026, 12, 4, 0, 0)),  # day-of-month OR day-of-week when both are set
])
def test_next_run(expr, expected):
    assert next_run(expr, T) == expected.replace(tzinfo=timezone.utc)


@pytest.mark.parametrize("bad", ["* * * *", "60 * * * *", "* 24 * * *", "*/0 * * * *", "a * * * *",
                                 "5-2 * * * *", "* * 0 * *"])
def test_invalid_expressions(bad):
    with pytest.raises(UsageError):
        parse(bad)
