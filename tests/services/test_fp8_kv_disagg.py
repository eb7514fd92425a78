"""Disaggregation with an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`), real processes on loopback, the
tiny random model in bfloat16: a prefill and decodes over inline and nixl (CPU DRAM pools) give the
greedy tokens of one colocated FP8-cache Engine and ship half the bytes a bfloat16-cache pair ships
(`pdserve_kv_transfer_bytes_total`); GetModelInfo reports the cache's dtype; a prefill and a decode
whose caches differ (bfloat16 against FP8) refuse each other, naming both dtypes, at start-up and per
request. Both pools return to idle."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.sampling import SamplingParams
from shared.kernels.kv_quant import FP8_KV_DTYPE
from shared.model.fingerprint import fingerprint
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.serving.api.model_source import load_served_model
from shared.transfer.base import KVLayout
from tests.engine.test_transfer_nixl import requires_nixl
from tests.services.service_testutil import PrefillInfo, ServerProcess, random_spec, stop_all, wait_pool_idle
from tests.services.test_disagg import GREEDY, W, _prompt
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape

COMMON = ("--page-size", "4", "--max-running", "4", "--dtype", "bf16", "--device", "cpu")  # the CPU path
FP8 = ("--kv-cache-dtype", "fp8_e4m3")
LENGTHS = [3, W, W + 1, 2 * W + 3, 5 * W]
BYTES = "pdserve_kv_transfer_bytes_total"


def _prefill(*args: str) -> ServerProcess:
    return ServerProcess(random_spec(), *COMMON, *args, module="prefill_service", service=PREFILL)


def _decode(prefill: ServerProcess, *args: str, ready: bool = True) -> ServerProcess:
    return ServerProcess(
        random_spec(), *COMMON, *args, "--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
        wait_ready=ready,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fp8_prefill() -> Iterator[ServerProcess]:
    p = _prefill(*FP8)
    yield p
    stop_all(p)


@pytest.fixture(scope="module")
def bf16_prefill() -> Iterator[ServerProcess]:
    p = _prefill()
    yield p
    stop_all(p)


@pytest.fixture(scope="module")
def expected() -> dict[int, list[int]]:
    """One colocated Engine with an FP8 cache (scales 1.0: a random model ships none)."""
    loaded = load_served_model(random_spec(), dtype="bfloat16")
    kv = KVConfig(page_size=4, num_pages=512, max_requests=4, dtype=FP8_KV_DTYPE)
    reqs = Engine(loaded.model, kv, EngineConfig()).generate(
        [_prompt(n) for n in LENGTHS], SamplingParams(**GREEDY)
    )
    return {n: r.output for n, r in zip(LENGTHS, reqs, strict=True)}


def _tokens_and_bytes(decode: ServerProcess, prefill: ServerProcess) -> tuple[dict[int, list[int]], float]:
    info = PrefillInfo(prefill.target)
    try:
        with Client(decode.target) as c:
            got = {n: list(c.complete(_prompt(n), **GREEDY).token_ids) for n in LENGTHS}
            wait_pool_idle(c)
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()
    return got, sample(scrape(metrics_url(decode)), BYTES, direction="receive")


@pytest.mark.parametrize(
    "transfer", ["inline", pytest.param("nixl", marks=requires_nixl)]
)  # fmt: skip
def test_fp8_tokens_equal_a_colocated_fp8_engine_at_half_the_bytes(
    fp8_prefill, bf16_prefill, expected, transfer
):
    fp8 = _decode(fp8_prefill, *FP8, "--kv-transfer", transfer)
    bf16 = _decode(bf16_prefill, "--kv-transfer", transfer)
    try:
        with Client(fp8.target) as c:
            assert c.model_info().dtype == "float8_e4m3fn"
        got, fp8_bytes = _tokens_and_bytes(fp8, fp8_prefill)
        assert got == expected
        _, bf16_bytes = _tokens_and_bytes(bf16, bf16_prefill)
        assert fp8_bytes > 0 and 2 * fp8_bytes == bf16_bytes, (fp8_bytes, bf16_bytes)
    finally:
        stop_all(fp8, bf16)


@pytest.mark.parametrize(("decode_flags", "ours", "theirs"), [
    (FP8, "float8_e4m3fn", "bfloat16"),  # an FP8 decode, a bfloat16 prefill
    ((), "bfloat16", "float8_e4m3fn"),  # and the other way round
])  # fmt: skip
def test_caches_of_other_dtypes_refuse_each_other_at_start_up(
    fp8_prefill, bf16_prefill, decode_flags, ours, theirs
):
    prefill = bf16_prefill if ours == "float8_e4m3fn" else fp8_prefill
    decode = _decode(prefill, *decode_flags, ready=False)
    try:
        assert decode.wait(120) == 1
        log = decode.log()
        assert "refused the handshake" in log and f"dtype: '{ours}' != '{theirs}'" in log, log[-2000:]
        assert "kv_scale_kind: " in log
    finally:
        decode.kill()


def test_a_prefill_request_with_another_kv_dtype_is_refused_naming_both(bf16_prefill):
    """The per-request check (a prefill that restarted with another --kv-cache-dtype behind the same
    address): FAILED_PRECONDITION before any work, both dtypes named."""
    loaded = load_served_model(random_spec(), dtype="bfloat16")
    cache = KVCache(loaded.config, KVConfig(page_size=4, num_pages=1, max_requests=1, dtype=FP8_KV_DTYPE))
    layout = KVLayout.of(cache, loaded.name, fingerprint(loaded.model, loaded.tokenizer)).to_pb()
    info = PrefillInfo(bf16_prefill.target)
    try:
        req = pb.PrefillRequest(request_id="fp8", prompt=_prompt(9), send_window_history=True, layout=layout)
        with pytest.raises(grpc.RpcError) as e:
            list(info.stub.Prefill(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype: 'float8_e4m3fn' != 'bfloat16'" in e.value.details(), e.value.details()
        wait_pool_idle(info)  # type: ignore[arg-type]
    finally:
        info.close()


def test_the_flag_takes_fp8_e4m3_and_its_alias_and_refuses_e5m2():
    from shared.serving.config import CommonConfig

    assert CommonConfig().kv_cache_dtype == "auto"
    assert (
        CommonConfig(kv_cache_dtype="FP8").kv_cache_dtype
        == CommonConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype
    )
    assert CommonConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="e5m2 is not served"):
        CommonConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8_e4m3"):
        CommonConfig(kv_cache_dtype="int8")
