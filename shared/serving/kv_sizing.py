"""How many KV pages a service allocates when --num-pages is 0: what --kv-memory-fraction leaves.

CUDA, as vLLM's gpu_memory_utilization: the service may use `fraction` x the device's total memory.
Out of that come the weights (memory allocated once the model is loaded), the activations (measured:
`cuda_activation_bytes`), the sliding layers' rings (fixed: one per running request) and the rest is
pages. Never more than is free on the device at that point either (another process, the CUDA context
and cuBLAS's workspaces are not in the allocator's count, but they are not free).

CPU: `fraction` x the available RAM (MemAvailable, or the cgroup's limit minus its usage where that is
lower: a container sees the host's MemAvailable), read before the model loads, minus the weights, and at
most CPU_KV_CAP_BYTES. A CPU computes too slowly to use more: 2 GiB hold 45k tokens of
SmolLM2-135M in float32, minutes of prompts on a CPU. Activations are not measured on a CPU (its
allocator keeps no statistics): the 1 - fraction left of the available RAM is their headroom.

Either way, never more pages than max_running requests at the model's max context can use (the engine
runs at most max_running at once, so more would be memory nobody reads: this is also what keeps the
tiny test models' pools tiny), and never fewer than one such request: then start-up fails, naming the
flags to change. `--num-pages N` skips all of this (and a smaller pool shortens the max context).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.sampling import SamplingParams
from shared.model.config import ModelConfig

__all__ = [
    "CPU_KV_CAP_BYTES",
    "CUDA_HEADROOM_BYTES",
    "MemoryPlan",
    "Sizing",
    "SizingError",
    "capacity_text",
    "cpu_available_bytes",
    "cuda_activation_bytes",
    "plan_pages",
]

CPU_KV_CAP_BYTES = 2 << 30
# What the probe does not see on CUDA, counted with the activations: the tuned GEMMs' cuBLASLt
# workspaces, the decode graphs' own buffers beyond the step's peak, the caching allocator's rounding.
# Without it a pool the fraction limits ran ~1% past the fraction at full load on an H200.
CUDA_HEADROOM_BYTES = 512 << 20
PROBE_MAX_TOKENS = 32768  # the longest prompt the activation probe prefills


class SizingError(ValueError):
    """The memory the flags allow cannot hold one request at the model's max context."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the pool is sized from (bytes)."""

    device: str  # "cuda" | "cpu"
    memory: int  # CUDA: the device's total memory; CPU: the RAM available before the model loaded
    fraction: float  # --kv-memory-fraction
    weights: int
    activations: int  # CUDA: measured peak of the largest steps; CPU: 0 (the 1 - fraction headroom)
    window_bytes: int  # the sliding layers' rings (KVCache.window_pool_bytes)
    page_bytes: int  # KVCache.bytes_per_page
    page_size: int  # tokens per page
    max_context: int  # the model's positions
    max_running: int
    free: int | None = None  # CUDA: free device memory with the model loaded (None: not known)


@dataclass(frozen=True)
class Sizing:
    num_pages: int
    kv_bytes: int  # pages + rings
    why: str  # how the number came about, for the start-up log


