"""`--tp` on the services, real processes over gloo: a decode service of two ranks generates what one
rank generates (a hybrid model, and a gpt-oss-like mixture of experts with sinks, its experts placed
whole on the ranks, requests running together); KV crosses between a prefill and a decode of other degrees;
a rank that dies makes the service report NOT_SERVING and exit with code 4, naming the rank, without
hanging; a model that does not split over the ranks is refused at start. Zero-copy handoff between
degrees: nixl here (UCX over loopback), cuda_ipc on two GPUs."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from decode_service.servicer import SERVICE_NAME
from prefill_service.servicer import SERVICE_NAME as PREFILL
from shared.client.client import Client
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import load_served_model
from shared.serving.tensor_parallel import EXIT_RANK_DIED
from tests.engine.test_transfer_nixl import requires_nixl
from tests.services.service_testutil import (
    PrefillInfo,
    ServerProcess,
    health_status,
    random_spec,
    stop_all,
    wait_pool_idle,
)  # fmt: skip
from tests.telemetry.telemetry_testutil import metrics_url, sample, scrape

COMMON = ("--page-size", "4", "--max-running", "4", "--no-metrics")
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[(5 * i + n) % 97 for i in range(n)] for n in (3, 17, 30)]
MOE = {"layers": "SFSF", "experts": 4, "top_k": 2, "expert_intermediate": 48, "sinks": True,
       "gpt_oss_experts": True}  # fmt: skip
# name: (the random model, the decode service's flags beside --tp 2). The MoE with its experts sliced
# runs through the ranks' engines in tests/parallel/test_tensor_parallel.py.
MODELS = {
    "hybrid": ({"layers": "SSFS", "heads": 4, "kv_heads": 2}, ()),
    "gpt-oss-moe-expert-parallel": (MOE, ("--expert-parallel",)),
}


def _colocated(spec: str) -> list[list[int]]:
    """PROMPTS' greedy tokens from one engine in this process: what every service here must generate."""
    loaded = load_served_model(spec)
    engine = Engine(loaded.model, KVConfig(page_size=4, num_pages=512, max_requests=4), EngineConfig())
    return [r.output for r in engine.generate(PROMPTS, SamplingParams(**GREEDY))]


def _served(decode: ServerProcess, idle: bool = True) -> list[list[int]]:
    """PROMPTS sent together to `decode`, their tokens; with `idle`, once its pool is idle again."""
    with Client(decode.target) as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: list(c.complete(p, **GREEDY).token_ids), PROMPTS))
        if idle:
            wait_pool_idle(c)
    return got


def _ranks_of(pid: int) -> list[int]:
    """The service's rank processes (multiprocessing's spawned children, not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():  # each thread's children: ranks start on the loader
        children += _read(task / "children").split()
    found = []
    for child in map(int, children):
        cmdline = _read(Path(f"/proc/{child}/cmdline")).replace("\0", " ")
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(child)
    return found


def _read(path: Path) -> str:
    """A /proc file's text, or "" once its thread or process has exited (between listing and reading)."""
    try:
        return path.read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_generate_what_one_rank_generates(name: str) -> None:
    opts, flags = MODELS[name]
    spec = random_spec(**opts)
    expected = _colocated(spec)
    decode = ServerProcess(spec, *COMMON, "--tp", "2", *flags)
    try:
        assert len(_ranks_of(decode.proc.pid)) == 1
        assert _served(decode, idle=False) == expected
    finally:
        stop_all(decode)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_crosses_between_tensor_parallel_degrees(prefill_tp: int, decode_tp: int) -> None:
    """The wire holds every KV head: a prefill of 2 ranks hands over to a decode of 1 and back, the
    window history included, and the tokens are the colocated engine's. (Every prompt goes to prefill:
    none is short enough to stay, and no queue estimate sends one back.)"""
    spec = random_spec(**MODELS["hybrid"][0])
    expected = _colocated(spec)
    prefill = ServerProcess(spec, *COMMON, "--tp", str(prefill_tp), module="prefill_service", service=PREFILL)
    remote = ("--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
              "--remote-prefill-max-queued-tokens", "100000")  # fmt: skip
    decode = ServerProcess(spec, *COMMON, "--tp", str(decode_tp), *remote)
    try:
        assert _served(decode) == expected
        info = PrefillInfo(prefill.target)
        wait_pool_idle(info)  # type: ignore[arg-type]
        assert info.model_info().kv_pool.pages_cached > 0  # the prompts were computed there
        info.close()
    finally:
        stop_all(decode, prefill)


