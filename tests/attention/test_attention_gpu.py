"""Full-size shapes on a GPU: Triton against reference.py, CUDA-graph replay, and no host syncs."""

from __future__ import annotations

import math

import pytest
import torch

from invariants.testing import no_host_sync
from shared.kernels._launch import choose_tiles, fills_gpu, sm_count, split_count
from shared.kernels.attention import AttentionOps, TorchOps, TritonOps, ops_for
from shared.kernels.attention.paged_attention import paged_attention as triton_paged
from shared.kernels.attention.ring_attention import ring_attention as triton_ring

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 16, 8, 128, 16


class Step:
    """One random varlen batch on the GPU: a paged cache, a ring, and the chunk's q/k/v."""

    def __init__(
        self, l0: list[int], n: list[int], *, window: int = 1024, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        torch.manual_seed(sum(l0) + len(n))
        dev = "cuda"
        batch = len(l0)
        self.max_q = max(n)
        max_pages = math.ceil(max(a + b for a, b in zip(l0, n, strict=True)) / PAGE)
        num_pages = batch * max_pages + 1
        self.k_cache = torch.randn(num_pages, PAGE, HKV, D, device=dev, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        self.block_table = torch.randperm(num_pages, device=dev)[: batch * max_pages].view(batch, -1).int()
        tokens = sum(n)
        self.q = torch.randn(tokens, HQ, D, device=dev, dtype=dtype)
        self.k_new = torch.randn(tokens, HKV, D, device=dev, dtype=dtype)
        self.v_new = torch.randn_like(self.k_new)
        self.cu_q = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        self.q_start = torch.tensor(l0, dtype=torch.int32, device=dev)
        self.window = window
        self.k_ring = torch.randn(batch + 3, window, HKV, D, device=dev, dtype=dtype)
        self.v_ring = torch.randn_like(self.k_ring)
        self.slots = torch.randperm(batch + 3, device=dev)[:batch].int()
        self.scale = D**-0.5

    def paged(self, ops: AttentionOps, window: int | None) -> torch.Tensor:
        return ops.paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_table, self.cu_q, self.q_start,
            max_q=self.max_q, scale=self.scale, window=window,
        )  # fmt: skip

    def ring(self, ops: AttentionOps) -> torch.Tensor:
        return ops.ring_attention(
            self.q, self.k_new, self.v_new, self.k_ring, self.v_ring, self.slots, self.cu_q, self.q_start,
            max_q=self.max_q, scale=self.scale, window=self.window,
        )  # fmt: skip


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 in, fp32 softmax: close elementwise, and the worst error small against the output's scale."""
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert diff <= 2e-2 * max(scale, 1e-3), f"max |diff| {diff:.3e} vs max |expected| {scale:.3e}"
    torch.testing.assert_close(actual, expected, atol=1e-2, rtol=2e-2)


def _decode_lengths(batch: int, longest: int) -> list[int]:
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, longest, (batch,), generator=gen).tolist()
    lengths[0], lengths[-1] = 0, longest - 1  # first token of a sequence, and the longest context
    return lengths


@pytest.mark.parametrize("window", [None, 4096, 1024])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_matches_reference(batch: int, window: int | None) -> None:
    step = Step(_decode_lengths(batch, 8192), [1] * batch, window=window or 1024)
    expected = step.paged(TorchOps(), window)
    assert_near(step.paged(TritonOps(), window), expected)
    if window is not None:
        assert_near(step.ring(TritonOps()), step.ring(TorchOps()))


@pytest.mark.parametrize("window", [None, 1024])
def test_prefill_matches_reference(window: int | None) -> None:
    # A chunk from 0, a mid-sequence chunk longer than the window, a decode, a short chunk.
    step = Step([0, 3000, 4000, 123], [2048, 1500, 1, 517], window=window or 1024)
    assert_near(step.paged(TritonOps(), window), step.paged(TorchOps(), window))
    if window is not None:
        assert_near(step.ring(TritonOps()), step.ring(TorchOps()))


def test_split_k_factors_agree() -> None:
    step = Step([8191, 5000], [1, 1])
    args = (step.q, step.k_cache, step.v_cache, step.block_table, step.cu_q, step.q_start)
    one = triton_paged(*args, max_q=1, scale=step.scale, window=None, num_splits=1)
    for splits in (None, 4, 16, 32):
        assert_near(triton_paged(*args, max_q=1, scale=step.scale, window=None, num_splits=splits), one)


