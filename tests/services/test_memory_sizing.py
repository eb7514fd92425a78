"""KV pool sizing from memory (--num-pages 0, the default; shared/serving/kv_sizing.py): the rule with
made-up memory figures, the byte counts it rests on against a real pool, and real services that size
their pool, print it in the start-up banner, report it in GetModelInfo, and refuse to start when the
fraction leaves room for less than one max-context request."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from shared.client.client import Client
from shared.engine.kv.cache import KVCache, KVConfig
from shared.serving.api.model_source import load_served_model
from shared.serving.kv_sizing import (
    CPU_KV_CAP_BYTES,
    MemoryPlan,
    SizingError,
    cpu_available_bytes,
    plan_pages,
)
from tests.services.service_testutil import ServerProcess, random_spec, stop_all

GiB, MiB = 1 << 30, 1 << 20
GPU = MemoryPlan(
    device="cuda", memory=80 * GiB, fraction=0.9, weights=10 * GiB, activations=2 * GiB, window_bytes=GiB,
    page_bytes=MiB, page_size=16, max_context=8192, max_running=1024,
)  # fmt: skip


def test_cuda_takes_the_fraction_of_total_memory_less_weights_activations_and_windows() -> None:
    # 0.9 x 80 GiB = 72 GiB - 10 weights - 2 activations - 1 windows = 59 GiB of 1 MiB pages
    assert plan_pages(GPU).num_pages == 59 * 1024
    assert plan_pages(GPU).kv_bytes == 60 * GiB
    # Other processes hold memory: never more than is free (less the activations and the windows)
    assert plan_pages(dataclasses.replace(GPU, free=30 * GiB)).num_pages == 27 * 1024
    # More than max_running requests at the max context can use is not allocated
    capped = plan_pages(dataclasses.replace(GPU, max_running=4))
    assert capped.num_pages == 4 * 8192 // 16 and "capped at 4 running" in capped.why


def test_cpu_takes_the_fraction_of_available_ram_less_weights_up_to_a_cap() -> None:
    cpu = dataclasses.replace(GPU, device="cpu", memory=GiB, activations=0, window_bytes=0, weights=100 * MiB)
    assert plan_pages(cpu).num_pages == int(0.9 * GiB - 100 * MiB) // MiB
    big = plan_pages(dataclasses.replace(cpu, memory=100 * GiB))
    assert big.num_pages == CPU_KV_CAP_BYTES // MiB and "CPU cap" in big.why
    # The cap never keeps out one request at the max context (here 512 pages of 8 MiB = 4 GiB)
    huge_pages = dataclasses.replace(cpu, memory=100 * GiB, page_bytes=8 * MiB)
    assert plan_pages(huge_pages).num_pages == 8192 // 16


def test_too_little_memory_for_one_max_context_request_fails_naming_the_flags() -> None:
    with pytest.raises(SizingError, match=r"--kv-memory-fraction \(now 0.15\).*--num-pages"):
        plan_pages(dataclasses.replace(GPU, fraction=0.15))  # 12 GiB - 13 GiB: nothing left
    tight = dataclasses.replace(GPU, page_bytes=16 * MiB, max_context=65536)  # one request: 64 GiB
    with pytest.raises(SizingError, match="fewer than one request at the model's max context"):
        plan_pages(tight)


def test_no_full_attention_layer_means_pages_cost_nothing() -> None:
    assert plan_pages(dataclasses.replace(GPU, page_bytes=0, max_running=8)).num_pages == 8 * 8192 // 16


@pytest.mark.parametrize("layers", ["SSFS", "FFFF", "SSSS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_counts_match_the_pool_kvcache_allocates(layers: str, dtype: torch.dtype) -> None:
    cfg = load_served_model(random_spec(layers=layers)).config
    cache = KVCache(cfg, KVConfig(page_size=4, num_pages=10, max_requests=3, dtype=dtype))
    pages = sum(t.numel() * t.element_size() for t in (cache.k_pages, cache.v_pages))
    rings = sum(t.numel() * t.element_size() for t in (cache.k_ring, cache.v_ring, cache.ring_pos))
    assert pages == 10 * KVCache.bytes_per_page(cfg, 4, dtype) == 10 * cache.page_bytes()
    assert rings == KVCache.window_pool_bytes(cfg, 3, dtype)


def test_available_ram_is_read() -> None:
    meminfo = Path("/proc/meminfo").read_text()
    total = int(re.findall(r"MemTotal:\s+(\d+)", meminfo)[0]) * 1024
    assert 0 < cpu_available_bytes() <= total


def _pages_total(srv: ServerProcess) -> int:
    with Client(srv.target) as c:
        return c.model_info().kv_pool.pages_total


def test_a_service_without_num_pages_sizes_its_pool_and_says_so() -> None:
    """Plenty of RAM: the pool is what max_running requests at the max context use (tiny here)."""
    srv = ServerProcess(random_spec(), "--max-running", "3", "--page-size", "4")
    try:
        pages = 3 * 512 // 4  # the random model's max context is 512 tokens
        assert _pages_total(srv) == pages
        banner = next(line for line in srv.log().splitlines() if "ready (" in line)
        assert f"KV pool {pages} pages x 4 tokens = {pages * 4} tokens" in banner, banner
        assert "3.0 requests of 512 tokens (max context) fit" in banner, banner
    finally:
        stop_all(srv)


def test_the_fraction_of_available_ram_bounds_the_pool() -> None:
    """A model whose 64 requests at max context would want 1 GiB (16 MiB each); a fraction that leaves
    about 160 MiB of the RAM available now. (Other processes change the available RAM meanwhile: a
    loose bound.)"""
    spec = random_spec(max_context=65536)
    page_bytes = KVCache.bytes_per_page(load_served_model(spec).config, 16, torch.float32)
    fraction = 160 * MiB / cpu_available_bytes()
    srv = ServerProcess(spec, "--max-running", "64", "--kv-memory-fraction", f"{fraction:.9f}")
    try:
        got = _pages_total(srv) * page_bytes
        assert 0.5 * 160 * MiB < got < 1.5 * 160 * MiB, got / MiB  # not the 1 GiB nor one 16 MiB request
        assert "sized from memory" in srv.log()
    finally:
        stop_all(srv)


def test_a_fraction_too_small_for_one_request_exits_naming_the_flag() -> None:
    srv = ServerProcess(random_spec(), "--kv-memory-fraction", "0.000000001", wait_ready=False)
    try:
        assert srv.wait(60) == 1
        assert "--kv-memory-fraction" in srv.log() and "start-up failed" in srv.log(), srv.log()[-2000:]
    finally:
        srv.kill()
