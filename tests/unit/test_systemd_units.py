"""ckpt/schedule/systemd.py: a schedule's timer fires when cron would run it, and its units are
ones systemd reads without a complaint (systemd-analyze, which needs no running systemd)."""

import os
import shutil
import subprocess
from datetime import datetime, timezone

import pytest

from ckpt.schedule import cron
from ckpt.schedule.book import Schedule, ScheduleBook
from ckpt.schedule.systemd import on_calendar
from tests.helpers import env_settings

needs_analyze = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")

EXPRESSIONS = [
    "* * * * *", "*/5 * * * *", "*/7 * * * *", "0 * * * *", "0 */6 * * *", "30 4 * * *", "@daily", "@weekly",
    "@monthly", "@yearly", "0 9 * * mon-fri", "5-59/10 1-3 * jan-mar 7", "0 0 * * 0", "0 0 * * 5-7",
    # both day fields restricted: a day matching either runs (two OnCalendar= values) ...
    "0 0 1,15 * mon", "15 12 13 * fri", "0 0 1-31 * mon",
    # ... unless one starts with '*': then both have to match
    "0 0 */2 * mon", "0 0 1,15 * *", "0 12 * 2 */2",
]


def _systemd_times(values: list[str], base: datetime, count: int) -> list[datetime]:
    proc = subprocess.run(["systemd-analyze", "calendar", f"--iterations={count}",
                           f"--base-time={base:%Y-%m-%d %H:%M:%S} UTC", *values],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "TZ": "UTC"})
    assert proc.returncode == 0, proc.stderr
    times = set()
    for line in proc.stdout.splitlines():
        if "Next elapse:" in line or "Iter. #" in line:
            stamp = line.split(": ", 1)[1].strip()  # "Mon 2025-03-31 00:00:00 UTC"
            times.add(datetime.strptime(stamp, "%a %Y-%m-%d %H:%M:%S UTC").replace(tzinfo=timezone.utc))
    return sorted(times)[:count]


@needs_analyze
@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_the_timer_fires_when_cron_would_run(expr):
    base = datetime(2025, 3, 30, 0, 0, 30, tzinfo=timezone.utc)
    expected, after = [], base
    for _ in range(12):
        after = cron.next_run(cron.check(expr), after)
        expected.append(after)
    assert _systemd_times(on_calendar(cron.check(expr)), base, 12) == expected, on_calendar(expr)


def test_both_day_fields_restricted_take_two_values():
    assert on_calendar("0 0 1,15 * mon") == ["Mon *-*-* 0:0:00", "*-*-1,15 0:0:00"]
    assert on_calendar("0 0 */2 * mon") == ["Mon *-*-1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31 0:0:00"]
    assert on_calendar("*/15 * * * *") == ["*-*-* *:0,15,30,45:00"]


@needs_analyze
def test_the_units_pass_systemd_analyze_verify(tmp_path, monkeypatch):
    """Quoting included: a store path with a space and '%', a target with '$' and '%', the
    variables of an S3 store and a password file (what the cron file carries too)."""
    monkeypatch.setenv("CKPT_SYSTEMD_DIR", str(tmp_path / "units"))
    monkeypatch.setenv("CKPT_PASSWORD_FILE", str(tmp_path / "pass word"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
    store = tmp_path / "my store%d"
    book = ScheduleBook(store, env_settings())
    schedule = Schedule(name="agent", target={"match": r"python3 agent\.py $HOME 50%"}, cron="0 0 1,15 * mon",
                        scheduler="systemd")
    where = book.install_timer(schedule, systemd_runs=False)
    units = tmp_path / "units"
    assert where == str(units / "ckpt-agent.timer")
    service = (units / "ckpt-agent.service").read_text()
    timer = (units / "ckpt-agent.timer").read_text()
    assert oct((units / "ckpt-agent.service").stat().st_mode & 0o777) == "0o644"
    assert "OnCalendar=Mon *-*-* 0:0:00\nOnCalendar=*-*-1,15 0:0:00\n" in timer and "Persistent=true" in timer
    assert "Unit=ckpt-agent.service" in timer and "WantedBy=timers.target" in timer
    # the command of the cron line, its output appended to the same log
    store_word = str(store).replace("%", "%%")
    assert f'"-m" "ckpt" "schedule" "run" "agent" "--store" "{store_word}"\n' in service
    log = str(book.log_path("agent")).replace("%", "%%")
    assert f"StandardOutput=append:{log}\nStandardError=append:{log}\n" in service
    for name, value in book.run_environment().items():
        assert f'Environment="{name}={value}"\n' in service
    assert f'Environment="CKPT_PASSWORD_FILE={tmp_path / "pass word"}"' in service
    assert 'Environment="AWS_ENDPOINT_URL=http://127.0.0.1:8333"' in service
    assert os.readlink(units / "timers.target.wants" / "ckpt-agent.timer") == "../ckpt-agent.timer"

    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", "ckpt-agent.timer", "ckpt-agent.service"],
                          cwd=units, capture_output=True, text=True, timeout=120)
    # verify exits 0 even when it ignores a line it cannot parse: its words are the verdict.
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr + proc.stdout

    book.remove_timer("agent", systemd_runs=False)
    assert sorted(p.name for p in units.rglob("*") if not p.is_dir()) == []
