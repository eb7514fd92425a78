"""`pdserve bench`'s load generator: open-loop Poisson arrivals of an agentic trace, latency summary."""

from __future__ import annotations

import asyncio

from shared.client.loadgen import AgenticTrace, RequestStats, run_load, summarize
from tests.services.service_testutil import ServerProcess, random_spec


def test_the_agentic_trace_shares_a_prefix_and_grows_each_session():
    trace = AgenticTrace(sessions=3, turns=2, prefix_tokens=10, turn_tokens=4, output_tokens=2)
    prompts = trace.prompts(vocab=50)
    assert len(prompts) == 6
    assert all(p[:10] == prompts[0][:10] for p in prompts)  # the shared prefix
    assert [len(p) for p in prompts] == [14, 14, 14, 18, 18, 18]
    assert prompts[3][:14] == prompts[0]  # turn 2 of session 0 extends turn 1
    assert trace.prompts(vocab=50) == prompts  # seeded


def test_summary_percentiles_and_errors():
    stats = [
        RequestStats(10, sent=0.0, first=0.1 * i, done=1.0 + i, tokens=5, gaps=[0.01 * i] * 4)
        for i in range(1, 11)
    ]
    stats.append(RequestStats(10, sent=0.0, error="UNAVAILABLE"))
    r = summarize(stats, rate=5.0, wall_s=10.0)
    assert r.errors == {"UNAVAILABLE": 1} and r.requests == 11
    assert (r.ttft_p50, r.ttft_p99) == (0.5, 1.0)
    assert r.output_tok_s == 5.0 and r.requests_s == 1.0


def test_a_load_run_against_a_real_server():
    srv = ServerProcess(random_spec(), "--max-running", "4")
    try:
        trace = AgenticTrace(sessions=3, turns=2, prefix_tokens=24, turn_tokens=6, output_tokens=5)
        r = asyncio.run(run_load(srv.target, trace, rate=40.0))
        assert r.requests == 6 and r.errors == {}
        assert 0 < r.ttft_p50 <= r.e2e_p50 and r.itl_p50 > 0 and r.output_tok_s > 0
    finally:
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()
