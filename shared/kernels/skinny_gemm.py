"""A decode-shaped GEMM, out[M, N] = x[M, K] @ w[N, K]^T for a few rows (M <= 64), meant to read the
weights at the copy rate.

At M=64 cuBLAS reads a decode step's weights well below the copy rate: a narrow output (2048
columns) makes too few of its tiles to fill 132 SMs, so it splits K and adds a reduction kernel. Here
a program owns BLOCK_N output columns for every row and streams those weight rows through its
pipeline. When N / BLOCK_N programs cannot fill the GPU, K is split too, and the last program of a
column block to finish (a ticket) adds the fp32 partials and writes the result: one kernel, no zeroing
pass.

Where the model takes it (`ModelKernels.linear`, `Transformer.gemm_backend`): by default ("auto")
for batches of at most 16 rows, where it is faster than cuBLAS on the gate/up and down projections
(`bench/gemm_decode.py`) and so shortens a decode step at batch 1 and 16 (`bench/engine.py --gemm
cublas,skinny`); at 64 rows it does not beat cuBLAS in bf16. With FP8 operands (`scales=`) it takes
every decode batch of an FP8 model (`shared/kernels/fp8/ops.py`): it beats cuBLAS's scaled GEMM plus
the add kernel after it (`bench/gemm_fp8.py`). A SwiGLU prologue (the activation computed as
the tiles load) is much slower than the SwiGLU kernel plus cuBLAS: every column block would recompute
the whole input's activation.

With `add=` the result is added to a tensor and written into it (a residual add inside the GEMM,
`ModelKernels.linear_add`): the addend is loaded before the K loop, so its latency is not at the tail.

On Hopper and later, FP8 operands load through the Tensor Memory Accelerator (`GemmConfig.tma`: tensor
descriptors, one bulk copy a tile, out-of-bounds rows and columns zero-filled): the copies take no
registers or address arithmetic from the warps, so a deeper pipeline keeps more weight bytes in flight
(`bench/gemm_fp8.py`). 16-bit operands keep the pointer loads, which their configs were tuned with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shared.kernels._launch import f32_dot, interpreting, next_pow2
from shared.kernels._norm_checks import check_triton_device, fail
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels._round import round_to
from shared.kernels._tickets import tickets

__all__ = ["GemmConfig", "Scales", "choose_config", "skinny_gemm", "tma_capable"]


# M (the batch's rows) changes every step: only masks and the activation scales' stride read it, and
# specializing on it would compile mid-traffic. BLOCK_M takes three values (16, 32, 64), which the
# engine's warm-up launches.
@triton.jit(do_not_specialize=["M", "stride_asg"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_chunk,
    as_ptr, ws_ptr, bias_ptr, stride_asm, stride_asg, stride_wsn, stride_wsg,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, ADD: tl.constexpr, SCALED: tl.constexpr, A_GROUPED: tl.constexpr,
    W_GROUPED: tl.constexpr, W_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    # FP8 operands' scales (SCALED): a row's (x) and a column's (w), either one per K step (GROUPED:
    # the step is one scale group, and its partial product is scaled before it joins the sum) or one
    # for all of K (the sum is scaled once, at the end). With descriptor loads the weights' scales and
    # the bias are read before the wait (no kernel of the step writes them) and x's before the loop, so
    # that no load's latency sits between the loop's end and the store; pointer loads (few rows) read
    # them after the loop, which measured faster there (docs/performance.md, "FP8").
    as_rows = as_ptr + rm * stride_asm
    ws_cols = ws_ptr + (rn // W_ROWS) * stride_wsn
    if TMA:
        w_scale, a_scale, bias = _scales_and_bias(as_rows, ws_cols, bias_ptr + rn, m_ok, n_ok, SCALED,
                                                  A_GROUPED, W_GROUPED, HAS_BIAS, PDL)  # fmt: skip
    else:
        wait_for_inputs(PDL)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    # out holds the addend. Pointer loads take it first, its latency under the loop's rather than at
    # the tail; descriptor loads at the end, where its registers do not stand between the pipeline's.
    if ADD and not TMA:
        addend = tl.load(out, mask=out_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = pid_k * k_chunk
    for k0 in range(k_first, k_first + k_chunk, BLOCK_K):  # k_chunk is a multiple of BLOCK_K
        if TMA:  # x_ptr and w_ptr are tensor descriptors; what lies past M, N or K reads as zeros
            x = x_ptr.load([0, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x_at = x_ptr + rm[:, None] * stride_xm + rk[None, :]
            x = tl.load(x_at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # Each step's product starts from zero and joins the sum in fp32 outside the tensor cores:
        # Hopper's FP8 MMA accumulates in fewer bits than fp32, and summing a whole K inside it (the
        # accumulator passed to the dot) changes greedy tokens (tests/model/test_fp8_gpu.py).
        if F32_DOT:  # fp32 operands, or bf16 in the interpreter (whose dot cannot take bf16)
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))
        # A split's steps past K (zeros) take the last group's scales: no scale past the last is read,
        # where another tensor's NaN or Inf would turn the zeros into NaN.
        group = tl.minimum(k0 // BLOCK_K, (K - 1) // BLOCK_K)
        if A_GROUPED:
            part = part * tl.load(as_rows + group * stride_asg, mask=m_ok, other=0.0)[:, None]
        if W_GROUPED:
            part = part * tl.load(ws_cols + group * stride_wsg, mask=n_ok, other=0.0)[None, :]
        acc += part
    release_next(PDL)  # the next kernel fills this one's tail
    if not TMA:
        w_scale, a_scale, bias = _scales_and_bias(as_rows, ws_cols, bias_ptr + rn, m_ok, n_ok, SCALED,
                                                  A_GROUPED, W_GROUPED, HAS_BIAS, False)  # fmt: skip
    if ADD and TMA:
        addend = tl.load(out, mask=out_mask, other=0.0).to(tl.float32)
    if SCALED:  # a split's partial scaled on its own: the scaling is linear
        if not A_GROUPED:
            acc = acc * a_scale[:, None]
        if not W_GROUPED:
            acc = acc * w_scale[None, :]
    dtype = out_ptr.dtype.element_ty
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias[None, :]
        if ADD:
            acc += addend
        tl.store(out, round_to(acc, dtype).to(dtype), mask=out_mask)
    else:
        tile = rm[:, None] * N + rn[None, :]  # partials: [SPLIT_K, BLOCK_M, N] fp32
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1)
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever program came last: deterministic
                total += tl.load(
                    part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += bias[None, :]
            if ADD:
                total += addend
            tl.store(out, round_to(total, dtype).to(dtype), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def _scales_and_bias(
    as_rows, ws_cols, bias_at, m_ok, n_ok, SCALED: tl.constexpr, A_GROUPED: tl.constexpr,
    W_GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The scales that apply once to the whole sum (x's per row, w's per column; 1.0 where grouped
    or unscaled) and the bias (0.0 without), the weights' read before `wait_for_inputs(PDL)`."""
    w_scale = tl.full(n_ok.shape, 1.0, tl.float32)
    a_scale = tl.full(m_ok.shape, 1.0, tl.float32)
    bias = tl.zeros(n_ok.shape, tl.float32)
    if SCALED and not W_GROUPED:
        w_scale = tl.load(ws_cols, mask=n_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_at, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    if SCALED and not A_GROUPED:
        a_scale = tl.load(as_rows, mask=m_ok, other=0.0)
    return w_scale, a_scale, bias


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # operand tiles by tensor descriptor (`tma_capable`), else by pointer loads


# Operand tiles in flight, all stages: under an H200's 227 KiB of shared memory per block with room for
# Triton's own scratch. fp32 operands with the bf16 tiles exceed it.
_SMEM_BUDGET = 192 << 10


def choose_config(
    m: int, n: int, k: int, *, itemsize: int = 2, group: int | None = None, tma: bool = False, sms: int = 132
) -> GemmConfig:  # fmt: skip
    """The sweep's best at a decode step's shapes (`bench/gemm_decode.py` on an H200, M = 64; the quick
    sweep at 16 and 1 rows, 32-column blocks only, agreed but for o): outputs too narrow for 32-column
    blocks to fill the SMs take 16-column blocks, or split K four ways when K is deep (the down
    projection); wide outputs stream 128-deep K tiles (1-byte operands: twice as deep, the same
    bytes). FP8 operands scaled per K group take that group as their K tile. The K tile, then the
    pipeline, shrink until the stages' operand tiles fit in shared memory. With `tma`, batches of
    more than 32 rows take the tiles for descriptor loads on `sms` SMs (`_tma_config`)."""
    narrow = triton.cdiv(n, 32) < 96
    split = 4 if narrow and k >= 4096 else 1
    block_n = 16 if narrow and split == 1 else 32
    # Tiles of 16 or 32 rows stream faster by pointer loads (the 8B's decode step at batch 24 and 32,
    # docs/performance.md); so do the widest outputs scaled per K group.
    if tma and max(16, next_pow2(m)) > 32 and not (group is not None and not narrow and n > 8192):
        return _tma_config(m, n, k, itemsize, group, sms, narrow=narrow, split=split, block_n=block_n)
    block_k, stages = (256 if split == 1 and n <= 4096 else 128) * max(1, 2 // itemsize), 4
    if itemsize == 1 and n > 8192:
        # FP8 gate/up (the best of `bench/gemm_fp8.py --model 8b`'s sweep): wider column blocks re-read
        # the activations fewer times, over a shorter K tile and pipeline.
        block_n, block_k, stages = 64, 128, 3
    if group is not None:
        block_k = group
    a_rows = max(16, next_pow2(m))
    while stages * block_k * itemsize * (a_rows + block_n) > _SMEM_BUDGET and stages > 2:
        if block_k > 64 and group is None:
            block_k //= 2
        else:
            stages -= 1
    return GemmConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=stages)


def _tma_config(
    m: int, n: int, k: int, itemsize: int, group: int | None, sms: int, *, narrow: bool, split: int,
    block_n: int,
) -> GemmConfig:  # fmt: skip
    """Descriptor loads (the 8B's decode GEMMs on an H200 at M = 64, docs/performance.md): 256-byte K
    tiles, and as deep a pipeline as leaves every program a place in the first wave: six stages where
    the programs are no more than the SMs, four where two share one (twice as many for tiles half as
    deep, a scale group's). The widest outputs (gate/up, scaled per channel) take 128-column blocks on
    8 warps over 128-deep tiles, four deep."""
    if not narrow and n > 8192:
        return GemmConfig(128, 128, split_k=split, num_warps=8, num_stages=4, tma=True)
    block_k = group or 256 // itemsize
    stages = 6 if triton.cdiv(n, block_n) * split <= sms else 4
    if block_k * itemsize < 256:
        stages = min(8, stages * 256 // (block_k * itemsize))
    a_rows = max(16, next_pow2(m))
    while stages * block_k * itemsize * (a_rows + block_n) > _SMEM_BUDGET and stages > 2:
        stages -= 1
    return GemmConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=stages, tma=True)


@dataclass(frozen=True)
class Scales:
    """FP8 operands' float32 dequantizing scales (value = e4m3 * scale), as `shared/kernels/fp8`
    holds them: x's [M, ceil(K / x_group)] (any strides) and w's [ceil(N / w_block[0]),
    ceil(K / w_block[1])]; the output's dtype and an optional bias [N] in it. A scale per K group
    needs the K tile to be that group (`choose_config(..., group=)`)."""

    x: torch.Tensor
    x_group: int
    w: torch.Tensor
    w_block: tuple[int, int]
    out_dtype: torch.dtype
    bias: torch.Tensor | None = None


def skinny_gemm(
    x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig | None = None, *, add: torch.Tensor | None = None,
    scales: Scales | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, fp32 accumulation; M <= 64. With `add` ([M, N],
    x's dtype, rows contiguous): add + x @ w^T, rounded once, written into `add` and returned. With
    `scales`, x and w are e4m3 and the product is dequantized (+ the bias) in `scales.out_dtype`."""
    op = "skinny_gemm"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        fail(op, f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.device != w.device:
        fail(op, f"x and w must share dtype and device, got {x.dtype}/{x.device} and {w.dtype}/{w.device}")
    m, (n, k) = x.shape[0], w.shape
    if m > 64:
        fail(op, f"is for at most 64 rows, got {m}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        fail(op, "x and w must be contiguous along K")
    check_triton_device(op, x.device)
    dtype = x.dtype if scales is None else scales.out_dtype
    a_grouped, w_grouped = _grouping(op, m, n, k, x, scales)
    group = scales.x_group if a_grouped else scales.w_block[1] if w_grouped else None  # type: ignore[union-attr]
    if cfg is None:
        tma = scales is not None and _tma_default(x.device) and tma_capable(x, w)
        sms = _sms(x.device) if x.device.type == "cuda" else 132
        cfg = choose_config(m, n, k, itemsize=x.element_size(), group=group, tma=tma, sms=sms)
    if group is not None and cfg.block_k != group:
        fail(op, f"scales per {group}-column group need block_k = {group}, got {cfg.block_k}")
    if cfg.tma and not tma_capable(x, w):
        strides = f"row strides {x.stride(0)} and {w.stride(0)}"
        fail(op, f"tma needs 1- or 2-byte operands on 16-byte aligned rows, got {x.dtype}, {strides}")
    if cfg.tma and not (cfg.block_k * x.element_size() >= 16 and cfg.block_k <= 256 and cfg.block_n <= 256):
        fail(op, f"tma tiles must span 16 bytes to 256 columns of K and at most 256 of N, got {cfg}")
    if add is not None:
        if add.shape != (m, n) or add.dtype != dtype or add.device != x.device or add.stride(1) != 1:
            fail(op, f"add must be [{m}, {n}] {dtype} on {x.device}, rows contiguous, got "
                     f"{tuple(add.shape)} {add.dtype} on {add.device}")  # fmt: skip
        out = add
    else:
        out = torch.empty((m, n), dtype=dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bias = None if scales is None else scales.bias
    if k == 0:  # an empty sum
        out = out if add is not None else out.zero_()
        return out if bias is None else out.add_(bias)
    block_m = max(16, next_pow2(m))  # the smallest tile a tensor-core dot takes
    blocks = triton.cdiv(n, cfg.block_n)
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_chunk)  # no empty split: each adds its partial and takes its ticket
    part = torch.empty((split, block_m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    ticket = tickets(x.device, blocks, 4096)
    sx, sw = (out, out) if scales is None else (scales.x, scales.w)
    xa, wa = (x, w)
    if cfg.tma:
        xa = TensorDescriptor.from_tensor(x, [block_m, cfg.block_k])
        wa = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    _skinny_gemm_kernel[(blocks, split)](
        xa, wa, out, part, ticket, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_chunk,
        sx, sw, bias if bias is not None else out, sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1),
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        F32_DOT=f32_dot(x.dtype) or (scales is not None and interpreting()), ADD=add is not None,
        SCALED=scales is not None, A_GROUPED=a_grouped, W_GROUPED=w_grouped,
        W_ROWS=1 if scales is None else scales.w_block[0], HAS_BIAS=bias is not None, TMA=cfg.tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device, m, scales is not None),
    )  # fmt: skip
    return out


def tma_capable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [M, K] and w [N, K] can be read through tensor descriptors: 1- or 2-byte elements,
    16-byte aligned starts and row strides (the Tensor Memory Accelerator's rule)."""
    size = x.element_size()
    return (
        size in (1, 2)
        and all(t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0 for t in (x, w))
        and x.shape[1] * size >= 16
    )


@functools.cache
def _tma_default(device: torch.device) -> bool:
    """Descriptor loads by default: a GPU with a Tensor Memory Accelerator (Hopper, compute capability
    9.0, and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and not interpreting()


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grouping(op: str, m: int, n: int, k: int, x: torch.Tensor, scales: Scales | None) -> tuple[bool, bool]:
    """Whether x's and w's scales are per K group; shapes and dtypes checked (never values)."""
    if scales is None:
        return False, False
    if x.dtype != torch.float8_e4m3fn:
        fail(op, f"scaled operands must be float8_e4m3fn, got {x.dtype}")
    (bn, bk), g = scales.w_block, scales.x_group
    if bn < 1 or bk < 1 or g < 1:
        fail(op, f"scale groups must be positive, got x_group {g} and w_block {scales.w_block}")
    wants = {
        "scales.x": (scales.x, (m, triton.cdiv(k, g))),
        "scales.w": (scales.w, (triton.cdiv(n, bn), triton.cdiv(k, bk))),
    }
    for name, (t, want) in wants.items():
        if tuple(t.shape) != want or t.dtype != torch.float32 or t.device != x.device:
            got = f"{t.dtype} {list(t.shape)} on {t.device}"
            fail(op, f"{name} must be float32 {list(want)} on {x.device}, got {got}")
    a_grouped, w_grouped = g < k, bk < k
    if a_grouped and w_grouped and g != bk:
        fail(op, f"x's groups ({g} columns) and w's blocks ({bk} columns) must match")
    b = scales.bias
    if b is not None and (tuple(b.shape) != (n,) or b.dtype != scales.out_dtype or b.stride(0) != 1):
        fail(op, f"scales.bias must be a contiguous [{n}] tensor of {scales.out_dtype}")
    return a_grouped, w_grouped
