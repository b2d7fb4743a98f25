"""Process tests: every test here starts node or executor processes (the ``procs`` marker,
added to each; ``-m "not procs"`` runs the unit tests alone, in seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.procs)
