"""FP8 weights' kernels on CPU: the torch reference (block quantize / dequantize and its error bounds,
the scaled GEMM), and the Triton quantizers and GEMM (interpreted) against it. The same kernels on a
GPU, with cuBLAS's scaled GEMMs: tests/model/test_fp8_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shared.kernels.fp8 import E4M3, FP8_MAX, Fp8Act, fp8_kernels_for
from shared.kernels.fp8 import reference as ref

BLOCKS = [(1, 200), (128, 128), (1, 128), (64, 32)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows and columns of very different ranges, as trained weights have them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * torch.rand(1, k, generator=g) * 4


@pytest.mark.parametrize("block", BLOCKS)
def test_block_round_trip_error_bounds(block: tuple[int, int]) -> None:
    n, k = 300, 200  # partial blocks at both ends
    w = _weight(n, k)
    q, scale = ref.quantize_weight(w, block)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert tuple(scale.shape) == (math.ceil(n / block[0]), math.ceil(k / block[1]))
    back = ref.dequantize(q, scale, block)
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; subnormals are 2^-9 apart.
    bound = torch.maximum(w.abs() * 2**-4, full * 2**-10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    # Each block's largest value lands on 448 exactly: the whole e4m3 range, no saturation.
    assert (ref._groups(q.float(), *block).abs().amax(dim=(1, 3)) == FP8_MAX).all()


def test_zero_and_tiny_blocks() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1e-30
    q, scale = ref.quantize_weight(w, (128, 128))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (ref.dequantize(q, scale, (128, 128))[:, :128] == 0).all()


def test_activation_groups() -> None:
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1, 10, 100, 1e4])[:, None]
    for group, groups in ((128, 3), (300, 1), (1000, 1)):
        a = ref.quantize(x, group)
        assert tuple(a.scale.shape) == (5, groups) and a.group == min(group, 300)
        assert a.dtype == x.dtype and a.shape == x.shape
        back = ref.dequantize_act(a)
        full = a.scale.repeat_interleave(a.group, 1)[:, :300]
        assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, full * 2**-10) * (1 + 1e-6)).all()


# ---- Triton (interpreted) against the reference ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "size", "group"), [(3, 200, 128), (1, 64, 128), (4, 1000, 1000), (2, 1152, 128)]
)
def test_quantize_kernel_is_the_reference(dtype: torch.dtype, rows: int, size: int, group: int) -> None:
    from shared.kernels.fp8.quant import quantize

    x = (torch.randn(rows, size) * 10).to(dtype)
    x[0, :7] = 0
    strided = torch.zeros(rows, size + 5, dtype=dtype)
    strided[:, :size] = x
    for inp in (x, strided[:, :size]):  # rows by stride
        got, want = quantize(inp, group), ref.quantize(x, group)
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(_bits(got.data), _bits(want.data))
        assert got.scale.stride(0) == 1 or rows == 1  # column-major: what cuBLAS's 1x128 scaling reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("size", "group"), [(256, 128), (200, 128), (576, 576), (64, 128)])
def test_rms_norm_quant_kernel_is_the_reference(dtype: torch.dtype, size: int, group: int) -> None:
    from shared.kernels.fp8.rms_norm_quant import rms_norm_quant

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, size, generator=g) * 3).to(dtype)
    w = (torch.rand(size, generator=g) + 0.5).to(dtype)
    got, want = rms_norm_quant(x, w, 1e-5, group), ref.rms_norm_quant(x, w, 1e-5, group)
    if dtype == torch.bfloat16:  # the normed row is rounded to bf16 first: the float32 sum order vanishes
        assert torch.equal(got.scale, want.scale) and torch.equal(_bits(got.data), _bits(want.data))
    else:
        torch.testing.assert_close(got.scale, want.scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(ref.dequantize_act(got), ref.dequantize_act(want), rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [(3, 96, 200, (1, 200)), (5, 256, 256, (128, 128)), (17, 200, 384, (1, 128)), (1, 130, 300, (128, 128)),
     (70, 48, 100, (1, 100))],
)  # fmt: skip
def test_gemm_kernel_matches_the_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block: tuple[int, int]
) -> None:  # fmt: skip
    from shared.kernels.fp8.gemm import gemm

    g = torch.Generator().manual_seed(1)
    wq, ws = ref.quantize_weight(_weight(n, k) * 0.1, block)
    a = ref.quantize(torch.randn(m, k, generator=g).to(dtype), block[1])
    bias = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(m, n, generator=g).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(gemm(a, wq, ws, block), ref.gemm(a, wq, ws, block), **tol)
    out = residual.clone()
    got = gemm(a, wq, ws, block, bias, out)
    assert got.data_ptr() == out.data_ptr()  # the sum written into the residual
    torch.testing.assert_close(got, ref.gemm(a, wq, ws, block, bias, residual), **tol)


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "group", "split"),
    [(3, 96, 256, (1, 256), 256, 1), (5, 96, 256, (1, 256), 256, 2), (7, 256, 384, (128, 128), 128, 3),
     (4, 80, 384, (1, 128), 128, 1), (6, 64, 256, (1, 256), 128, 2), (33, 40, 200, (1, 200), 200, 1)],
    ids=["per-channel", "per-channel-split-k", "blocks-split-k", "row-groups", "groups-x-channels", "odd"],
)  # fmt: skip
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_skinny_gemm_takes_fp8_operands(
    m: int, n: int, k: int, block: tuple[int, int], group: int, split: int, tma: bool
) -> None:  # fmt: skip
    """The decode GEMM with FP8 operands: each K group's partial scaled as it joins the sum (x's groups
    against per-channel weights included), per-row scales once at the end, split K or not, the bias
    and the residual inside: the reference, rounded once. Tiles loaded by pointer or through tensor
    descriptors (Hopper's default), the descriptors' zero fill standing in for the masks past M, N
    and K."""
    from shared.kernels.skinny_gemm import GemmConfig, Scales, skinny_gemm

    if tma and k % 16:
        pytest.skip("rows of 200 bytes are not 16-byte aligned: the refusal is tested below")

    g = torch.Generator().manual_seed(2)
    wq, ws = ref.quantize_weight(_weight(n, k) * 0.1, block)
    a = ref.quantize(torch.randn(m, k, generator=g).to(torch.bfloat16), group)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    residual = torch.randn(m, n, generator=g).to(torch.bfloat16)
    block_k = group if group < k else block[1] if block[1] < k else 64
    cfg = GemmConfig(block_n=16, block_k=block_k, split_k=split, num_warps=2, num_stages=2, tma=tma)
    out = residual.clone()
    got = skinny_gemm(
        a.data, wq, cfg, add=out, scales=Scales(a.scale, a.group, ws, block, torch.bfloat16, bias)
    )
    assert got.data_ptr() == out.data_ptr()
    want = ref.gemm(a, wq, ws, block, bias, residual)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # float32 sums in another order
    plain = skinny_gemm(a.data, wq, cfg, scales=Scales(a.scale, a.group, ws, block, torch.bfloat16))
    torch.testing.assert_close(plain, ref.gemm(a, wq, ws, block), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_a_split_past_k_reads_no_scale_past_the_last_group(tma: bool) -> None:
    """K = 384 split two ways in 128-column steps: the second split's last step lies past K (zeros).
    It reads no scale group past the last, so what lies there in memory (here NaN) never reaches the
    sum."""
    from shared.kernels.skinny_gemm import GemmConfig, Scales, skinny_gemm

    m, n, k = 3, 64, 384
    g = torch.Generator().manual_seed(7)
    wq, ws = ref.quantize_weight(torch.randn(n, k, generator=g) * 0.1, (128, 128))
    a = ref.quantize(torch.randn(m, k, generator=g).to(torch.bfloat16), 128)
    w_next = torch.full((ws.shape[0], ws.shape[1] + 1), math.nan)  # NaN right after each row's groups
    w_next[:, :-1] = ws
    a_next = torch.full((a.scale.shape[1] + 1, m), math.nan)  # column-major, NaN after the last group
    a_next[:-1] = a.scale.t()
    cfg = GemmConfig(block_n=16, block_k=128, split_k=2, num_warps=2, num_stages=2, tma=tma)
    scales = Scales(a_next[:-1].t(), 128, w_next[:, :-1], (128, 128), torch.bfloat16)
    got = skinny_gemm(a.data, wq, cfg, scales=scales)
    torch.testing.assert_close(got, ref.gemm(a, wq, ws, (128, 128)), rtol=1e-2, atol=1e-2)


def test_skinny_gemm_refuses_scales_that_do_not_fit() -> None:
    from shared.kernels.skinny_gemm import GemmConfig, Scales, skinny_gemm

    wq, ws = ref.quantize_weight(torch.randn(64, 256), (128, 128))
    a = ref.quantize(torch.randn(2, 256), 64)
    with pytest.raises(ValueError, match="must match"):
        skinny_gemm(a.data, wq, scales=Scales(a.scale, 64, ws, (128, 128), torch.bfloat16))
    a = ref.quantize(torch.randn(2, 256), 128)
    with pytest.raises(ValueError, match="block_k = 128"):
        cfg = GemmConfig(block_k=64)
        skinny_gemm(a.data, wq, cfg, scales=Scales(a.scale, 128, ws, (128, 128), torch.bfloat16))
    with pytest.raises(ValueError, match=r"scales.w must be float32 \[1, 2\]"):
        skinny_gemm(a.data, wq, scales=Scales(a.scale, 128, ws[:, :1], (128, 128), torch.bfloat16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        skinny_gemm(a.data.float(), wq.float(), scales=Scales(a.scale, 128, ws, (128, 128), torch.bfloat16))
    odd_w, odd_ws = ref.quantize_weight(torch.randn(64, 200), (1, 200))
    odd = ref.quantize(torch.randn(2, 200), 200)
    with pytest.raises(ValueError, match="tma needs 1- or 2-byte operands on 16-byte aligned rows"):
        cfg = GemmConfig(block_n=16, block_k=64, tma=True)
        skinny_gemm(odd.data, odd_w, cfg, scales=Scales(odd.scale, 200, odd_ws, (1, 200), torch.bfloat16))
    with pytest.raises(ValueError, match="tma tiles must span 16 bytes to 256 columns"):
        cfg = GemmConfig(block_n=512, block_k=128, tma=True)
        skinny_gemm(a.data, wq, cfg, scales=Scales(a.scale, 128, ws, (128, 128), torch.bfloat16))


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu-tanh"])
@pytest.mark.parametrize(("size", "group"), [(384, 128), (200, 128), (300, 300)])
def test_glu_quant_kernel_is_the_reference(gelu: bool, size: int, group: int) -> None:
    """The MLP's activation quantized in its own kernel: the reference's bits (bf16 rounds each op)."""
    from shared.kernels.fp8.glu_quant import glu_quant

    gate_up = (torch.randn(5, 2 * size, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    gate_up[1] = 0  # an all-zero row: the floor scale, zeros
    got, want = glu_quant(gate_up, group, gelu), ref.glu_quant(gate_up, group, gelu)
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(_bits(got.data), _bits(want.data))
    assert got.group == min(group, size) and got.dtype == torch.bfloat16


def test_gemm_refuses_mismatched_groups() -> None:
    from shared.kernels.fp8.gemm import gemm

    wq, ws = ref.quantize_weight(torch.randn(64, 256), (128, 128))
    with pytest.raises(ValueError, match="group"):
        gemm(ref.quantize(torch.randn(2, 256), 256), wq, ws, (128, 128))
    with pytest.raises(ValueError, match="scale must be"):
        gemm(ref.quantize(torch.randn(2, 256), 128), wq, ws[:, :1], (128, 128))


# ---- the kernels' seam ---------------------------------------------------------------------------


class _Layer(nn.Module):
    def __init__(self, w: torch.Tensor, block: tuple[int, int]) -> None:
        super().__init__()
        self.weight, self.weight_scale_inv = ref.quantize_weight(w, block)
        self.block, self.bias = block, None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_kernels_route_by_layer(backend: str) -> None:
    kernels = fp8_kernels_for("cpu", backend)
    x = torch.randn(4, 256)
    plain = nn.Linear(256, 64, bias=False)
    layer = _Layer(plain.weight.detach(), (1, 256))
    torch.testing.assert_close(kernels.linear(x, plain), x @ plain.weight.t())  # an unquantized layer
    want = ref.gemm(ref.quantize(x, 256), layer.weight, layer.weight_scale_inv, layer.block)
    torch.testing.assert_close(kernels.linear(x, layer), want, rtol=1e-5, atol=1e-5)
    a = kernels.rms_norm_quant(x, torch.ones(256), 1e-6, 256)
    assert isinstance(a, Fp8Act)
    residual = torch.randn(4, 64)
    torch.testing.assert_close(
        kernels.linear_add(a, layer, residual.clone()),
        ref.gemm(a, layer.weight, layer.weight_scale_inv, layer.block, None, residual), rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    assert not kernels.takes_cublas(64, layer)
    assert fp8_kernels_for("cpu", backend) is kernels  # shared, like kernels_for's
