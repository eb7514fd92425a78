"""Prometheus metrics of one service process, served on `/metrics` (prometheus-client).

Names carry the `pdserve_` prefix and no colons (colons are reserved for recording rules). Every series
has a `service` label (decode | prefill) so one dashboard reads both roles. Each service owns its own
CollectorRegistry: two services built in one test process do not collide.

`/metrics` binds --metrics-host (default: the --host address; the wildcard serves IPv4 and IPv6).

Cost: histograms are observed on the event loop (per token for the inter-token latency, a lock and a
bucket search); pool gauges are read at scrape time from `Scheduler.pool_state()`, so the scheduler
thread does no metrics work per step. Invariant hits are counted only when a violation is reported.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from shared.serving.scheduler_types import PoolState

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
        self._prefill_route = Counter(
            "pdserve_prefill_route", "Requests by where their prompt was prefilled (local, remote) and why "
            "(no_prefill, short_prompt, prefill_mismatch, queue_deep, remote)",
            ("service", "prefill", "reason"), registry=r,
        )  # fmt: skip
        self._prefill_refused = Counter(
            "pdserve_prefill_layout_refusals", "Remote prefills refused for a KV layout mismatch "
            "(each prefilled locally instead)", s, registry=r,
        )  # fmt: skip
        self._remote_usable = Gauge(
            "pdserve_remote_prefill_usable", "1 while remote prefill is on; 0 while off after a layout "
            "mismatch (until a Handshake succeeds again)", s, registry=r,
        )  # fmt: skip
        self._queue_estimate = Gauge(
            "pdserve_prefill_queue_estimate_tokens", "Prompt tokens queued at the prefill service, as "
            "decode estimates them (conditional disaggregation)", s, registry=r,
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

    def watch_prefill(self, usable: Callable[[], bool], queue_estimate: Callable[[], int]) -> None:
        """Decode: read the remote-prefill state at scrape time."""
        self._remote_usable.labels(self.service).set_function(lambda: float(usable()))
        self._queue_estimate.labels(self.service).set_function(lambda: float(queue_estimate()))

    def prefill_route(self, where: str, reason: str) -> None:
        self._prefill_route.labels(self.service, where, reason).inc()

    def prefill_refused(self) -> None:
        self._prefill_refused.labels(self.service).inc()

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._requests.labels(self.service, reason).inc()
        self._tokens.labels(self.service, "prompt").inc(prompt_tokens)
        self._tokens.labels(self.service, "completion").inc(completion_tokens)

    def transfer(self, backend: str, direction: str, nbytes: int, seconds: float) -> None:
        self._transfer_bytes.labels(self.service, backend, direction).inc(nbytes)
        self._transfer_seconds.labels(self.service, backend, direction).observe(seconds)

    def invariant_hits(self, name: str, severity: str, hits: int) -> None:
        self._invariant_hits.labels(name, severity, self.service).inc(hits)


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper must not hold the process at exit

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            # Every IPv4 address too, whatever the host's net.ipv6.bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _start(addr: str, port: int, metrics: Metrics) -> WSGIServer:
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_cls = type("_MetricsServer", (_Server,), {"address_family": family})
    server = make_server(addr, port, make_wsgi_app(metrics.registry), server_cls, _Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def serve_metrics(metrics: Metrics, host: str, port: int, role: str) -> int | None:
    """Serve `/metrics` on HOST:PORT (0 = a free port, printed). Returns the port, None if it failed.

    HOST "", "::" or "[::]": every address, IPv4 and IPv6 (one dual-stack socket), or every IPv4 address
    where the host has no IPv6. A port that cannot be bound is logged, not fatal: the gRPC service
    matters more than its metrics.
    """
    addr = host.strip("[]") or "::"
    try:
        server = _start(addr, port, metrics)
    except OSError as exc:
        if addr != "::":
            log.error("metrics endpoint %s port %d not started: %s", addr, port, exc)
            return None
        try:
            server = _start("0.0.0.0", port, metrics)
        except OSError as exc4:
            log.error("metrics endpoint on port %d not started: [::]: %s; 0.0.0.0: %s", port, exc, exc4)
            return None
        log.info("metrics endpoint: IPv6 unavailable (%s), serving IPv4 only", exc)
        addr = "0.0.0.0"
    bound = int(server.server_port)
    shown = f"[{addr}]" if ":" in addr else addr
    print(f"pdserve {role} metrics on {shown}:{bound}", flush=True)
    return bound