def _gib(n: float) -> str:
    """Bytes in words: GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


def plan_pages(p: MemoryPlan) -> Sizing:
    """The pool's pages by the rule in this module's docstring; raises SizingError when one request at
    the max context does not fit."""
    request_pages = -(-p.max_context // p.page_size)
    most = p.max_running * request_pages  # what the engine can ever use at once
    budget = int(p.fraction * p.memory) - p.weights - p.activations - p.window_bytes
    why = (
        f"{p.fraction:g} x {_gib(p.memory)} {'total' if p.device == 'cuda' else 'available'} - "
        f"{_gib(p.weights)} weights - {_gib(p.activations)} activations - {_gib(p.window_bytes)} windows"
    )
    if p.free is not None and p.free - p.activations - p.window_bytes < budget:
        budget = p.free - p.activations - p.window_bytes
        why += f"; only {_gib(p.free)} free on the device"
    cap = max(CPU_KV_CAP_BYTES, request_pages * p.page_bytes)  # never below one max-context request
    if p.device != "cuda" and budget > cap:
        budget = cap
        why += f"; CPU cap {_gib(cap)}"
    # Without a full-attention layer pages hold nothing: as many as can be used.
    pages = max(budget, 0) // p.page_bytes if p.page_bytes else most
    if pages > most:
        pages = most
        why += f"; capped at {p.max_running} running x {p.max_context} tokens"
    if pages < request_pages:
        raise SizingError(
            f"the KV pool would hold {pages} pages of {p.page_size} tokens ({why}), fewer than one request "
            f"at the model's max context ({p.max_context} tokens = {request_pages} pages of "
            f"{_gib(p.page_bytes * request_pages)}): raise --kv-memory-fraction (now {p.fraction:g}), or set "
            f"--num-pages to serve a shorter context"
        )
    return Sizing(pages, pages * p.page_bytes + p.window_bytes, why)


def cpu_available_bytes() -> int:
    """RAM this process can still take: MemAvailable, or the cgroup's limit minus its usage if lower."""
    meminfo = Path("/proc/meminfo")
    available: int | None = None
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:  # not Linux: all physical memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or v1's huge number: no limit
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


def cuda_activation_bytes(
    model: torch.nn.Module, model_cfg: ModelConfig, kv: KVConfig, engine_cfg: EngineConfig
) -> int:
    """Peak memory the engine's largest steps take beyond the weights and the pool, measured with the
    caching allocator's statistics (what it reserves) on a throwaway engine with a pool just big enough:
    one prompt of the model's whole context in max_batch_tokens chunks, then a decode step of
    max_running rows. A throwaway engine
    rather than the model alone, so that the measure runs the very code (runner, attention, sampler)
    serving runs; without CUDA graphs, which would pin the memory they capture. The decode graphs the
    real engine captures keep a private pool about the size of that decode step's peak: it is counted
    once more."""
    device = torch.device(kv.device)
    # A prompt of the whole context: its last chunk (max_batch_tokens queries) attends over the longest
    # history, the step whose scratch (attention's splits, the chunk's activations) is largest. Past
    # PROBE_MAX_TOKENS the scratch no longer grows (the split count is capped), only the probe's time.
    n = max(min(model_cfg.max_position_embeddings - 2, PROBE_MAX_TOKENS), 1)
    rows = min(engine_cfg.max_running, kv.max_requests)
    pages = -(-(n + 1) // kv.page_size) + rows * -(-3 // kv.page_size)
    probe_cfg = dataclasses.replace(engine_cfg, cuda_graph_sizes=(), tune_gemms=False)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    probe = Engine(model, dataclasses.replace(kv, num_pages=pages), probe_cfg)  # type: ignore[arg-type]
    held = torch.cuda.memory_allocated(device) - before  # the probe's own small pool
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    chunk, decode = [[0] * n], [[0] for _ in range(rows)]  # max_batch_tokens chunks; max_running rows
    peaks = []
    for prompts, params in ((chunk, greedy), (decode, dataclasses.replace(greedy, max_tokens=2))):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        probe.generate(prompts, params)
        torch.cuda.synchronize(device)
        # Reserved, not allocated: the caching allocator's segments are what the device gives up.
        peaks.append(max(torch.cuda.max_memory_reserved(device) - reserved - held, 0))
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    graphs = engine_cfg.cuda_graph_sizes and any(b <= rows for b in engine_cfg.cuda_graph_sizes)
    return max(peaks) + (peaks[1] if graphs else 0) + CUDA_HEADROOM_BYTES


def capacity_text(engine: Engine) -> str:
    """The pool's capacity for the start-up banner (vLLM prints "# GPU blocks" and "Maximum concurrency")."""
    c = engine.cache
    pages, ctx = c.pages.capacity, engine.max_context()
    kv_bytes = pages * c.page_bytes() + KVCache.window_pool_bytes(c.model, c.cfg.max_requests, c.cfg.dtype)
    tokens = pages * c.page_size
    fit = tokens / ctx if c.full_layers else math.inf
    return (
        f"KV pool {pages} pages x {c.page_size} tokens = {tokens} tokens ({_gib(kv_bytes)}); "
        f"{fit:.1f} requests of {ctx} tokens (max context) fit, {c.cfg.max_requests} run at once"
    )
