"""A schedule as a systemd timer: its cron expression as OnCalendar= values, and the text of its
ckpt-NAME.service and ckpt-NAME.timer. Pure: book.py writes the files and asks systemctl.

The service runs what the cron line runs (`python -m ckpt schedule run NAME --store STORE`, its
output appended to the schedule's log) with the same variables; Persistent= makes systemd run a
schedule once at boot when its last time passed while the machine was off, which cron never does.
"""

from __future__ import annotations

from ckpt.schedule import cron

WEEKDAYS = ("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat")


def _values(values: set[int], full: range) -> str:
    return "*" if set(full) <= values else ",".join(str(v) for v in sorted(values))


def on_calendar(expr: str) -> list[str]:
    """OnCalendar= values that together fire exactly when Debian's cron runs `expr` (a checked
    expression), in the system's time zone as cron. Every field is written as the list of its
    values, so steps and ranges need no translation. Debian's cron runs a day that matches either
    day field when both are restricted and neither starts with '*': systemd ANDs the parts of one
    value, so that takes two values (a timer fires at the union of its OnCalendar= values)."""
    parsed = cron.fields(expr)
    weekdays = {d % 7 for d in parsed.weekdays if isinstance(d, int)}  # 7 is Sunday too; no '#' (refused)
    time = f"{_values(parsed.hours, range(24))}:{_values(parsed.minutes, range(60))}:00"
    months = _values(parsed.months, range(1, 13))
    days = _values(parsed.days, range(1, 32))
    week = "" if weekdays >= set(range(7)) else ",".join(WEEKDAYS[d] for d in sorted(weekdays)) + " "
    if parsed.day_and:
        return [f"{week}*-{months}-{days} {time}"]
    if days == "*" or not week:  # either field is every day: every day matches
        return [f"*-{months}-* {time}"]
    return [f"{week}*-{months}-* {time}", f"*-{months}-{days} {time}"]


def quote(text: str, variables: bool = True) -> str:
    """One word of a unit file's ExecStart= (variables: '$' is systemd's there) or Environment=:
    in double quotes, with '%' (specifiers) doubled, '\\' and '"' escaped."""
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return '"' + (text.replace("$", "$$") if variables else text) + '"'


def render_service(description: str, header: str, argv: list[str], environment: dict[str, str],
                   log: str) -> str:
    env_lines = "".join(f"Environment={quote(f'{k}={v}', variables=False)}\n" for k, v in environment.items())
    log = log.replace("%", "%%")
    return (f"{header}[Unit]\nDescription={description.replace('%', '%%')}\n\n"
            "[Service]\nType=oneshot\n"
            f"{env_lines}"
            f"ExecStart={' '.join(quote(a) for a in argv)}\n"
            f"StandardOutput=append:{log}\nStandardError=append:{log}\n")


def render_timer(description: str, header: str, expr: str, service: str) -> str:
    calendar = "".join(f"OnCalendar={value}\n" for value in on_calendar(expr))
    # AccuracySec: cron runs at the minute; systemd's default would let a run slip up to a minute.
    return (f"{header}# cron: {expr}\n[Unit]\nDescription={description.replace('%', '%%')}\n\n"
            f"[Timer]\n{calendar}Persistent=true\nAccuracySec=1s\nUnit={service}\n\n"
            "[Install]\nWantedBy=timers.target\n")
