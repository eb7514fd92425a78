"""The decode MLP's gate/up projection, its activation and the down projection's quantization in one
kernel (`skinny_glu`): the skinny GEMM (`shared/kernels/skinny_gemm.py`) with FP8 operands, each program
holding its columns of gate and of up, so that act(gate) * up is computed in its epilogue rather than
written to memory as [T, 2I] and read back by `glu_quant`.

The down projection wants its input quantized, and a per-token scale needs a whole row's maximum, which
no program holds. So the output is scaled per token in 128-column groups, two programs a group: each
writes its half of the activation (16-bit) and its rows' maxima, and the second of the pair to finish
(a ticket) scales both halves and writes them as e4m3. The down projection reads 128-column groups as
its K tiles (`Fp8Kernels.glu_linear`). The quantized values are `glu_quant`'s of the GEMM's rounded
output in 128-column groups, bit for bit.
"""

from __future__ import annotations

import torch
import triton

from shared.kernels._norm_checks import fail
from shared.kernels.fp8.quant import scale_buffer
from shared.kernels.fp8.reference import E4M3, Fp8Act
from shared.kernels.skinny_gemm import GemmConfig, Scales, check_operands, config_for, launch, tma_capable

__all__ = ["GLU_BLOCK_N", "skinny_glu"]

# Columns of each half a program: two programs are one 128-column scale group of the quantized output.
GLU_BLOCK_N = 64


def skinny_glu(
    x: torch.Tensor, w: torch.Tensor, scales: Scales, *, gelu: bool = False, quantize: bool = False,
    cfg: GemmConfig | None = None,
) -> torch.Tensor | Fp8Act:  # fmt: skip
    """act(x @ gate^T) * (x @ up^T) for e4m3 x [M, K] (M <= 64) and w [2I, K], gate's rows then up's, as
    `glu_quant` computes it from the projection's rounded output (act: silu, or GELU's tanh
    approximation with `gelu`): [M, I] in `scales.out_dtype`; with `quantize`, an `Fp8Act` scaled per
    token in groups of 2 * block_n (128) columns."""
    op = "skinny_glu"
    m, n, _, dtype, grouping = check_operands(op, x, w, scales)
    if scales.bias is not None:
        fail(op, "takes no bias")
    half = n // 2
    if n % 2 or half % GLU_BLOCK_N:
        fail(op, f"w must hold gate and up halves of a multiple of {GLU_BLOCK_N} rows each, got {n} rows")
    if cfg is None:  # descriptor loads above 16 rows, as the skinny GEMM's configs take them
        tma = m > 16 and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (9, 0)
        tma = tma and tma_capable(x, w)
        cfg = GemmConfig(GLU_BLOCK_N, 128, num_warps=4, num_stages=4 if tma else 3, tma=tma)
    cfg = config_for(op, x, w, cfg, scales, grouping)
    if cfg.split_k != 1 or (quantize and half % (2 * cfg.block_n)):
        fail(op, f"needs split_k 1 and, to quantize, halves of whole groups of {2 * cfg.block_n}, got {cfg}")
    h = torch.empty((m, half), dtype=dtype, device=x.device)
    groups = triton.cdiv(half, 2 * cfg.block_n)
    out = Fp8Act(torch.empty((m, half), dtype=E4M3, device=x.device), scale_buffer(m, groups, x.device),
                 2 * cfg.block_n, dtype)  # fmt: skip
    if m and half:
        launch(x, w, h, cfg, scales, grouping, half, glu=(gelu, (out.data, out.scale) if quantize else None))
    return out if quantize else h
