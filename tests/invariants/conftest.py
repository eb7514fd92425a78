from __future__ import annotations

import pytest

import invariants


@pytest.fixture(autouse=True)
def fresh_checkers():
    """Each test sees new Checkers; levels are restored by `invariants.levels(...)` blocks."""
    invariants.reset_checkers()
    yield
    invariants.reset_checkers()
