"""Prometheus metrics of one service process, served on `/metrics` (prometheus-client).

Names carry the `pdserve_` prefix and no colons (colons are reserved for recording rules), and pass
`promtool check metrics` (tests/telemetry/test_metric_names.py): only counters end in `_total`, units
in base units (`_seconds`, `_bytes`, `_tokens`, `_ratio`). Every series has a `service` label (decode |
prefill), so one dashboard reads both roles, and `model_name` (the served model, as vLLM and SGLang
label theirs). Each service owns its own CollectorRegistry: two services built in one test process do
not collide.

`/metrics` is prometheus_client's own HTTP server, at --metrics-host (default: the --host address; the
wildcard serves IPv4 and IPv6).

Cost: histograms are observed on the event loop (per token for the inter-token latency, a lock and a
bucket search); pool gauges are read at scrape time from `Scheduler.pool_state()`, so the scheduler
thread does no metrics work per step. Invariant hits are counted only when a violation is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.serving.scheduler_types import PoolState

__all__ = ["Metrics", "serve_metrics"]

log = logging.getLogger(__name__)

# Seconds: 1 ms .. 60 s for latencies that span CPU test models and large GPU models.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class Metrics:
    """The metrics of one service (`service` = decode | prefill) serving one model (`model_name`, the
    name GetModelInfo reports: known once it has loaded, `bind_model`)."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.service = service
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, s = self.registry, ("service", "model_name")

        def latency(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, s, registry=r, buckets=buckets)

        self._ttft = latency(
            "pdserve_time_to_first_token_seconds", "Request arrival to its first output token"
        )
        self._itl = latency(
            "pdserve_inter_token_latency_seconds", "Time between consecutive output tokens of a request",
            _ITL_BUCKETS,
        )  # fmt: skip
        self._e2e = latency("pdserve_e2e_request_latency_seconds", "Request arrival to its end (any outcome)")
        self._queue = latency(
            "pdserve_request_queue_time_seconds", "Request arrival to KV pages and a window reserved"
        )
        self._prefill = latency(
            "pdserve_prefill_seconds", "Prompt computation: admission to first token (this service)"
        )
        self._requests = Counter(
            "pdserve_requests", "Finished requests by outcome (stop, length, abort, error)",
            (*s, "finish_reason"), registry=r,
        )  # fmt: skip
        self._tokens = Counter(
            "pdserve_tokens", "Tokens processed, by kind (prompt, completion)", (*s, "kind"), registry=r
        )
        self._transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV cache bytes moved between services",
            (*s, "backend", "direction"), registry=r,
        )  # fmt: skip
        self._transfer_seconds = Histogram(
            "pdserve_kv_transfer_duration_seconds", "Duration of one request's KV transfer",
            (*s, "backend", "direction"), registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self._prefill_route = Counter(
            "pdserve_prefill_route", "Requests by where their prompt was prefilled (local, remote) and why "
            "(no_prefill, short_prompt, prefill_mismatch, prefill_unavailable, prefill_busy, "
            "prefill_rejected, prefix_mismatch, queue_deep, remote)",
            (*s, "prefill", "reason"), registry=r,
        )  # fmt: skip
        self._prefill_refused = Counter(
            "pdserve_prefill_layout_refusals", "Remote prefills refused for a KV layout mismatch "
            "(each prefilled locally instead)", s, registry=r,
        )  # fmt: skip
        self._remote_usable = Gauge(
            "pdserve_remote_prefill_usable", "1 while some prefill replica is usable; 0 while every one is "
            "skipped after a layout mismatch or a timeout (until a Handshake succeeds again)", s, registry=r,
        )  # fmt: skip
        self._queue_estimate = Gauge(
            "pdserve_prefill_queue_estimate_tokens", "Prompt tokens queued at the prefill replicas "
            "(summed), as decode estimates them (conditional disaggregation)", s, registry=r,
        )  # fmt: skip
        self._queue_limit = Gauge(
            "pdserve_prefill_queue_limit_tokens", "Queued prompt tokens beyond which a prefill replica "
            "takes no prompt, summed over the replicas (--remote-prefill-max-queued-tokens; auto: measured "
            "drain rate x half the prefill timeout; 0: no limit)", s, registry=r,
        )  # fmt: skip
        self._invariant_hits = Counter(
            "pdserve_invariant_hits", "Invariant violations detected (rows failing a check)",
            ("invariant", "severity", *s), registry=r,
        )  # fmt: skip
        self._running = Gauge("pdserve_requests_running", "Requests in the engine's batch", s, registry=r)
        self._waiting = Gauge(
            "pdserve_requests_waiting", "Requests queued for KV pages or a slot", s, registry=r
        )
        self._pages_used = Gauge(
            "pdserve_kv_pages_used", "KV pool pages in use by requests (the prefix cache's not counted)", s,
            registry=r,
        )  # fmt: skip
        self._pages_cached = Gauge(
            "pdserve_kv_pages_cached", "KV pool pages the prefix cache keeps (evictable when unused)", s,
            registry=r,
        )  # fmt: skip
        self._pages_capacity = Gauge("pdserve_kv_pages_capacity", "KV pool pages in all", s, registry=r)
        self._kv_usage = Gauge(
            "pdserve_kv_usage_ratio", "Fraction of KV pool pages in use (0..1)", s, registry=r
        )
        self._pool_state: Callable[[], PoolState] | None = None
        r.register(_PrefixCacheCounters(self))
        self._bind()

    def bind_model(self, name: str) -> None:
        """Label the series with the served model's name: once it has loaded, before any request."""
        for family in (self._ttft, self._itl, self._e2e, self._queue, self._prefill):
            family.remove(self.service, self.model_name)
        self.model_name = name
        self._bind()

    def _bind(self) -> None:
        # The per-token and per-request histograms, labelled once: observed on the event loop.
        m = (self.service, self.model_name)
        self.ttft = self._ttft.labels(*m)
        self.itl = self._itl.labels(*m)
        self.e2e = self._e2e.labels(*m)
        self.queue = self._queue.labels(*m)
        self.prefill = self._prefill.labels(*m)

    def watch_pool(self, pool_state: Callable[[], PoolState]) -> None:
        """Read the running/waiting/KV gauges from `pool_state` at scrape time."""

        def pick(f: Callable[[PoolState], float]) -> Callable[[], float]:
            return lambda: f(pool_state())

        self._pool_state = pool_state
        m = (self.service, self.model_name)
        self._running.labels(*m).set_function(pick(lambda p: p.running))
        self._waiting.labels(*m).set_function(pick(lambda p: p.waiting))
        self._pages_used.labels(*m).set_function(
            pick(lambda p: p.pages_total - p.pages_free - p.pages_cached)
        )
        self._pages_cached.labels(*m).set_function(pick(lambda p: p.pages_cached))
        self._pages_capacity.labels(*m).set_function(pick(lambda p: p.pages_total))
        self._kv_usage.labels(*m).set_function(
            pick(lambda p: (p.pages_total - p.pages_free - p.pages_cached) / max(p.pages_total, 1))
        )

    def watch_prefill(
        self, usable: Callable[[], bool], queue_estimate: Callable[[], int], queue_limit: Callable[[], int]
    ) -> None:
        """Decode: read the remote-prefill state at scrape time."""
        m = (self.service, self.model_name)
        self._remote_usable.labels(*m).set_function(lambda: float(usable()))
        self._queue_estimate.labels(*m).set_function(lambda: float(queue_estimate()))
        self._queue_limit.labels(*m).set_function(lambda: float(queue_limit()))

    def prefill_route(self, where: str, reason: str) -> None:
        self._prefill_route.labels(self.service, self.model_name, where, reason).inc()

    def prefill_refused(self) -> None:
        self._prefill_refused.labels(self.service, self.model_name).inc()

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        m = (self.service, self.model_name)
        self._requests.labels(*m, reason).inc()
        self._tokens.labels(*m, "prompt").inc(prompt_tokens)
        self._tokens.labels(*m, "completion").inc(completion_tokens)

    def transfer(self, backend: str, direction: str, nbytes: int, seconds: float) -> None:
        m = (self.service, self.model_name)
        self._transfer_bytes.labels(*m, backend, direction).inc(nbytes)
        self._transfer_seconds.labels(*m, backend, direction).observe(seconds)

    def invariant_hits(self, name: str, severity: str, hits: int) -> None:
        self._invariant_hits.labels(name, severity, self.service, self.model_name).inc(hits)


class _PrefixCacheCounters(Collector):
    """The prefix cache's counters, read from the pool state at scrape time (the scheduler keeps the
    running totals; nothing is counted per step here)."""

    _COUNTERS = (
        ("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
         lambda p: p.prefix_queried_tokens),
        ("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed)",
         lambda p: p.prefix_hit_tokens),
        ("pdserve_prefix_cache_evicted_pages", "KV pool pages the prefix cache evicted (prefix pages "
         "and window snapshots)", lambda p: p.prefix_evicted_pages),
    )  # fmt: skip

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[CounterMetricFamily]:
        return [
            CounterMetricFamily(name, doc, labels=("service", "model_name"))
            for name, doc, _ in self._COUNTERS
        ]

    def collect(self) -> Iterator[CounterMetricFamily]:
        m = self._metrics
        state = m._pool_state() if m._pool_state is not None else None
        for name, doc, read in self._COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("service", "model_name"))
            if state is not None:
                family.add_metric((m.service, m.model_name), read(state))
            yield family


