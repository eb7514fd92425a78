"""One request's server span, its phase spans and its latency metrics, driven from the event loop.

The servicer creates a `RequestTrace` per call and feeds it what it already sees: the scheduler's
events carry the times the scheduler thread stamped (admission, first token), and phase spans are
made after the fact with those explicit start and end times. So the scheduler thread does no span
work, and with tracing off (no tracer) every span call here is skipped; only the metrics remain.

GenAI semantic conventions on the server span: gen_ai.operation.name, gen_ai.request.model,
gen_ai.request.max_tokens / temperature / top_p, gen_ai.usage.input_tokens / output_tokens,
gen_ai.response.finish_reasons, gen_ai.response.id; plus pdserve.queue_time_s and
pdserve.time_to_first_token_s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.serving.telemetry import Telemetry, extract_context, inject_context

__all__ = ["RequestTrace", "transfer_attrs"]

Attrs = Mapping[str, Any]


def transfer_attrs(backend: str, direction: str, nbytes: int, seconds: float) -> dict[str, Any]:
    """A KV transfer span's attributes: backend, bytes, duration and throughput."""
    return {
        "pdserve.kv.backend": backend,
        "pdserve.kv.direction": direction,
        "pdserve.kv.bytes": nbytes,
        "pdserve.kv.duration_s": seconds,
        "pdserve.kv.gbps": nbytes / max(seconds, 1e-9) / 1e9,  # GB/s
    }


class RequestTrace:
    def __init__(
        self, tel: Telemetry, rid: str, method: str, metadata: Sequence[tuple[str, Any]] | None,
        attrs: Attrs,
    ) -> None:  # fmt: skip
        self.tel = tel
        self.rid = rid
        self.start_ns = time.time_ns()
        self.first_ns = 0
        self._last_ns = 0
        self._admitted_ns = 0
        self._ended = False
        self.decode_phase = False  # decode service: a "decode" span from the first token to the end
        self.span: trace.Span | None = None
        if tel.tracer is not None:
            service, _, name = method.rpartition("/")
            rpc = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
            self.span = tel.tracer.start_span(
                method, context=extract_context(metadata), kind=SpanKind.SERVER,
                attributes={**rpc, **attrs}, start_time=self.start_ns,
            )  # fmt: skip
            tel.register(rid, self.span)

    # ---- phases ----

    @property
    def ended(self) -> bool:
        return self._ended

    def child(
        self, name: str, start_ns: int, end_ns: int, attrs: Attrs | None = None, parent: Any = None
    ) -> None:
        """A finished phase span under the request span (or `parent`), with the times the scheduler
        stamped."""
        if self.span is None or self.tel.tracer is None:
            return
        ctx = trace.set_span_in_context(parent if parent is not None else self.span)
        s = self.tel.tracer.start_span(name, context=ctx, attributes=attrs, start_time=start_ns)
        s.end(end_time=max(end_ns, start_ns))

    def set_attributes(self, attrs: Attrs) -> None:
        """Set (or overwrite) attributes of the request span, e.g. a routing decision that changed."""
        if self.span is not None:
            self.span.set_attributes(attrs)

    def queued(self, admitted_ns: int) -> None:
        """The request got its pages and window at `admitted_ns` (scheduler clock, epoch ns)."""
        if not admitted_ns or self._admitted_ns:
            return
        self._admitted_ns = admitted_ns
        wait_s = max(admitted_ns - self.start_ns, 0) / 1e9
        if self.tel.metrics is not None:
            self.tel.metrics.queue.observe(wait_s)
        if self.span is not None:
            self.span.set_attribute("pdserve.queue_time_s", wait_s)
            self.child("queue", self.start_ns, admitted_ns, {"pdserve.queue_time_s": wait_s})

    def tokens(self, n: int) -> None:
        """`n` output tokens reached the servicer now."""
        if n <= 0:
            return
        now = time.time_ns()
        m = self.tel.metrics
        if not self.first_ns:
            self.first_ns = self._last_ns = now
            ttft = (now - self.start_ns) / 1e9
            if m is not None:
                m.ttft.observe(ttft)
                if self._admitted_ns:
                    m.prefill.observe(max(now - self._admitted_ns, 0) / 1e9)
            if self.span is not None:
                self.span.set_attribute("pdserve.time_to_first_token_s", ttft)
                self.span.add_event("first_token")
            n -= 1
        if n > 0 and m is not None:
            # A lagging client gets tokens in batches: spread the gap over the tokens it carried
            # (tokens that came with the first one arrived with no gap).
            gap = (now - self._last_ns) / 1e9 / n
            for _ in range(n):
                m.itl.observe(gap)
        self._last_ns = now

    @contextlib.contextmanager
    def client_call(
        self, name: str, attrs: Attrs | None = None
    ) -> Iterator[tuple[list[tuple[str, str]], Any]]:
        """A CLIENT span around an outgoing call: yields (metadata carrying traceparent, span or None)."""
        if self.span is None or self.tel.tracer is None:
            yield [], None
            return
        ctx = trace.set_span_in_context(self.span)
        service, _, method = name.rpartition("/")
        rpc = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        with self.tel.tracer.start_as_current_span(
            name, context=ctx, kind=SpanKind.CLIENT, attributes={**rpc, **(attrs or {})},
            record_exception=True, set_status_on_exception=True,
        ) as span:  # fmt: skip
            yield inject_context(trace.set_span_in_context(span)), span

    # ---- the end ----

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._end(reason, prompt_tokens, completion_tokens, None, "")

    def fail(
        self, code: grpc.StatusCode, message: str, prompt_tokens: int = 0, completion_tokens: int = 0,
        *, reason: str = "error",
    ) -> None:  # fmt: skip
        """The request ended without a Complete: `reason` "error", or "cancelled" / "deadline" when the
        client left or its deadline passed (counted apart: neither is the server's failure)."""
        self._end(reason, prompt_tokens, completion_tokens, code, message)

    def _end(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        code: grpc.StatusCode | None,
        message: str,
    ) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.time_ns()
        m = self.tel.metrics
        if m is not None:
            m.e2e.observe((now - self.start_ns) / 1e9)
            m.finished(reason, prompt_tokens, completion_tokens)
        if self.span is None:
            return
        if self.decode_phase and self.first_ns:
            self.child("decode", self.first_ns, now, {"gen_ai.usage.output_tokens": completion_tokens})
        span, self.span = self.span, None
        self.tel.unregister(self.rid)
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_attribute("error.type", code.name)
            span.set_status(Status(StatusCode.ERROR, message))
        else:
            span.set_attribute("rpc.grpc.status_code", 0)
        span.end(end_time=now)
