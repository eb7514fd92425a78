"""Prometheus metrics of one service process, served on `/metrics` (prometheus-client).

Names carry the `pdserve_` prefix and no colons (colons are reserved for recording rules). Every series
has a `service` label (decode | prefill) so one dashboard reads both roles. Each service owns its own
CollectorRegistry: two services built in one test process do not collide.

Cost: histograms are observed on the event loop (per token for the inter-token latency, a lock and a
bucket search); pool gauges are read at scrape time from `Scheduler.pool_state()`, so the scheduler
thread does no metrics work per step. Invariant hits are counted only when a violation is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.scheduler_types import PoolState

__all__ = ["Metrics", "serve_metrics"]

log = logging.getLogger(__name__)

# Seconds: 1 ms .. 60 s for latencies that span CPU test models and large GPU models.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class Metrics:
    """The metrics of one service (`service` = decode | prefill)."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        r, s = self.registry, ("service",)
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Request arrival to its first output token",
            s, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(service)  # fmt: skip
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between consecutive output tokens of a request",
            s, registry=r, buckets=_ITL_BUCKETS,
        ).labels(service)  # fmt: skip
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its end (any outcome)",
            s, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(service)  # fmt: skip
        self.queue = Histogram(
            "pdserve_request_queue_time_seconds", "Request arrival to KV pages and a window reserved",
            s, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(service)  # fmt: skip
        self.prefill = Histogram(
            "pdserve_prefill_seconds", "Prompt computation: admission to first token (this service)",
            s, registry=r, buckets=_LATENCY_BUCKETS,
        ).labels(service)  # fmt: skip
        self._requests = Counter(
            "pdserve_requests", "Finished requests by outcome (stop, length, abort, error)",
            ("service", "finish_reason"), registry=r,
        )  # fmt: skip
        self._tokens = Counter(
            "pdserve_tokens",
            "Tokens processed, by kind (prompt, completion)",
            ("service", "kind"),
            registry=r,
        )
        self._transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV cache bytes moved between services",
            ("service", "backend", "direction"), registry=r,
        )  # fmt: skip
        self._transfer_seconds = Histogram(
            "pdserve_kv_transfer_duration_seconds", "Duration of one request's KV transfer",
            ("service", "backend", "direction"), registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self._invariant_hits = Counter(
            "pdserve_invariant_hits", "Invariant violations detected (rows failing a check)",
            ("invariant", "severity", "service"), registry=r,
        )  # fmt: skip
        self._running = Gauge("pdserve_requests_running", "Requests in the engine's batch", s, registry=r)
        self._waiting = Gauge(
            "pdserve_requests_waiting", "Requests queued for KV pages or a slot", s, registry=r
        )
        self._pages_used = Gauge("pdserve_kv_pages_used", "KV pool pages in use", s, registry=r)
        self._pages_total = Gauge("pdserve_kv_pages_total", "KV pool pages", s, registry=r)
        self._kv_usage = Gauge(
            "pdserve_kv_usage_ratio", "Fraction of KV pool pages in use (0..1)", s, registry=r
        )

    def watch_pool(self, pool_state: Callable[[], PoolState]) -> None:
        """Read the running/waiting/KV gauges from `pool_state` at scrape time."""

        def pick(f: Callable[[PoolState], float]) -> Callable[[], float]:
            return lambda: f(pool_state())

        self._running.labels(self.service).set_function(pick(lambda p: p.running))
        self._waiting.labels(self.service).set_function(pick(lambda p: p.waiting))
        self._pages_used.labels(self.service).set_function(pick(lambda p: p.pages_total - p.pages_free))
        self._pages_total.labels(self.service).set_function(pick(lambda p: p.pages_total))
        self._kv_usage.labels(self.service).set_function(
            pick(lambda p: (p.pages_total - p.pages_free) / max(p.pages_total, 1))
        )

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._requests.labels(self.service, reason).inc()
        self._tokens.labels(self.service, "prompt").inc(prompt_tokens)
        self._tokens.labels(self.service, "completion").inc(completion_tokens)

    def transfer(self, backend: str, direction: str, nbytes: int, seconds: float) -> None:
        self._transfer_bytes.labels(self.service, backend, direction).inc(nbytes)
        self._transfer_seconds.labels(self.service, backend, direction).observe(seconds)

    def invariant_hits(self, name: str, severity: str, hits: int) -> None:
        self._invariant_hits.labels(name, severity, self.service).inc(hits)


def serve_metrics(metrics: Metrics, host: str, port: int, role: str) -> int | None:
    """Serve `/metrics` on HOST:PORT (0 = a free port, printed). Returns the port, None if it failed.

    A port that cannot be bound is logged, not fatal: the gRPC service matters more than its metrics.
    """
    addr = "0.0.0.0" if host in ("[::]", "::", "") else host.strip("[]")
    try:
        server, _ = start_http_server(port, addr=addr, registry=metrics.registry)
    except OSError as exc:
        log.error("metrics endpoint %s:%d not started: %s", addr, port, exc)
        return None
    bound = int(server.server_port)
    print(f"pdserve {role} metrics on {addr}:{bound}", flush=True)
    return bound
