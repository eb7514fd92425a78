"""`pdserve bench`: an open-loop load generator over the public API.

Arrivals are Poisson at a fixed rate and never wait for earlier requests (open loop: a slow server
builds a queue instead of slowing the load). The trace is prefill-heavy and agentic: each session
shares one long system prefix, every turn appends a tool result to its history and asks for a short
answer. Reported: TTFT, inter-token latency and end-to-end latency (p50/p99, seconds), output tok/s
and request throughput, and errors by gRPC status.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field

from shared.client.client import AsyncClient, GenerationError

__all__ = ["AgenticTrace", "LoadResult", "RequestStats", "run_load", "summarize"]


@dataclass(frozen=True)
class AgenticTrace:
    sessions: int = 8
    turns: int = 4
    prefix_tokens: int = 1024  # the shared system prompt + tool schemas
    turn_tokens: int = 256  # tool output appended per turn
    output_tokens: int = 32
    seed: int = 0

    def prompts(self, vocab: int) -> list[list[int]]:
        """Requests in arrival order: turn t of every session, then turn t+1 (histories grow)."""
        rng = random.Random(self.seed)
        draw = lambda n: [rng.randrange(vocab) for _ in range(n)]
        prefix = draw(self.prefix_tokens)
        histories = [list(prefix) for _ in range(self.sessions)]
        out = []
        for _ in range(self.turns):
            for h in histories:
                h += draw(self.turn_tokens)
                out.append(list(h))
        return out


@dataclass
class RequestStats:
    prompt_tokens: int
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # per output token after the first
    error: str = ""


@dataclass(frozen=True)
class LoadResult:
    rate: float
    requests: int
    errors: dict[str, int]
    wall_s: float
    output_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


async def _one(client: AsyncClient, prompt: list[int], max_tokens: int, stats: RequestStats) -> None:
    try:
        last = stats.sent
        async for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if stats.first is None:
                stats.first = now
                n -= 1
            if n > 0:  # a chunk carrying several tokens spreads its gap over them
                stats.gaps += [(now - last) / n] * n
            stats.tokens += len(chunk.token_ids)
            last = now
        stats.done = time.perf_counter()
    except GenerationError as err:
        stats.error = err.code.name if err.code else "UNKNOWN"


async def run_load(target: str, trace: AgenticTrace, rate: float, *, vocab: int | None = None) -> LoadResult:
    """Send the trace's requests at Poisson(rate) arrival times; wait for all of them."""
    async with AsyncClient(target) as client:
        vocab = vocab or (await client.model_info()).vocab_size
        prompts = trace.prompts(vocab)
        rng = random.Random(trace.seed + 1)
        start = time.perf_counter()
        tasks, all_stats = [], []
        at = 0.0
        for prompt in prompts:
            at += rng.expovariate(rate)
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            stats = RequestStats(len(prompt), time.perf_counter())
            all_stats.append(stats)
            tasks.append(asyncio.create_task(_one(client, prompt, trace.output_tokens, stats)))
        await asyncio.gather(*tasks)
        return summarize(all_stats, rate, time.perf_counter() - start)


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q of the values at or below it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def summarize(stats: list[RequestStats], rate: float, wall_s: float) -> LoadResult:
    ok = [s for s in stats if not s.error and s.first is not None and s.done is not None]
    errors: dict[str, int] = {}
    for s in stats:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    ttft = [s.first - s.sent for s in ok]  # type: ignore[operator]
    e2e = [s.done - s.sent for s in ok]  # type: ignore[operator]
    gaps = [g for s in ok for g in s.gaps]
    return LoadResult(
        rate=rate, requests=len(stats), errors=errors, wall_s=wall_s,
        output_tok_s=sum(s.tokens for s in ok) / wall_s, requests_s=len(ok) / wall_s,
        ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99), itl_p50=_pct(gaps, 0.5),
        itl_p99=_pct(gaps, 0.99), e2e_p50=_pct(e2e, 0.5), e2e_p99=_pct(e2e, 0.99),
    )  # fmt: skip
