"""FP8 GEMMs on cuBLASLt through `torch._scaled_mm`, where it has them: per-token x per-channel scales
(RowWise), and DeepSeek's 1x128 activation groups x 128x128 weight blocks (BlockWise1x128 x
BlockWise128x128; Hopper only, cuBLASLt >= 12.9). Everything else goes to the Triton GEMM (`gemm.py`).

`torch._scaled_mm(a, b, scale_a, scale_b)` takes a row-major [M, K] and a column-major [K, N] (a
weight [N, K] transposed, no copy) with float32 dequantizing scales whose shape and strides name the
scaling: per token [M, 1] and per channel [1, N]; 1x128 groups [M, K/128] with strides (1, M)
(column-major, what the Triton quantizers write) and 128x128 blocks [K/128, N/128] (the weight's
block scales transposed). Which shapes cuBLAS takes is checked by `takes` on the host (shapes only);
whether this GPU and torch build run a scaling at all is probed once per device (`supported`), on the
first FP8 forward, which the engine runs eagerly at warm-up, never inside a graph capture.
"""

from __future__ import annotations

import functools
import logging

import torch

from shared.kernels.fp8 import reference
from shared.kernels.fp8.reference import Fp8Act

__all__ = ["kind_of", "scaled_mm", "supported", "takes"]

log = logging.getLogger(__name__)

BLOCK = (128, 128)


def kind_of(block: tuple[int, int], k: int) -> str | None:
    """The cuBLAS scaling of a weight with `block` scales and K columns (None: no cuBLAS path)."""
    if block[0] == 1 and block[1] >= k:
        return "rowwise"
    if tuple(block) == BLOCK:
        return "blockwise"
    return None


def takes(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether cuBLAS's scaled GEMM takes this weight and its scales (shapes only; `supported` says
    whether the device runs that scaling at all)."""
    n, k = weight.shape
    kind = kind_of(block, k)
    if kind is None or not weight.is_cuda or k % 16 or n % 16:
        return False
    if kind == "blockwise":
        # Whole blocks, and a scale row of 16-byte multiples (cuBLASLt's block-scale layout).
        return k % 512 == 0 and n % 128 == 0
    return True


def scaled_mm(
    a: Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`reference.gemm` (without a residual) on cuBLASLt; `takes` must hold."""
    n = weight.shape[0]
    rowwise = kind_of(block, weight.shape[1]) == "rowwise"
    # [N, 1] -> [1, N]; [N/128, K/128] -> [K/128, N/128]
    scale_b = scale.view(1, n) if rowwise else scale.t()
    # The bias in cuBLAS's epilogue where it takes one: row-wise scaling to a 16-bit output.
    fused = bias if rowwise and a.dtype != torch.float32 else None
    out = torch._scaled_mm(a.data, weight.t(), a.scale, scale_b, bias=fused, out_dtype=a.dtype)
    return out.add_(bias) if bias is not None and fused is None else out


@functools.cache
def supported(device: torch.device, kind: str) -> bool:
    """Whether `torch._scaled_mm` runs `kind` ("rowwise", "blockwise") on this GPU, right: tried once
    on a few shapes against the reference. False (and the Triton GEMM) where it raises or is wrong."""
    block = (1, 512) if kind == "rowwise" else BLOCK
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        w = torch.randn(256, 512, device=device, generator=gen) * 0.05
        wq, ws = reference.quantize_weight(w, block)
        for rows in (1, 3, 64, 200):
            x = torch.randn(rows, 512, device=device, generator=gen).to(torch.bfloat16)
            a = reference.quantize(x, block[1])
            a = a._replace(scale=a.scale.t().contiguous().t())  # column-major, as the kernels write it
            got = scaled_mm(a, wq, ws, block).float()
            want = reference.gemm(a, wq, ws, block).float()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                log.warning("torch._scaled_mm %s is off at %d rows: the Triton FP8 GEMM instead", kind, rows)
                return False
    except (RuntimeError, NotImplementedError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.info("torch._scaled_mm %s is not available here (%s): the Triton FP8 GEMM instead", kind, why)
        return False
    return True
