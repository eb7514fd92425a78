"""tests/k8s: the manifests under k8s/ rendered offline and checked against the services' code."""

from __future__ import annotations

import pytest
from k8s_render import OVERLAYS, Obj, render


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def objs(overlay: str) -> tuple[Obj, ...]:
    return render(f"overlays/{overlay}")
