"""The MLP's gate/up projection and its activation in one kernel, for a decode batch whose activations
stay 16-bit (`Fp8Kernels.activations16`): each program multiplies the batch's rows by BLOCK_N rows of
the gate weights and the same rows of the up weights (e4m3, widened to x's dtype in the kernel, as
`skinny_gemm` with `Scales(None, ...)` does), rounds both products to the activation dtype as that
GEMM's output would be, and writes act(gate) * up (`silu_mul.glu`): the [T, 2I] product never leaves
the SMs and no activation kernel runs between the two projections.

Quantized activations cannot be fused this way: a token's scale needs the maximum over its whole row,
which every program writes a part of (docs/performance.md: a grid barrier inside the kernel cost
about what the kernel boundary did).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shared.kernels._launch import f32_dot, interpreting, next_pow2
from shared.kernels._norm_checks import check_triton_device, fail
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels._round import round_to
from shared.kernels.silu_mul import glu
from shared.kernels.skinny_gemm import tma_capable

__all__ = ["gate_up_glu"]


@triton.jit(do_not_specialize=["M"])
def _gate_up_glu_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, bias_ptr, M, half, K, stride_xm, stride_wn, stride_om, stride_wsn,
    stride_wsg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_ROWS: tl.constexpr,
    W_GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, F32_DOT: tl.constexpr,
    TMA: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows are half further
    m_ok = rm < M
    n_ok = rn < half
    # The weights' scales and the bias: no kernel of the step writes them, so read before the wait.
    ws_g = ws_ptr + (rn // W_ROWS) * stride_wsn
    ws_u = ws_ptr + ((half + rn) // W_ROWS) * stride_wsn
    scale_g = tl.full([BLOCK_N], 1.0, tl.float32)
    scale_u = tl.full([BLOCK_N], 1.0, tl.float32)
    if not W_GROUPED:
        scale_g = tl.load(ws_g, mask=n_ok, other=0.0)
        scale_u = tl.load(ws_u, mask=n_ok, other=0.0)
    bias_g = tl.zeros([BLOCK_N], tl.float32)
    bias_u = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias_g = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        bias_u = tl.load(bias_ptr + half + rn, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # tensor descriptors; what lies past M, the halves' rows or K reads as zeros
            x = x_ptr.load([0, k0])
            g = w_ptr.load([pid * BLOCK_N, k0])
            u = w_ptr.load([half + pid * BLOCK_N, k0])
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x_at = x_ptr + rm[:, None] * stride_xm + rk[None, :]
            x = tl.load(x_at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = n_ok[:, None] & k_ok[None, :]
            g_at = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
            g = tl.load(g_at, mask=w_mask, other=0.0)
            u = tl.load(g_at + half * stride_wn, mask=w_mask, other=0.0)
        g = g.to(x.dtype)  # e4m3 widened exactly
        u = u.to(x.dtype)
        if F32_DOT:  # the interpreter, whose dot cannot take 16-bit operands
            part_g = tl.dot(x.to(tl.float32), tl.trans(g.to(tl.float32)), input_precision="ieee")
            part_u = tl.dot(x.to(tl.float32), tl.trans(u.to(tl.float32)), input_precision="ieee")
        else:
            part_g = tl.dot(x, tl.trans(g))
            part_u = tl.dot(x, tl.trans(u))
        if W_GROUPED:  # the K step is one scale group: its partials scaled before they join the sums
            part_g = part_g * tl.load(ws_g + (k0 // BLOCK_K) * stride_wsg, mask=n_ok, other=0.0)[None, :]
            part_u = part_u * tl.load(ws_u + (k0 // BLOCK_K) * stride_wsg, mask=n_ok, other=0.0)[None, :]
        acc_g += part_g
        acc_u += part_u
    release_next(PDL)  # the down projection fills this one's tail
    dtype = out_ptr.dtype.element_ty
    gate = round_to(acc_g * scale_g[None, :] + bias_g[None, :], dtype)  # as the GEMM would store them
    up = round_to(acc_u * scale_u[None, :] + bias_u[None, :], dtype)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, glu(gate, up, dtype, GELU).to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def gate_up_glu(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None, gelu: bool = False, tma: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """act(x @ gate^T) * (x @ up^T) for x [M, K] bf16 or fp16 (M <= 64) and e4m3 weight [2I, K]
    (gate | up) with float32 scales [ceil(2I / bn), ceil(K / bk)] for `block` (bn, bk) and an optional
    bias [2I] in x's dtype: `glu` of `gemm_w16`'s result (`reference`), [M, I] in x's dtype. `tma`:
    descriptor loads or pointer loads (None: descriptors above 32 rows on Hopper)."""
    op = "gate_up_glu"
    check_triton_device(op, x.device)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] % 2:
        fail(op, f"x must be [M, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != torch.float8_e4m3fn:
        fail(op, f"x must be bf16 or fp16 and weight float8_e4m3fn, got {x.dtype} and {weight.dtype}")
    m, k = x.shape
    half = weight.shape[0] // 2
    bn, bk = block
    if m > 64:
        fail(op, f"is for at most 64 rows, got {m}")
    want = [triton.cdiv(2 * half, bn), triton.cdiv(k, bk)]
    if list(scale.shape) != want or scale.dtype != torch.float32:
        fail(op, f"scale must be float32 {want}, got {scale.dtype} {list(scale.shape)}")
    if bn > 1 and half % bn:
        fail(op, f"the gate and up halves ({half} rows) must each start on a {bn}-row scale block")
    if bias is not None and (
        tuple(bias.shape) != (2 * half,) or bias.dtype != x.dtype or bias.stride(0) != 1
    ):
        fail(op, f"bias must be a contiguous [{2 * half}] tensor of {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        fail(op, "x and weight must be contiguous along K")
    out = torch.empty((m, half), dtype=x.dtype, device=x.device)
    if m == 0 or half == 0:
        return out
    grouped = bk < k
    block_m = max(16, next_pow2(m))
    block_k = bk if grouped else 128
    # Descriptor loads above 32 rows on Hopper, as the skinny GEMM takes them; 64 gate and 64 up rows a
    # program on 4 warps, three stages (`bench/gemm_fp8.py --sweep-w16` measures the alternatives).
    if tma is None:
        tma = x.device.type == "cuda" and m > 32 and torch.cuda.get_device_capability(x.device) >= (9, 0)
        tma = tma and tma_capable(x, weight)
    elif tma and not tma_capable(x, weight):
        fail(op, "tma needs rows of x and weight on 16-byte boundaries")
    block_n, stages = (64, 3) if tma else (32, 4)
    xa: torch.Tensor | TensorDescriptor = x
    wa: torch.Tensor | TensorDescriptor = weight
    if tma:
        xa = TensorDescriptor.from_tensor(x, [block_m, block_k])
        wa = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _gate_up_glu_kernel[(triton.cdiv(half, block_n),)](
        xa, wa, out, scale, bias if bias is not None else out, m, half, k, x.stride(0), weight.stride(0),
        out.stride(0), scale.stride(0), scale.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        W_ROWS=bn, W_GROUPED=grouped, HAS_BIAS=bias is not None, GELU=gelu,
        F32_DOT=f32_dot(x.dtype) or interpreting(), TMA=tma, num_warps=4, num_stages=stages,
        **pdl_launch(x.device, m),
    )  # fmt: skip
    return out
