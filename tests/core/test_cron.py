"""The longest gap between two runs of a CronJob schedule (what sizes the fabric verdict's maximum age)."""

from __future__ import annotations

import pytest

from supernode.core.cron import longest_gap_s

HOUR, DAY = 3600, 86400


@pytest.mark.parametrize(
    ("schedule", "gap_s"),
    [
        ("0 3 * * 0", 7 * DAY),  # the default: weekly
        ("*/30 * * * *", 1800),
        ("0 3 * * MON,THU", 4 * DAY),  # Thursday to Monday
        ("0 1,23 * * *", 22 * HOUR),
        ("0 0 31 * *", 61 * DAY),  # August 31st to October 31st
        ("0 0 1 * 1", 7 * DAY),  # both day fields restricted: either matches (the 1st, or a Monday)
        ("0 0 29 2 *", 1461 * DAY),  # a leap day: four years
    ],
)
def test_longest_gap_between_runs(schedule: str, gap_s: int) -> None:
    assert longest_gap_s(schedule) == gap_s


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("61 * * * *", "'61' is outside 0-59"),
        ("0 0 30 2 *", "runs at most once in eight years"),
        ("0 0 * *", "five fields are needed"),
    ],
)
def test_a_schedule_that_is_no_interval_is_refused(schedule: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        longest_gap_s(schedule)
