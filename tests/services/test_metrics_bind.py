"""/metrics binds --metrics-host (env PDSERVE_METRICS_HOST): by default the --host address, and the
wildcard [::] serves IPv4 and IPv6 on one socket."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from decode_service.config import parse_args
from tests.services.service_testutil import ServerProcess, random_spec, stop_all
from tests.telemetry.telemetry_testutil import metrics_url


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200 and b"pdserve_" in resp.read()
    except (urllib.error.URLError, ConnectionError):
        return False


def test_metrics_host_flag_and_env() -> None:
    assert parse_args([], env={}).metrics_host == ""  # follows --host
    assert parse_args([], env={"PDSERVE_METRICS_HOST": "::"}).metrics_host == "::"
    assert parse_args(["--metrics-host", "127.0.0.1"], env={"PDSERVE_METRICS_HOST": "::"}).metrics_host == (
        "127.0.0.1"
    )


@needs_ipv6
def test_wildcard_serves_ipv4_and_ipv6() -> None:
    srv = ServerProcess(random_spec(), env={"PDSERVE_METRICS_HOST": "[::]"})  # gRPC on 127.0.0.1
    try:
        url = metrics_url(srv)
        port = url.rsplit(":", 1)[1].split("/")[0]
        assert url.startswith("http://[::]:")
        assert _answers(f"http://127.0.0.1:{port}/metrics")
        assert _answers(f"http://[::1]:{port}/metrics")
    finally:
        stop_all(srv)


@needs_ipv6
def test_a_specific_address_serves_only_there() -> None:
    srv = ServerProcess(random_spec(), "--metrics-host", "::1")
    try:
        url = metrics_url(srv)
        port = url.rsplit(":", 1)[1].split("/")[0]
        assert url == f"http://[::1]:{port}/metrics" and _answers(url)
        assert not _answers(f"http://127.0.0.1:{port}/metrics")
    finally:
        stop_all(srv)
