"""Cron expressions: what Debian's cron accepts, and the next run it would use.

The expected next runs of the day-field cases were observed on Debian's cron itself (3.0pl1-162,
run under a sped-up fake clock in a private mount namespace), not derived from ckpt's code."""

import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from ckpt.errors import UsageError
from ckpt.schedule.cron import check, every_to_cron, next_run

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


NEXT_RUNS = [
    ("* * * * *", datetime(2026, 11, 30, 10, 8)),
    ("*/5 * * * *", datetime(2026, 11, 30, 10, 10)),
    ("0 * * * *", datetime(2026, 11, 30, 11, 0)),
    ("30 2 * * *", datetime(2026, 12, 1, 2, 30)),
    ("0 0 1 1 *", datetime(2027, 1, 1, 0, 0)),
    ("0 9 * * 0", datetime(2026, 12, 6, 9, 0)),  # next Sunday
    ("0 9 * * 7", datetime(2026, 12, 6, 9, 0)),  # 7 is Sunday too
    ("15 10-12 * * 1-5", datetime(2026, 11, 30, 10, 15)),
    ("1,2-5/2,*/7 * * * *", datetime(2026, 11, 30, 10, 14)),  # lists mixing ranges and steps
    ("0-59/70 * * * *", datetime(2026, 11, 30, 11, 0)),  # a step past the range: its start only
    ("0 0 29 2 *", datetime(2028, 2, 29, 0, 0)),
    # Names, any case, in ranges, lists and with steps.
    ("0 12 * * mon-fri", datetime(2026, 11, 30, 12, 0)),
    ("0 0 * * SAT", datetime(2026, 12, 5, 0, 0)),
    ("0 0 * * Fri-7", datetime(2026, 12, 4, 0, 0)),
    ("0 0 1 feb,Mar *", datetime(2027, 2, 1, 0, 0)),
    ("0 0 1 jan-dec/5 *", datetime(2027, 1, 1, 0, 0)),  # jan, jun, nov
    # Day of month and day of week: when both are restricted, either one runs...
    ("0 0 13 * 5", datetime(2026, 12, 4, 0, 0)),
    ("0 0 1,15 * sun", datetime(2026, 12, 1, 0, 0)),
    ("0 0 1-31/2 * 1", datetime(2026, 12, 1, 0, 0)),
    # ...but a field that starts with '*' counts as unrestricted even with a step, and then both
    # must match: odd days that are Mondays (Dec 1 is odd, a Tuesday), the 13th on an even day
    # of the week (Dec 13 is a Sunday; Dec 1 is a Tuesday).
    ("0 0 */2 * 1", datetime(2026, 12, 7, 0, 0)),
    ("0 0 13 * */2", datetime(2026, 12, 13, 0, 0)),
    ("0 0 */3 * *", datetime(2026, 12, 1, 0, 0)),
    ("0 0 * * */3", datetime(2026, 12, 2, 0, 0)),  # Sunday, Wednesday, Saturday
    # Debian's @ names.
    ("@hourly", datetime(2026, 11, 30, 11, 0)),
    ("@daily", datetime(2026, 12, 1, 0, 0)),
    ("@midnight", datetime(2026, 12, 1, 0, 0)),
    ("@weekly", datetime(2026, 12, 6, 0, 0)),
    ("@monthly", datetime(2026, 12, 1, 0, 0)),
    ("@yearly", datetime(2027, 1, 1, 0, 0)),
    ("@annually", datetime(2027, 1, 1, 0, 0)),
]


@pytest.mark.parametrize("expr,expected", NEXT_RUNS)
def test_next_run(expr, expected):
    assert check(expr) == expr
    assert next_run(expr, T) == expected.replace(tzinfo=timezone.utc)


def test_next_run_is_strictly_after_to_the_minute():
    assert next_run("*/5 * * * *", datetime(2026, 11, 30, 10, 10, tzinfo=timezone.utc)) == \
        datetime(2026, 11, 30, 10, 15, tzinfo=timezone.utc)


