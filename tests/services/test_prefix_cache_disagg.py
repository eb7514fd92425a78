"""Decode's prefix cache on the disaggregated path: decode asks prefill only for the KV it lacks.

Real processes on loopback, the hybrid random model (layers SSFS, window 8, pages of 4), prompts longer
than the window. A multi-turn conversation (each turn the last one's prompt + its output + more) gets
the greedy tokens of a colocated decode started with --no-prefix-cache, inline and over nixl (and, on a
GPU, cuda_ipc), while every later turn ships only its suffix's full-layer KV (decode's received bytes,
to the byte) and the spans say both sides' hits. A prefix decode evicted before the reservation is
asked for whole. A prefill that ignores PrefillRequest.cached_tokens (an older one: the real prefill
behind a proxy that drops the fields it would not know) is caught, by a chunk before the hit or by
PrefillDone.full_from, and the prompt is prefilled on decode with the same tokens, the shared pages
untouched (a later hit on them passes prefix.pages_intact at STRICT). A bad cached_tokens sent to the
prefill service is INVALID_ARGUMENT naming the field. After each test both pools are back at idle
(free + cached = total). Unit level: the receiving end refuses any full-layer KV before the hit.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from decode_service.scheduler import DecodeScheduler, Finished, RemoteOpts, Reserved, SchedulerConfig
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.client.errors import field_violations
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.model.config import SLIDING
from shared.pb.pdserve.v1 import generation_pb2 as gen_pb
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.transfer.base import KVLayout
from shared.transfer.inline import ChunkAssembler, HeldPositions, KVBatch, extract_chunks
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model
from tests.engine.test_transfer_nixl import requires_nixl
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    kv_layout,
    random_spec,
    stop_all,
    wait_pool_idle,
)
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape, wait_spans

P, W = 4, 8  # page size, the random model's window
COMMON = ("--page-size", str(P), "--max-running", "4")
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
FIRST = [(5 * i + 11) % 97 for i in range(42)]  # turn 1: 10 whole pages and 2 tokens, > the window
LAYOUT = kv_layout(P)
ROW = LAYOUT.num_kv_heads * LAYOUT.head_dim * getattr(torch, LAYOUT.dtype).itemsize  # bytes of K of a token
N_SLIDING = sum(t == SLIDING for t in LAYOUT.layer_types)
N_FULL = len(LAYOUT.layer_types) - N_SLIDING
BACKENDS = ["inline", pytest.param("nixl", marks=requires_nixl)]
RECEIVED = "pdserve_kv_transfer_bytes_total"
ROUTE = "pdserve_prefill_route_total"


def _expected_bytes(backend: str, prompt_len: int, cached: int) -> int:
    """What decode receives for a prompt when it holds `cached` tokens: the full layers from there on
    (the zero-copy backends move whole pages), the sliding layers' last W positions; k + v."""
    full = prompt_len - cached if backend == "inline" else (-(-prompt_len // P) - cached // P) * P
    return 2 * ROW * (N_FULL * full + N_SLIDING * min(prompt_len, W))


LENGTHS = [42, 42 + 8 + 5, 42 + 2 * (8 + 5)]  # _turns' prompts: the last prompt + its 8 tokens + 5


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def prefill(spans: Path) -> Iterator[ServerProcess]:
    p = ServerProcess(
        random_spec(), *COMMON, module="prefill_service", service=PREFILL,
        env={"PDSERVE_TEST_SPAN_FILE": str(spans)},
    )  # fmt: skip
    yield p
    stop_all(p)


@pytest.fixture(scope="module")
def plain() -> Iterator[Client]:
    """A colocated decode without a prefix cache: the tokens every path must give."""
    p = ServerProcess(random_spec(), *COMMON, "--no-metrics", "--no-prefix-cache")
    try:
        with Client(p.target) as c:
            yield c
    finally:
        stop_all(p)


def _decode(target: str, backend: str, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        random_spec(), *COMMON, "--prefill-target", target, "--local-prefill-max-tokens", "0",
        "--kv-transfer", backend, "--metrics-port", "0", *extra, env=env,
    )  # fmt: skip


def _idle(decode: Client, prefill_target: str) -> None:
    """Both pools at their idle baseline: every page free or kept by the prefix cache."""
    wait_pool_idle(decode, timeout=20)
    info = PrefillInfo(prefill_target)
    try:
        wait_pool_idle(info, timeout=20)  # type: ignore[arg-type]
    finally:
        info.close()


def _turns(c: Client, plain: Client, decode: ServerProcess, backend: str, n: int) -> list[tuple[int, int]]:
    """`n` turns of one conversation; each one's tokens checked against `plain`. Returns each turn's
    (prompt tokens decode read from its prefix cache, KV bytes it received)."""
    prompt, out = list(FIRST), []
    for turn in range(n):
        before = sample(scrape(metrics_url(decode)), RECEIVED, backend=backend, direction="receive")
        got = c.complete(prompt, request_id=f"turn-{backend}-{turn}", **GREEDY)
        assert got.token_ids == plain.complete(prompt, **GREEDY).token_ids, f"turn {turn}"
        after = sample(scrape(metrics_url(decode)), RECEIVED, backend=backend, direction="receive")
        out.append((got.usage.cached_prompt_tokens, int(after - before)))
        prompt = [*prompt, *got.token_ids, *((3 * turn + i) % 97 for i in range(5))]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_later_turns_ship_only_the_suffix_and_get_the_tokens_of_a_decode_without_the_cache(
    prefill, plain, spans, backend
):
    decode = _decode(prefill.target, backend)
    try:
        with Client(decode.target) as c:
            turns = _turns(c, plain, decode, backend, 3)
            # Turn 1 is new; each later one finds the whole pages of the prompt before it, cached when
            # its KV arrived (its output is not: decode computed it).
            assert [hit for hit, _ in turns] == [0, 40, 52]
            want = [_expected_bytes(backend, n, hit) for n, (hit, _) in zip(LENGTHS, turns, strict=True)]
            assert [nbytes for _, nbytes in turns] == want
            assert want[1] < _expected_bytes(backend, LENGTHS[1], 0)  # a hit ships less than the prompt
            metrics = scrape(metrics_url(decode))
            assert sample(metrics, ROUTE, prefill="remote", reason="remote") == 3
            _idle(c, prefill.target)
        # Prefill's server span: decode's hit, and its own (turn 1's prompt, cached there too).
        rid = f"turn-{backend}-1"

        def served(got: list[dict]) -> list[dict]:
            calls = [s["attributes"] for s in got if s["name"] == "pdserve.v1.Prefill/Prefill"]
            return [a for a in calls if a.get("gen_ai.response.id") == rid]

        attrs = served(wait_spans(spans, lambda got: bool(served(got))))[0]
        assert attrs["pdserve.prefix_cache.decode_hit_tokens"] == 40
        assert 0 < attrs["pdserve.prefix_cache.hit_tokens"] < LENGTHS[1]
    finally:
        stop_all(decode)


@pytest.mark.gpu
def test_cuda_ipc_later_turns_write_only_the_suffix():
    """GPU: prefill on cuda:0 writes into decode's pool (cuda:1 when there are two) only from decode's
    hit on; tokens equal a colocated decode's without the cache on decode's GPU (float32 throughout:
    the hit changes how the prompt is chunked)."""
    dev = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    f32 = ("--dtype", "float32")
    pf = ServerProcess(
        random_spec(), *COMMON, *f32, "--device", "cuda:0", module="prefill_service", service=PREFILL
    )
    ipc = _decode(pf.target, "cuda_ipc", *f32, "--device", dev)
    ref = ServerProcess(random_spec(), *COMMON, *f32, "--device", dev, "--no-metrics", "--no-prefix-cache")
    try:
        with Client(ipc.target) as c, Client(ref.target) as r:
            turns = _turns(c, r, ipc, "cuda_ipc", 3)
            assert [hit for hit, _ in turns] == [0, 40, 52]
            want = [_expected_bytes("cuda_ipc", n, hit) for n, (hit, _) in zip(LENGTHS, turns, strict=True)]
            assert [nbytes for _, nbytes in turns] == want
            _idle(c, pf.target)
    finally:
        stop_all(ipc, ref, pf)


@pytest.mark.slow
def test_decode_spans_carry_both_hits(prefill, plain, tmp_path):
    path = tmp_path / "decode-spans.jsonl"
    decode = _decode(prefill.target, "inline", env={"PDSERVE_TEST_SPAN_FILE": str(path)})
    try:
        with Client(decode.target) as c:
            first = c.complete(FIRST, request_id="first", **GREEDY)
            second = [*FIRST, *first.token_ids, 1, 2, 3]
            assert c.complete(second, request_id="second", **GREEDY).usage.cached_prompt_tokens == 40

            def ready(got: list[dict]) -> bool:
                return (
                    any(s["kind"] == "CLIENT" and s["name"] == "pdserve.v1.Prefill/Prefill" for s in got)
                    and sum(s["name"] == "pdserve.v1.Generation/Generate" for s in got) == 2
                )

            got = wait_spans(path, ready)
            gen = {
                s["attributes"]["gen_ai.response.id"]: s
                for s in got
                if s["name"] == "pdserve.v1.Generation/Generate"
            }
            calls = {
                s["parent_id"]: s["attributes"]
                for s in got
                if s["name"] == "pdserve.v1.Prefill/Prefill" and s["kind"] == "CLIENT"
            }
            call = calls[gen["second"]["span_id"]]
            assert call["pdserve.prefix_cache.decode_hit_tokens"] == 40
            assert 0 <= call["pdserve.prefix_cache.prefill_hit_tokens"] < len(second)
            assert calls[gen["first"]["span_id"]]["pdserve.prefix_cache.decode_hit_tokens"] == 0
            assert gen["second"]["attributes"]["pdserve.prefix_cache.hit_tokens"] == 40
            _idle(c, prefill.target)
    finally:
        stop_all(decode)


@pytest.mark.slow
def test_a_prefix_decode_evicted_before_the_reservation_is_asked_for_whole(prefill, plain):
    # 24 pages: turn 1 leaves its 10 cached; a 88-token prompt + 8 needs the whole pool and evicts them
    # (the pool evicts unused cached pages when short), so turn 2 finds nothing and is shipped whole.
    decode = _decode(prefill.target, "inline", "--num-pages", "24")
    try:
        with Client(decode.target) as c:
            first = c.complete(FIRST, **GREEDY)
            assert first.token_ids == plain.complete(FIRST, **GREEDY).token_ids
            other = [(13 * i + 2) % 97 for i in range(88)]
            assert c.complete(other, **GREEDY).token_ids == plain.complete(other, **GREEDY).token_ids
            second = [*FIRST, *first.token_ids, 1, 2, 3]
            url = metrics_url(decode)
            before = sample(scrape(url), RECEIVED, backend="inline", direction="receive")
            got = c.complete(second, **GREEDY)
            assert got.token_ids == plain.complete(second, **GREEDY).token_ids
            assert got.usage.cached_prompt_tokens == 0
            metrics = scrape(url)
            assert metrics and sample(metrics, "pdserve_prefix_cache_evicted_pages_total") >= 10
            received = sample(metrics, RECEIVED, backend="inline", direction="receive") - before
            assert received == _expected_bytes("inline", len(second), 0)
            assert sample(metrics, ROUTE, prefill="remote", reason="remote") == 3
            _idle(c, prefill.target)
    finally:
        stop_all(decode)


class _OlderPrefill(pb_grpc.PrefillServicer):
    """A prefill service from before PrefillRequest.cached_tokens: the real one, behind a proxy that
    drops what such a service would not know (it parses the request without that field, and never sets
    PrefillDone's full_from or prefix_hit_tokens). It ships full-layer KV from position 0, into the
    pages it is given."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.PrefillStub(self._channel)

    def Handshake(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return self._stub.Handshake(request, timeout=30)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return self._stub.GetModelInfo(request, timeout=5)

    def Prefill(self, request, context):  # type: ignore[no-untyped-def]
        old = pb.PrefillRequest()
        old.CopyFrom(request)
        old.ClearField("cached_tokens")
        call = self._stub.Prefill(old, timeout=context.time_remaining())
        context.add_callback(call.cancel)
        try:
            for msg in call:
                if msg.HasField("done"):
                    msg.done.ClearField("full_from")
                    msg.done.ClearField("prefix_hit_tokens")
                yield msg
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                context.abort(e.code(), e.details())

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
def older(prefill: ServerProcess) -> Iterator[str]:
    proxy = _OlderPrefill(prefill.target)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PrefillServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(1).wait(5)
        proxy.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_that_ignores_cached_tokens_is_caught_and_the_prompt_prefilled_here(
    prefill, plain, older, backend
):
    decode = _decode(older, backend)
    try:
        with Client(decode.target) as c:
            first = c.complete(FIRST, **GREEDY)  # no hit: shipped from 0, as asked
            assert first.token_ids == plain.complete(FIRST, **GREEDY).token_ids
            # Inline: the first full-layer chunk starts at 0, before decode's hit (40), and is refused.
            # nixl: decode names only its pages from the hit on; with room for the whole prompt there
            # (max_tokens 48) the old prefill writes into those (decode's own) and PrefillDone says 0;
            # without room (max_tokens 8) it refuses the target (INVALID_ARGUMENT), writing nothing.
            asks = [([*FIRST, 1, 2, 3, 4, 5], 48), ([*FIRST, 6, 7, 8, 9, 10, 11], 8)]
            for prompt, max_tokens in asks:
                params = {**GREEDY, "max_tokens": max_tokens}
                got = c.complete(prompt, **params)
                assert got.token_ids == plain.complete(prompt, **params).token_ids
                assert got.usage.cached_prompt_tokens == 40  # prefilled here, on the shared pages
            # The shared pages are intact: another hit reads them (prefix.pages_intact, STRICT).
            last = [*FIRST, 12, 13]
            assert c.complete(last, **GREEDY).token_ids == plain.complete(last, **GREEDY).token_ids
            metrics = scrape(metrics_url(decode))
            mismatched = sample(metrics, ROUTE, prefill="local", reason="prefix_mismatch")
            rejected = sample(metrics, ROUTE, prefill="local", reason="prefill_rejected")
            assert (mismatched, rejected) == ((3, 0) if backend == "inline" else (1, 2))
            assert sample(metrics, ROUTE, prefill="remote", reason="remote") == 1
            assert "did not ship the KV from decode's prefix-cache hit" in decode.log()
            _idle(c, prefill.target)
    finally:
        stop_all(decode)


def test_a_bad_cached_tokens_is_invalid_argument_naming_the_field(prefill):
    info = PrefillInfo(prefill.target)
    prompt = FIRST[:12]
    try:
        for cached in (3, 12, 16):  # not a page boundary; the whole prompt; past it
            req = pb.PrefillRequest(
                request_id="bad", prompt=prompt, send_window_history=True, layout=LAYOUT, cached_tokens=cached
            )
            with pytest.raises(grpc.RpcError) as e:
                list(info.stub.Prefill(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, cached
            assert [v.field for v in field_violations(e.value)] == ["cached_tokens"], cached
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()


def _stream(
    stub: pb_grpc.PrefillStub, prompt: list[int], cached: int
) -> tuple[list[pb.KVChunk], pb.PrefillDone]:
    req = pb.PrefillRequest(
        request_id=f"direct-{cached}", prompt=prompt, sampling=gen_pb.SamplingParams(temperature=0.0),
        send_window_history=True, layout=LAYOUT, cached_tokens=cached,
    )  # fmt: skip
    msgs = list(stub.Prefill(req, timeout=30))
    return [m.chunk for m in msgs[:-1]], msgs[-1].done


def _positions(chunks: list[pb.KVChunk], layer: int, dtype: str) -> tuple[int, np.ndarray]:
    """A layer's first position and its K, [n, Hkv * D], joined from its chunks."""
    mine = [c for c in chunks if c.layer == layer]
    k = np.concatenate([np.frombuffer(c.k, dtype=dtype) for c in mine])
    return mine[0].token_start, k.reshape(sum(c.token_count for c in mine), -1)


def test_prefill_ships_the_full_layers_from_cached_tokens_and_the_window_as_ever(prefill):
    info = PrefillInfo(prefill.target)
    prompt = [(3 * i + 1) % 97 for i in range(30)]
    try:
        whole, done0 = _stream(info.stub, prompt, 0)
        part, done = _stream(info.stub, prompt, 20)
        assert (done0.full_from, done.full_from) == (0, 20)
        assert done.full_bytes == 2 * ROW * N_FULL * (30 - 20) == done0.full_bytes // 3
        assert done.window_bytes == done0.window_bytes == 2 * ROW * N_SLIDING * W
        assert done.first_token == done0.first_token
        assert done.prefix_hit_tokens > 0  # the same prompt again: prefill's own cache held most of it
        for layer, kind in enumerate(LAYOUT.layer_types):
            start0, k0 = _positions(whole, layer, LAYOUT.dtype)
            start, k = _positions(part, layer, LAYOUT.dtype)
            if kind == SLIDING:
                assert start == start0 == 30 - W and np.allclose(k, k0, atol=1e-5)
            else:
                assert (start0, start) == (0, 20) and np.allclose(k, k0[20:], atol=1e-5)
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()


# ---- unit level: decode's receiving end ----


def test_the_assembler_refuses_full_layer_kv_before_the_hit_and_takes_the_rest():
    engine = Engine(
        tiny_model(tiny_config()), KVConfig(page_size=P, num_pages=64, max_requests=2), EngineConfig()
    )
    prompt = random_tokens(22)
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while not req.finished:
        engine.step()
    engine.flush()
    layout = KVLayout.of(engine.cache, "m", "w")
    whole = list(extract_chunks(engine.cache, req.pages, req.slot, 22))
    part = list(extract_chunks(engine.cache, req.pages, req.slot, 22, full_from=8))
    assert {c.token_start for c in part if not c.window} == {8}
    kv = ChunkAssembler(layout, 22, window=True, full_from=8)
    full = next(c for c in whole if not c.window)
    with pytest.raises(HeldPositions, match="held here already"):  # an older prefill's first chunk
        kv.add(full.layer, False, full.token_start, full.token_count, full.k, full.v)
    kv = ChunkAssembler(layout, 22, window=True, full_from=8)
    batches = [b for c in part for b in kv.add(c.layer, c.window, c.token_start, c.token_count, c.k, c.v)]
    batches += kv.finish()
    assert {(b.layer, b.token_start, b.token_count) for b in batches if not b.window} == {
        (i, 8, 14) for i, t in enumerate(layout.layer_types) if t != SLIDING
    }
    engine.release(req)


def test_decode_never_writes_a_batch_into_its_shared_pages():
    """A full-layer batch before the reservation's hit reaching the scheduler (past the assembler) ends
    that request; the shared pages are untouched, and the next hit on them reads them intact."""
    kv = KVConfig(page_size=P, num_pages=64, max_requests=4)
    engine = Engine(tiny_model(tiny_config()), kv, EngineConfig(prefix_cache=True))
    sched = DecodeScheduler(engine, SchedulerConfig(max_queue=4))
    sched.start()
    try:
        prompt = random_tokens(21)
        events: queue.Queue = queue.Queue()
        sched.submit("first", prompt, SamplingParams(temperature=0.0, max_tokens=2), events.put)
        while not isinstance(events.get(timeout=30), Finished):
            pass
        events = queue.Queue()
        sched.submit("second", [*prompt, 1, 2], SamplingParams(temperature=0.0, max_tokens=2), events.put,
                     RemoteOpts())  # fmt: skip
        reserved = events.get(timeout=10)
        assert isinstance(reserved, Reserved) and reserved.cached_tokens == 20
        cache = engine.cache
        before = cache.k_pages[:, list(reserved.pages[:5])].clone()
        row = torch.ones(4, cache.model.num_kv_heads, cache.model.head_dim)
        sched.deliver("second", [KVBatch(cache.full_layers[0], False, 0, row, row)])
        ended = events.get(timeout=10)
        assert isinstance(ended, Finished) and ended.reason == "abort"
        assert "shared pages" in (ended.error or "")
        assert sched.wait_idle(10)
        assert torch.equal(cache.k_pages[:, list(reserved.pages[:5])], before)
        events = queue.Queue()
        sched.submit("third", [*prompt, 3], SamplingParams(temperature=0.0, max_tokens=2), events.put)
        while not isinstance(ev := events.get(timeout=30), Finished):
            pass
        assert ev.error is None and ev.cached_tokens == 20  # prefix.pages_intact held (STRICT in CI)
        assert sched.wait_idle(10)
        state = sched.pool_state()
        assert state.pages_free + state.pages_cached == 64
    finally:
        sched.shutdown()
