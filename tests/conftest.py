"""The suite's order: the modules with slow (multi-process) tests first, the many quick ones after.
pytest-xdist hands tests to its workers in collection order, and collected alphabetically the long
trainer tests came last, so one worker still ran them while the other had nothing left. A module's
tests stay together (its module-scoped fixtures, such as the wheel install, are set up once)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in slow_modules)  # stable: the order inside each group is kept
