"""Fixtures: one shared subprocess decode server with the tiny random model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.client.client import Client
from tests.services.service_testutil import ServerProcess, random_spec


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        random_spec(), "--max-running", "4", "--max-queue", "8", "--page-size", "4", "--reflection"
    )
    try:
        yield srv
        srv.terminate()
        assert srv.wait() == 0
    finally:
        srv.kill()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c
