"""CronJob schedules read as intervals: the longest gap between two runs of a schedule, which sizes how
old a scheduled job's result may be before it is stale (the fabric verdict's two check intervals)."""

from __future__ import annotations

import datetime as dt

_CRON_FIELDS = (  # (low, high, names) of minute, hour, day of month, month, day of week
    (0, 59, ()),
    (0, 23, ()),
    (1, 31, ()),
    (1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    (0, 7, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)


def _cron_field(text: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    def value(v: str) -> int:
        v = v.upper()
        return names.index(v) + low if v in names else int(v)

    out: set[int] = set()
    for part in text.split(","):
        span, _, step = part.partition("/")
        if span in ("*", "?"):
            first, last = low, high
        elif "-" in span:
            first, last = (value(v) for v in span.split("-", 1))
        else:
            first = value(span)
            last = high if step else first
        if not (low <= first <= last <= high) or (step and int(step) < 1):
            raise ValueError(f"{part!r} is outside {low}-{high}")
        out.update(range(first, last + 1, int(step) if step else 1))
    return out


def longest_gap_s(schedule: str) -> int:
    """The longest time between two runs of a CronJob schedule (minute hour day-of-month month
    day-of-week, with names, ranges, lists and steps; a day matches either day field when both are
    restricted, as cron's), over eight years from 2024, which a leap-day schedule needs."""
    fields = schedule.split()
    try:
        if len(fields) != 5:
            raise ValueError("five fields are needed")
        minutes, hours, days, months, weekdays = (_cron_field(f, *spec) for f, spec in zip(fields, _CRON_FIELDS))
    except ValueError as e:
        raise ValueError(f"{schedule!r} is not a cron schedule: {e}") from None
    weekdays = {d % 7 for d in weekdays}  # 7 is Sunday too
    either = not fields[2].startswith(("*", "?")) and not fields[4].startswith(("*", "?"))
    daily = sorted(h * 60 + m for h in hours for m in minutes)
    gaps = [b - a for a, b in zip(daily, daily[1:])]
    previous = None
    start = dt.date(2024, 1, 1)
    for offset in range(8 * 366):
        day = start + dt.timedelta(days=offset)
        dom, dow = day.day in days, (day.weekday() + 1) % 7 in weekdays
        if day.month in months and ((dom or dow) if either else (dom and dow)):
            if previous is not None:
                gaps.append((offset - previous) * 1440 + daily[0] - daily[-1])
            previous = offset
    if previous is None or not gaps:
        raise ValueError(f"{schedule!r} runs at most once in eight years")
    return max(gaps) * 60
