"""Experiment (`PDSERVE_GLUON=1` routes the skinny GEMM's per-channel descriptor-load configs here):
the FP8 decode GEMM in Gluon, a 64-row x tile, the first stages' weight loads issued before the
dependent-launch wait, and (OVERLAP) one tensor-core product in flight while the one before it joins
the fp32 sum."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6 names the TMA load async_copy_global_to_shared; 3.7 and later async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _pdl_wait(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _pdl_release(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _gemm_kernel(
    x_desc,
    w_desc,
    out_ptr,
    as_ptr,
    ws_ptr,
    M,
    N,
    stride_om,
    stride_as,
    stride_ws,
    steps,
    ADD: gl.constexpr,
    PDL: gl.constexpr,
    OVERLAP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    n0 = gl.program_id(0) * BLOCK_N
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
    # The weights of the first stages before the wait: no kernel of the step writes them.
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            mbarrier.expect(ready.index(i), nbytes)
            _tma_load(w_desc, [n0, i * BLOCK_K], ready.index(i), w_smem.index(i))
    _pdl_wait(PDL)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _tma_load(x_desc, [0, i * BLOCK_K], ready.index(i), x_smem.index(i))
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32]
    )
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    prev = warpgroup_mma_init(zero)
    for i in range(steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        part = warpgroup_mma(
            x_smem.index(s), w_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True
        )
        if OVERLAP:
            # Step i - 1's product is complete while step i's runs: it joins the sum now.
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc += done
            prev = part
        else:
            acc += warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        nxt = i + STAGES - 1
        if nxt < steps:
            t = nxt % STAGES
            mbarrier.expect(ready.index(t), nbytes)
            _tma_load(w_desc, [n0, nxt * BLOCK_K], ready.index(t), w_smem.index(t))
            _tma_load(x_desc, [0, nxt * BLOCK_K], ready.index(t), x_smem.index(t))
    if OVERLAP:
        acc += warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    _pdl_release(PDL)
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    m_ok = rm < M
    n_ok = rn < N
    a_scale = gl.load(as_ptr + rm * stride_as, mask=m_ok, other=0.0)
    w_scale = gl.load(ws_ptr + rn * stride_ws, mask=n_ok, other=0.0)
    acc = acc * a_scale[:, None] * w_scale[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ADD:
        acc += gl.load(out, mask=mask, other=0.0).to(gl.float32)
    gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gluon_gemm(
    x, x_scale, w, w_scale, add=None, *, block_n=32, block_k=256, stages=6, overlap=False, pdl=True
):
    m, k = x.shape
    n = w.shape[0]
    block_m = 64
    xl = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    wl = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    xd = TensorDescriptor.from_tensor(x, [block_m, block_k], xl)
    wd = TensorDescriptor.from_tensor(w, [block_n, block_k], wl)
    out = add if add is not None else torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _gemm_kernel[(triton.cdiv(n, block_n),)](
        xd,
        wd,
        out,
        x_scale,
        w_scale,
        m,
        n,
        out.stride(0),
        x_scale.stride(0),
        w_scale.stride(0),
        triton.cdiv(k, block_k),
        ADD=add is not None,
        PDL=pdl,
        OVERLAP=overlap,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        num_warps=4,
        **extra,
    )
    return out