def test_next_run_across_dst_changes_is_crons():
    """Debian's cron runs a fixed-time job of a skipped hour right after the jump, and does not
    run it again in a repeated hour; more frequent jobs run by the clock."""
    berlin = ZoneInfo("Europe/Berlin")
    spring = next_run("30 2 * * *", datetime(2027, 3, 28, 1, 0, tzinfo=berlin))
    assert (spring.replace(tzinfo=None), spring.utcoffset()) == (datetime(2027, 3, 28, 3, 0), timedelta(hours=2))
    autumn = next_run("30 2 * * *", datetime(2027, 10, 31, 2, 45, tzinfo=berlin))  # 02:30 CEST has run
    assert autumn.replace(tzinfo=None) == datetime(2027, 11, 1, 2, 30)
    again = next_run("*/30 * * * *", datetime(2027, 10, 31, 2, 45, tzinfo=berlin))
    assert (again.replace(tzinfo=None), again.utcoffset()) == (datetime(2027, 10, 31, 2, 0), timedelta(hours=1))


def test_whitespace_is_normalized():
    assert check("  */5\t* *  * * ") == "*/5 * * * *"


REFUSED = [
    ("* * * *", "five fields"),
    ("0 0 * * * *", "five fields"),  # seconds first, as cronsim and croniter read six fields
    ("60 * * * *", "minute field '60'"),
    ("* 24 * * *", "hour field '24'"),
    ("* * 0 * *", "day-of-month field '0'"),
    ("* * * 0 *", "month field '0'"),
    ("* * * 13 *", "month field '13'"),
    ("* * * * 8", "day-of-week field '8'"),
    ("*/0 * * * *", "minute field '*/0'"),
    ("* * * * 1-5/0", "day-of-week field '1-5/0'"),
    ("a * * * *", "minute field 'a'"),
    ("jan * * * *", "minute field 'jan'"),  # names only in month and day of week
    ("0 0 * mon *", "month field 'mon'"),
    ("0 0 * * monday", "day-of-week field 'monday'"),
    ("1,,2 * * * *", "minute field '1,,2'"),
    ("* * * * 1,", "day-of-week field '1,'"),
    ("-5 * * * *", "minute field '-5'"),
    ("5- * * * *", "minute field '5-'"),
    # Debian's cron refuses these ("bad minute") where cronsim and croniter would accept them.
    ("5/10 * * * *", "a step only after * or a range"),
    ("0 0 L * *", "day-of-month field 'L'"),
    ("0 0 LW * *", "day-of-month field 'LW'"),
    ("0 0 * * 5L", "day-of-week field '5L'"),
    ("0 0 ? * *", "day-of-month field '?'"),
    ("H * * * *", "minute field 'H'"),
    ("@Daily", "in lower case"),
    ("@every 5m", "is not a cron schedule"),
    # Debian's cron accepts these but never runs them, or not as written: '0#2' is read as 0
    # (the rest of the field is skipped), a downward range as no day at all.
    ("0 0 * * 0#2", "day-of-week field '0#2'"),
    ("0 0 * * fri-sun", "ranges go upwards"),
    ("0 0 5-2 * *", "day-of-month field '5-2'"),
    ("0 0 31 2 *", "can never match"),
    ("0 0 31 2,4 *", "can never match"),
    ("@reboot", "runs once when cron starts"),
]


@pytest.mark.parametrize("bad,words", REFUSED)
def test_invalid_expressions(bad, words):
    with pytest.raises(UsageError) as info:
        check(bad)
    assert words in str(info.value) and info.value.hint, str(info.value)


@pytest.mark.skipif(not shutil.which("crontab"), reason="needs Debian's crontab")
def test_debians_crontab_agrees_on_what_it_refuses(tmp_path):
    """Everything ckpt accepts, Debian's own parser (`crontab -n`, a dry run) accepts; what it
    refuses, ckpt refuses. Catches a grammar check here that drifts from cron's."""
    (tmp_path / "empty").write_text("")
    probe = subprocess.run(["crontab", "-n", str(tmp_path / "empty")], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this crontab has no dry run (-n): {probe.stderr.strip()}")

    def debian_accepts(expr: str) -> bool:
        tab = tmp_path / "tab"
        tab.write_text(f"{expr} true\n")
        return subprocess.run(["crontab", "-n", str(tab)], capture_output=True, timeout=30).returncode == 0

    for expr, _ in NEXT_RUNS:
        assert debian_accepts(expr), expr
    # Refused by ckpt only: cron would read them as something else, or never run them.
    refused_by_ckpt_only = {"0 0 * * 0#2", "0 0 * * fri-sun", "0 0 5-2 * *", "0 0 31 2 *",
                            "0 0 31 2,4 *", "@reboot"}
    for expr, _ in REFUSED:
        assert debian_accepts(expr) == (expr in refused_by_ckpt_only), expr
