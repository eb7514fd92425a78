"""The `pdserve` command line: `generate` and `bench` against a running service, and the README's
demo. (`up`: test_cli_up.py; flags, help, --version: test_cli_flags.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.services.service_testutil import ROOT, ServerProcess


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.client.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_streams_a_completion_and_reports_how_it_ended(server: ServerProcess):
    out = pdserve("generate", "hello", "--target", server.target, "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert "finish_reason=length" in out.stdout and "completion_tokens=5" in out.stdout
    chat = pdserve("generate", "hi", "--chat", "--target", server.target, "--max-tokens", "2")
    # The random model has no chat template: --chat sends messages, which the server refuses by name.
    assert chat.returncode == 1 and "INVALID_ARGUMENT" in chat.stderr and "chat template" in chat.stderr
    bad = pdserve("generate", "hello", "--target", server.target, "--max-tokens", "100000")
    assert bad.returncode == 1 and "max_tokens" in bad.stderr  # the server's refusal, named


def test_bench_shows_progress_and_results_with_units_and_names_its_errors(server: ServerProcess):
    small = ("--sessions", "2", "--turns", "2", "--turn-tokens", "4", "--output-tokens", "3")
    load = pdserve("bench", "--target", server.target, "--rate", "50", "--prefix-tokens", "16", *small)
    assert load.returncode == 0, load.stderr
    report = dict(line.strip().split(": ", 1) for line in load.stdout.splitlines()[1:])
    assert report["requests"] == "4 sent at 50 req/s, 4 ok, 0 failed" and report["errors"] == "none"
    assert report["TTFT"].startswith("p50 ") and report["TTFT"].endswith(" ms")
    assert " ms, p99 " in report["inter-token"] and report["end-to-end"].endswith(" ms")
    assert report["throughput"].endswith(" output tok/s") and " req/s, " in report["throughput"]
    assert "pdserve bench: [" in load.stderr and "sent 4/4, done 4, errors 0" in load.stderr
    # Prompts longer than the random model's 512-token context: every request refused, by name.
    over = pdserve("bench", "--target", server.target, "--rate", "50", "--prefix-tokens", "600", *small)
    assert over.returncode == 1
    assert "errors: INVALID_ARGUMENT x4" in over.stdout
    assert "context" in over.stdout.split("INVALID_ARGUMENT: ", 1)[1]


@pytest.mark.slow
def test_the_demo_answers_from_the_embedded_model_and_shuts_down_cleanly():
    out = pdserve("demo", "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout and "services stopped (exit 0)" in out.stdout
    assert "prefill on" in out.stdout  # both services ran; the chat prompt went to prefill