@requires_nixl
@pytest.mark.parametrize(("prefill_tp", "decode_tps"), [(2, (2, 1)), (1, (2,))])
def test_nixl_writes_each_ranks_heads_into_the_ranks_that_hold_them(
    prefill_tp: int, decode_tps: tuple[int, ...]
) -> None:
    """Zero-copy between degrees: a prefill of 2 ranks WRITEs its KV heads straight into a decode of 2
    ranks (each rank's agent to its peer's) and into a decode of 1 (both ranks into its one pool), and
    a prefill of 1 into both ranks of a decode of 2, the window history included; the tokens are the
    colocated engine's, and the KV went by NIXL, not in the stream."""
    spec = random_spec(**MODELS["hybrid"][0])
    expected = _colocated(spec)
    prefill = ServerProcess(spec, *COMMON, "--tp", str(prefill_tp), module="prefill_service", service=PREFILL)
    remote = ("--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
              "--remote-prefill-max-queued-tokens", "100000", "--kv-transfer", "nixl")  # fmt: skip
    decodes = [ServerProcess(spec, *COMMON[:-1], "--tp", str(tp), *remote) for tp in decode_tps]
    try:
        for decode in decodes:
            assert _served(decode) == expected
            moved = scrape(metrics_url(decode))
            assert sample(moved, "pdserve_kv_transfer_bytes_total", backend="nixl", direction="receive") > 0
            assert sample(moved, "pdserve_kv_transfer_bytes_total", backend="inline") == 0
        info = PrefillInfo(prefill.target)
        wait_pool_idle(info)  # type: ignore[arg-type]  # every rank's WRITEs ended, the pages back
        info.close()
    finally:
        stop_all(*decodes, prefill)


def test_a_dead_rank_stops_the_service_not_serving_then_exit_4() -> None:
    decode = ServerProcess(random_spec(), *COMMON, "--tp", "2")
    try:
        [rank] = _ranks_of(decode.proc.pid)
        os.kill(rank, signal.SIGKILL)
        seen = set()
        deadline = time.monotonic() + 30
        while decode.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):  # the port has closed: the process is on its way out
                seen.add(health_status(decode.target, SERVICE_NAME))
            time.sleep(0.02)
        assert decode.wait(10) == EXIT_RANK_DIED
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
        assert f"tensor parallel rank 1 of 2 (pid {rank}) died (killed by signal 9)" in decode.log()
    finally:
        decode.kill()


def test_no_rank_outlives_its_service() -> None:
    """Rank 0 killed outright (no shutdown of its own): the other ranks notice and exit."""
    decode = ServerProcess(random_spec(), *COMMON, "--tp", "2")
    try:
        [rank] = _ranks_of(decode.proc.pid)
        decode.proc.kill()
        decode.proc.wait(10)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{rank}").exists() and _state(rank) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{rank}").exists() or _state(rank) == "Z", "rank 1 outlived rank 0"
    finally:
        decode.kill()


def _state(pid: int) -> str:
    """A process's state letter (Z: exited, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


def test_a_model_that_does_not_split_is_refused_at_start() -> None:
    decode = ServerProcess(random_spec(heads=4, kv_heads=2), *COMMON, "--tp", "3", wait_ready=False)
    try:
        assert decode.wait(60) == 1
        assert "4 attention heads do not split over 3 ranks" in decode.log()
    finally:
        decode.kill()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ranks of a service need a GPU each (NCCL)")
@pytest.mark.parametrize(("prefill_tp", "decode_tps"), [(2, (2, 1)), (1, (2,))])
def test_cuda_ipc_writes_each_ranks_heads_into_the_ranks_that_hold_them(
    prefill_tp: int, decode_tps: tuple[int, ...]
) -> None:
    """cuda_ipc between degrees, on GPUs: each prefill rank writes its KV heads into the pools of the
    decode ranks that hold them, on its own stream, and every decode rank waits on every prefill
    rank's event; the tokens are the colocated engine's, and the KV went pool to pool."""
    spec = random_spec(**MODELS["hybrid"][0])
    expected = _colocated(spec)
    gpu = ("--device", "cuda:0")
    prefill = ServerProcess(spec, *COMMON, *gpu, "--tp", str(prefill_tp), module="prefill_service",
                            service=PREFILL)  # fmt: skip
    remote = ("--prefill-target", prefill.target, "--local-prefill-max-tokens", "0",
              "--remote-prefill-max-queued-tokens", "100000", "--kv-transfer", "cuda_ipc")  # fmt: skip
    decodes = [ServerProcess(spec, *COMMON[:-1], *gpu, "--tp", str(tp), *remote) for tp in decode_tps]
    try:
        for decode in decodes:
            assert _served(decode) == expected
            moved = scrape(metrics_url(decode))
            received = sample(
                moved, "pdserve_kv_transfer_bytes_total", backend="cuda_ipc", direction="receive"
            )
            assert received > 0
            assert sample(moved, "pdserve_kv_transfer_bytes_total", backend="inline") == 0
    finally:
        stop_all(*decodes, prefill)
