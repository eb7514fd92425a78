"""`pdserve bench`: an open-loop load generator over the public API.

Arrivals are Poisson at a fixed rate and never wait for earlier requests (open loop: a slow server
builds a queue instead of slowing the load). The trace is prefill-heavy and agentic: each session
shares one long system prefix, every turn appends a tool result to its history and asks for a short
answer. Reported: TTFT, inter-token latency and end-to-end latency (p50/p99; seconds in `LoadResult`,
milliseconds in the printed report), output tok/s and request throughput, and errors by gRPC status
with the first message of each. While it runs, a progress line every few seconds (to stderr).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO

from shared.client.client import AsyncClient, GenerationError
from shared.client.credentials import Credentials

__all__ = ["AgenticTrace", "LoadResult", "RequestStats", "print_report", "run_load", "summarize"]

PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class AgenticTrace:
    sessions: int = 8
    turns: int = 4
    prefix_tokens: int = 1024  # the shared system prompt + tool schemas
    turn_tokens: int = 256  # tool output appended per turn
    output_tokens: int = 32
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.sessions * self.turns

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
    error: str = ""  # the gRPC status code's name when the request failed
    detail: str = ""  # and its message


@dataclass(frozen=True)
class LoadResult:
    rate: float
    requests: int
    errors: dict[str, int]  # gRPC status code name -> requests that ended with it
    wall_s: float
    output_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float
    error_examples: dict[str, str] = field(default_factory=dict)  # code name -> its first message

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


async def _one(
    client: AsyncClient, prompt: list[int], max_tokens: int, stats: RequestStats, timeout: float | None
) -> None:
    try:
        last = stats.sent
        stream = client.generate(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout
        )
        async for chunk in stream:
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
        stats.detail = err.details
    except Exception as exc:  # not a gRPC status (the channel broke, say): named by its type
        stats.error, stats.detail = type(exc).__name__, str(exc)
    finally:
        stats.done = stats.done or time.perf_counter()


def _progress_line(stats: list[RequestStats], total: int, start: float) -> str:
    done = [s for s in stats if s.done is not None]
    failed = sum(1 for s in done if s.error)
    tokens = sum(s.tokens for s in stats)
    took = time.perf_counter() - start
    return (
        f"[{took:5.1f} s] sent {len(stats)}/{total}, done {len(done) - failed}, errors {failed}, "
        f"in flight {len(stats) - len(done)}, {tokens / max(took, 1e-9):.1f} output tok/s"
    )


async def _report_progress(
    stats: list[RequestStats], total: int, start: float, show: Callable[[str], None], every: float
) -> None:
    while True:
        await asyncio.sleep(every)
        show(_progress_line(stats, total, start))


async def run_load(
    target: str, trace: AgenticTrace, rate: float, *, vocab: int | None = None,
    timeout: float | None = None, progress: Callable[[str], None] | None = None,
    progress_every: float = PROGRESS_EVERY_S, credentials: Credentials | None = None,
) -> LoadResult:  # fmt: skip
    """Send the trace's requests at Poisson(rate) arrival times; wait for all of them. `timeout`: each
    request's deadline (DEADLINE_EXCEEDED past it); `progress` gets a line every `progress_every` s;
    `credentials`: TLS and a bearer token for the connection (None: plaintext, no token)."""
    async with AsyncClient(target, credentials=credentials) as client:
        vocab = vocab or (await client.model_info(timeout=30)).vocab_size
        prompts = trace.prompts(vocab)
        rng = random.Random(trace.seed + 1)
        start = time.perf_counter()
        tasks, all_stats = [], []
        reporter = None
        if progress is not None:
            reporter = asyncio.create_task(
                _report_progress(all_stats, len(prompts), start, progress, progress_every)
            )
        try:
            at = 0.0
            for prompt in prompts:
                at += rng.expovariate(rate)
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                stats = RequestStats(len(prompt), time.perf_counter())
                all_stats.append(stats)
                tasks.append(asyncio.create_task(_one(client, prompt, trace.output_tokens, stats, timeout)))
            await asyncio.gather(*tasks)
        finally:
            if reporter is not None:
                reporter.cancel()
        if progress is not None:
            progress(_progress_line(all_stats, len(prompts), start))
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
    examples: dict[str, str] = {}
    for s in stats:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
            examples.setdefault(s.error, s.detail)
    ttft = [s.first - s.sent for s in ok]  # type: ignore[operator]
    e2e = [s.done - s.sent for s in ok]  # type: ignore[operator]
    gaps = [g for s in ok for g in s.gaps]
    return LoadResult(
        rate=rate, requests=len(stats), errors=errors, wall_s=wall_s,
        output_tok_s=sum(s.tokens for s in ok) / wall_s, requests_s=len(ok) / wall_s,
        ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99), itl_p50=_pct(gaps, 0.5),
        itl_p99=_pct(gaps, 0.99), e2e_p50=_pct(e2e, 0.5), e2e_p99=_pct(e2e, 0.99),
        error_examples=examples,
    )  # fmt: skip


def print_report(r: LoadResult, out: IO[str] | None = None) -> None:
    """The result for a person: latencies in ms, throughput in tok/s and req/s, errors named."""
    out = out or sys.stdout
    ms = lambda seconds: "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"
    ok = r.requests - sum(r.errors.values())
    rows = [
        ("requests", f"{r.requests} sent at {r.rate:g} req/s, {ok} ok, {sum(r.errors.values())} failed"),
        ("wall time", f"{r.wall_s:.2f} s"),
        ("throughput", f"{r.requests_s:.2f} req/s, {r.output_tok_s:.1f} output tok/s"),
        ("TTFT", f"p50 {ms(r.ttft_p50)}, p99 {ms(r.ttft_p99)}"),
        ("inter-token", f"p50 {ms(r.itl_p50)}, p99 {ms(r.itl_p99)}"),
        ("end-to-end", f"p50 {ms(r.e2e_p50)}, p99 {ms(r.e2e_p99)}"),
        ("errors", "none" if not r.errors else ", ".join(f"{c} x{n}" for c, n in sorted(r.errors.items()))),
    ]
    for name, value in rows:
        print(f"{name:>12s}: {value}", file=out)
    for code, message in sorted(r.error_examples.items()):
        print(f"{'':>12s}  {code}: {message or '(no message)'}", file=out)
    out.flush()
