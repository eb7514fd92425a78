"""`skinny_gemm` (interpreted on CPU, compiled on CUDA) against torch: split K or not, odd sizes, and
the ticket counters left zeroed for the next launch."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import skinny_gemm as sg
from shared.kernels._tickets import _sets as ticket_sets
from shared.kernels.skinny_gemm import GemmConfig, choose_config, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


def want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (5, 33, 300), (16, 64, 512), (64, 96, 256)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_matches_torch_split_or_not(m: int, n: int, k: int, split_k: int) -> None:
    x, w = operands(m, n, k)
    got = skinny_gemm(x, w, GemmConfig(block_n=16, block_k=32, split_k=split_k, num_warps=2, num_stages=2))
    torch.testing.assert_close(got, want(x, w), rtol=2e-2, atol=2e-2)
    blocks = -(-n // 16)
    assert all(int(t[:blocks].abs().sum()) == 0 for t in ticket_sets.values()), (
        "tickets reset for the next launch"
    )


@pytest.mark.parametrize("split_k", [1, 3])
def test_descriptor_loads_match_torch(split_k: int) -> None:
    """`GemmConfig.tma`: the tiles through tensor descriptors, rows, columns and K past the operands'
    ends read as zeros."""
    x, w = operands(5, 40, 328)
    cfg = GemmConfig(block_n=16, block_k=64, split_k=split_k, num_warps=2, num_stages=2, tma=True)
    torch.testing.assert_close(skinny_gemm(x, w, cfg), want(x, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split_k", [1, 3])
def test_an_addend_is_added_once_and_written_in_place(split_k: int) -> None:
    """`add=`: the residual stream plus the product, rounded once, into the residual's storage."""
    x, w = operands(5, 40, 300)
    residual = (10 * torch.randn(5, 40, generator=torch.Generator().manual_seed(3))).to(DEVICE, x.dtype)
    expected = (residual.float() + x.float() @ w.float().T).to(x.dtype)
    cfg = GemmConfig(block_n=16, block_k=32, split_k=split_k, num_warps=2, num_stages=2)
    got = skinny_gemm(x, w, cfg, add=residual)
    assert got.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"add must be \[5, 40\]"):
        skinny_gemm(x, w, cfg, add=residual[:4])
    empty = operands(3, 20, 0)
    kept = torch.ones(3, 20, dtype=x.dtype, device=DEVICE)
    assert torch.equal(skinny_gemm(*empty, add=kept), torch.ones_like(kept)), "an empty sum adds nothing"


def test_a_split_that_would_be_empty_is_not_launched() -> None:
    # K = 96 in 64-wide tiles, asked for 4 splits: two chunks of 64 cover it, and only two programs
    # per column block add partials (a third one would wait for a ticket that never comes).
    x, w = operands(3, 20, 96)
    got = skinny_gemm(x, w, GemmConfig(block_n=16, block_k=64, split_k=4, num_warps=2, num_stages=2))
    torch.testing.assert_close(got, want(x, w), rtol=2e-2, atol=2e-2)


def test_repeated_launches_agree_bit_for_bit() -> None:
    x, w = operands(8, 48, 512)
    cfg = GemmConfig(block_n=16, block_k=64, split_k=4, num_warps=2, num_stages=2)
    first = skinny_gemm(x, w, cfg)
    assert torch.equal(skinny_gemm(x, w, cfg), first), "partials are added in split order"


def test_an_empty_inner_dimension_gives_zeros() -> None:
    x, w = operands(3, 20, 0)
    assert torch.equal(skinny_gemm(x, w), torch.zeros(3, 20, dtype=x.dtype, device=x.device))


def test_bad_operands_are_refused_by_name() -> None:
    x, w = operands(4, 16, 32)
    with pytest.raises(ValueError, match="skinny_gemm: x must be"):
        skinny_gemm(x, w[:, :16])
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_gemm(torch.cat([x] * 17), w)
    with pytest.raises(ValueError, match="share dtype"):
        skinny_gemm(x.float(), w)