def _start(addr: str, port: int, metrics: Metrics) -> int:
    server, _ = start_http_server(port, addr, registry=metrics.registry)  # a daemon thread
    return int(server.server_port)


def serve_metrics(metrics: Metrics, host: str, port: int, role: str) -> int | None:
    """Serve `/metrics` on HOST:PORT (0 = a free port, printed) with prometheus_client's own server.
    Returns the port, None if it failed.

    HOST "", "::" or "[::]": every address, IPv4 and IPv6 (one IPv6 socket, which takes IPv4 too where
    net.ipv6.bindv6only is 0, Linux's default), or every IPv4 address where the host has no IPv6. A
    port that cannot be bound is logged, not fatal: the gRPC service matters more than its metrics.
    """
    addr = host.strip("[]") or "::"
    try:
        bound = _start(addr, port, metrics)
    except OSError as exc:
        if addr != "::":
            log.error("metrics endpoint %s port %d not started: %s", addr, port, exc)
            return None
        try:
            bound = _start("0.0.0.0", port, metrics)
        except OSError as exc4:
            log.error("metrics endpoint on port %d not started: [::]: %s; 0.0.0.0: %s", port, exc, exc4)
            return None
        log.info("metrics endpoint: IPv6 unavailable (%s), serving IPv4 only", exc)
        addr = "0.0.0.0"
    shown = f"[{addr}]" if ":" in addr else addr
    print(f"pdserve {role} metrics on {shown}:{bound}", flush=True)
    return bound