def _engine_lengths() -> list[int]:
    """The engine's decode batch (64 sequences at 528 tokens) with rings empty, partial, full and wrapped."""
    lengths = [527] * 64
    lengths[:6] = [0, 1, 63, 1023, 1024, 3000]
    return lengths


@pytest.mark.parametrize("lengths", ["engine", "mixed"])
def test_engine_decode_shape_split_k(lengths: str) -> None:
    """Batch 64, W=1024, Hq=16, Hkv=8, D=128, bf16: ring and paged, the rule's split and forced ones."""
    step = Step([527] * 64 if lengths == "engine" else _engine_lengths(), [1] * 64, window=1024)

    def ring(splits: int | None) -> torch.Tensor:
        return triton_ring(
            step.q, step.k_new, step.v_new, step.k_ring, step.v_ring, step.slots, step.cu_q, step.q_start,
            max_q=1, scale=step.scale, window=1024, num_splits=splits,
        )  # fmt: skip

    def paged(splits: int | None) -> torch.Tensor:
        return triton_paged(
            step.q, step.k_cache, step.v_cache, step.block_table, step.cu_q, step.q_start,
            max_q=1, scale=step.scale, window=None, num_splits=splits,
        )  # fmt: skip

    ring_ref, paged_ref = step.ring(TorchOps()), step.paged(TorchOps(), None)
    for splits in (None, 1, 2, 3, 4, 8, 32):
        assert_near(ring(splits), ring_ref)
        assert_near(paged(splits), paged_ref)
    # The wrappers take the rule's split (none on an H200's 132 SMs) and nothing else decides it.
    sms = sm_count(torch.cuda.current_device())
    full = fills_gpu(torch.device("cuda"), 64 * HKV)
    ring_bn = choose_tiles(HQ // HKV, 128, 1, "ring_attention", full).block_n
    paged_bn = choose_tiles(HQ // HKV, 128, 1, "paged_attention", full).block_n
    ring_s = split_count(64 * HKV, 1024, ring_bn, sms)
    paged_s = split_count(64 * HKV, step.block_table.shape[1] * PAGE, paged_bn, sms)
    if sms == 132:
        assert ring_s == paged_s == 1
    torch.testing.assert_close(ring(None), ring(ring_s), atol=0, rtol=0)
    torch.testing.assert_close(paged(None), paged(paged_s), atol=0, rtol=0)


def test_decode_replays_from_a_cuda_graph() -> None:
    ops = TritonOps()
    step = Step(_decode_lengths(8, 4096), [1] * 8)
    rows = step.block_table[:, 0].long() * PAGE  # any fixed destination rows will do for the scatter
    k_flat, v_flat = step.k_cache.view(-1, HKV, D), step.v_cache.view(-1, HKV, D)

    def decode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ops.store_kv(step.k_new, step.v_new, k_flat, v_flat, rows)
        return step.paged(ops, None), step.paged(ops, 1024), step.ring(ops)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode()
    for seed in (1, 2):
        torch.manual_seed(seed)
        step.q.copy_(torch.randn_like(step.q))
        step.k_new.copy_(torch.randn_like(step.k_new))
        step.q_start.copy_(torch.randint(1, 4000, step.q_start.shape, device="cuda", dtype=torch.int32))
        graph.replay()
        eager = decode()
        for got, want in zip(static_out, eager, strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ops_make_no_host_sync(backend: str) -> None:
    ops = ops_for("cuda", backend=backend)
    prefill = Step([0, 700, 30], [300, 129, 1])
    decode = Step(_decode_lengths(16, 4096), [1] * 16)
    rows = torch.arange(prefill.q.shape[0], device="cuda") - 5  # the first five rows are skipped

    def run() -> None:
        k_flat, v_flat = prefill.k_cache.view(-1, HKV, D), prefill.v_cache.view(-1, HKV, D)
        ops.store_kv(prefill.k_new, prefill.v_new, k_flat, v_flat, rows)
        for step in (prefill, decode):
            step.paged(ops, None)
            step.paged(ops, 1024)
            step.ring(ops)

    run()  # warm up: compile, allocate
    torch.cuda.synchronize()
    with no_host_sync():
        run()
