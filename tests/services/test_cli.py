"""The `pdserve` command line: `generate` against a running service, and the README's demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.services.service_testutil import ROOT, ServerProcess, random_spec


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.client.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_streams_a_completion_and_reports_how_it_ended():
    srv = ServerProcess(random_spec())
    try:
        out = pdserve("generate", "hello", "--target", srv.target, "--max-tokens", "5")
        assert out.returncode == 0, out.stderr
        assert "finish_reason=length" in out.stdout and "completion_tokens=5" in out.stdout
        load = pdserve("bench", "--target", srv.target, "--rate", "50", "--sessions", "2", "--turns", "2",
                       "--prefix-tokens", "16", "--turn-tokens", "4", "--output-tokens", "3")  # fmt: skip
        assert load.returncode == 0, load.stderr
        assert "ttft_p99" in load.stdout and "errors: {}" in load.stdout
        bad = pdserve("generate", "hello", "--target", srv.target, "--temperature", "-1")
        assert bad.returncode == 1 and "temperature" in bad.stderr
    finally:
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()


@pytest.mark.slow
def test_the_demo_answers_from_the_embedded_model_and_shuts_down_cleanly():
    out = pdserve("demo", "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout and "services stopped (exit 0)" in out.stdout
    assert "prefill on" in out.stdout  # both services ran; the ChatML prompt went to prefill