def test_the_default_config_is_the_sweeps_best_at_the_decode_shapes() -> None:
    # bench/gemm_decode.py on an H200, M = 64: narrow outputs take 16-column blocks (o_proj) or split a
    # deep K (down_proj); wide ones neither.
    assert choose_config(64, 2048, 2048) == GemmConfig(block_n=16, block_k=256, split_k=1)  # o
    assert choose_config(64, 2048, 6144) == GemmConfig(block_n=32, block_k=128, split_k=4)  # down
    assert choose_config(64, 4096, 2048) == GemmConfig(block_n=32, block_k=256, split_k=1)  # q/k/v
    assert choose_config(64, 12288, 2048) == GemmConfig(block_n=32, block_k=128, split_k=1)  # gate/up


def test_fp8_descriptor_loads_take_the_sweeps_best_above_32_rows() -> None:
    """`bench/gemm_fp8.py --model 8b` on an H200 at M = 64, per-channel scales and 128-column groups;
    32 rows or fewer keep the pointer loads (faster there: the 8B's decode step at batch 24 and 32)."""

    def tma(m: int, n: int, k: int, group: int | None = None) -> GemmConfig:
        return choose_config(m, n, k, itemsize=1, group=group, tma=True, sms=132)

    assert tma(64, 6144, 4096) == GemmConfig(32, 256, 1, 4, 4, tma=True)  # qkv: 192 programs, two an SM
    assert tma(64, 4096, 4096) == GemmConfig(32, 256, 1, 4, 6, tma=True)  # o: one wave
    assert tma(64, 4096, 14336) == GemmConfig(32, 256, 1, 4, 6, tma=True)  # down
    assert tma(64, 28672, 4096) == GemmConfig(128, 128, 1, 8, 4, tma=True)  # gate/up
    assert tma(64, 6144, 4096, 128) == GemmConfig(32, 128, 1, 4, 8, tma=True)  # half-deep tiles
    assert tma(64, 28672, 4096, 128) == choose_config(64, 28672, 4096, itemsize=1, group=128)  # pointers
    assert tma(16, 4096, 14336) == choose_config(16, 4096, 14336, itemsize=1)  # pointer loads
    assert tma(32, 6144, 4096) == choose_config(32, 6144, 4096, itemsize=1)
    assert tma(33, 6144, 4096) == GemmConfig(32, 256, 1, 4, 4, tma=True)


def test_the_default_config_fits_its_operand_tiles_in_shared_memory() -> None:
    # fp32 operands would overflow an H200's 227 KiB with the bf16 tiles (seen on the GPU as
    # OutOfResources); the K tile, then the pipeline, shrink.
    for m, itemsize in [(64, 2), (21, 4), (64, 4)]:
        cfg = choose_config(m, 4096, 2048, itemsize=itemsize)
        a_rows = max(16, 1 << (m - 1).bit_length())
        assert cfg.num_stages * cfg.block_k * itemsize * (a_rows + cfg.block_n) <= sg._SMEM_BUDGET, cfg
    assert choose_config(21, 4096, 2048, itemsize=4).block_k < choose_config(21, 4096, 2048).block_k


@pytest.mark.parametrize(
    ("in_features", "out_features", "cases"),
    [
        (96, 64, ((1, True), (16, True), (17, False), (64, False))),  # up to 16 rows
        (96, 48, ((1, True), (17, True), (64, True), (65, False))),  # deep (K >= 2N): up to 64 rows
    ],
)
def test_the_default_gemm_takes_the_skinny_kernel_where_it_measured_faster(
    in_features, out_features, cases, monkeypatch
) -> None:
    """Where each is faster: the skinny kernel at decode batches of up to 16 rows, and up to 64 for
    deep weights (the down projection, where cuBLAS splits K and reduces in a kernel of its own);
    cuBLAS above. Either way the result is that kernel's."""
    from torch import nn

    from shared.kernels.ops import kernels_for

    kernels = kernels_for(DEVICE, "triton")
    calls: list[int] = []

    def recording(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return skinny_gemm(x, w)

    monkeypatch.setattr(kernels, "_skinny_gemm", recording)
    layer = nn.Linear(in_features, out_features, bias=False).to(DEVICE, torch.bfloat16)
    for m, skinny in cases:
        x = operands(m, out_features, in_features)[0]
        calls.clear()
        got = kernels.linear(x, layer)
        assert calls == ([m] if skinny else []), f"{m} rows"
        want = skinny_gemm(x, layer.weight) if skinny else torch.nn.functional.linear(x, layer.weight)
        assert torch.equal(got, want), f"{m} rows"
