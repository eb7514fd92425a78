"""One fused kernel for every built-in predicate: evaluate, reduce per row, then count or assert.

Counting mode adds the number of failing rows to `counts[slot]` and sets the failing rows' bits in
`bits[slot]` (atomics, no host involvement). Assert mode compiles with debug=True so that
`tl.device_assert` survives, with the invariant's STRICT message baked in as a constexpr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from invariants.predicates import Op, Predicate


def _check_rows(
    a_ptr, b_ptr, rows_ptr, counts_ptr, bits_ptr,
    R, C, sa_r, sa_c, sb_r, sb_c, lo, hi, slot, words_per_slot,
    OP: tl.constexpr, HAS_ROWS: tl.constexpr, ASSERT: tl.constexpr, MSG: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    r64 = r.to(tl.int64)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    if OP == 5:
        L = tl.load(b_ptr + r64 * sb_r, mask=rmask, other=0).to(tl.int32)
        k = (L - 1 + C) % C
    for c0 in range(0, C, BLOCK_C):
        c = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        m = rmask[:, None] & (c < C)[None, :]
        a = tl.load(a_ptr + r64[:, None] * sa_r + c[None, :] * sa_c, mask=m, other=0)
        if OP == 0:
            b = tl.load(b_ptr + r64[:, None] * sb_r + c[None, :] * sb_c, mask=m, other=0)
            ok = a == b
        elif OP == 1:
            ok = (a >= lo) & (a < hi)
        elif OP == 2:
            ok = (a - a) == 0  # NaN - NaN and inf - inf are NaN
        elif OP == 3:
            ok = a != 0
        elif OP == 4:
            ok = (a % lo) == 0
        else:
            # Ring index c holds e = (L-1) - ((L-1-c) mod C), or -1 where e < 0 (C = the window).
            # k = (L-1) mod C is computed once per row, so the per-element work has no division.
            m_c = k[:, None] - c[None, :].to(tl.int32)
            e = (L[:, None] - 1) - tl.where(m_c < 0, m_c + C, m_c)
            ok = a == tl.where(e >= 0, e, -1)
        bad = tl.maximum(bad, tl.max((m & (ok == 0)).to(tl.int32), axis=1))
    if ASSERT:
        tl.device_assert(bad == 0, MSG)
    else:
        n = tl.sum(bad, axis=0).to(tl.int64)
        tl.atomic_add(counts_ptr + slot, n, mask=n > 0)
        if HAS_ROWS:
            hit = rmask & (bad > 0)
            rid = tl.load(rows_ptr + r, mask=hit, other=0).to(tl.int32)
            hit = hit & (rid >= 0) & (rid < words_per_slot * 32)
            word = tl.where(hit, rid // 32, 0)
            bit = tl.full([BLOCK_R], 1, tl.int32) << (rid % 32)
            tl.atomic_or(bits_ptr + slot * words_per_slot + word, bit, mask=hit)


# C stays specialized: knowing C % 16 == 0 lets the masked column loads vectorize.
_NO_SPECIALIZE = ["R", "lo", "hi", "slot"]
_count_kernel = triton.jit(do_not_specialize=_NO_SPECIALIZE)(_check_rows)
_assert_kernel = triton.jit(debug=True, do_not_specialize=_NO_SPECIALIZE)(_check_rows)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """A tile of up to 2048 elements, but at least ~256 programs while rows allow: small batches are
    latency-bound, so spread their rows over SMs rather than loop inside one program."""
    block_c = min(_pow2(max(cols, 1)), 1024)
    by_tile = max(2048 // block_c, 1)
    by_spread = _pow2(max(rows // 256, 1))
    return min(by_tile, by_spread, 64), block_c


# Compiled kernels by everything Triton specializes on, so that a repeat launch skips Triton's
# argument binding and cache-key hashing (most of a check's ~50 us of host time in Triton 3.6).
_compiled: dict[tuple, object] = {}


def _spec(values: tuple[int, ...]) -> tuple[tuple[bool, bool], ...]:
    return tuple((v == 1, v % 16 == 0) for v in values)


def launch(
    pred: Predicate,
    *,
    counts: torch.Tensor,
    bits: torch.Tensor,
    slot: int,
    rows: torch.Tensor | None,
    assert_message: str | None,
) -> None:
    """Enqueue the check on the current stream. `assert_message` set = STRICT-style assert."""
    a, b = pred.as_2d()
    R, C = a.shape
    if R == 0 or C == 0 or (pred.op is Op.FINITE and not a.is_floating_point()):
        return
    bb = a if b is None else b
    rr = a if rows is None else rows
    block_r, block_c = _blocks(R, C)
    kernel = _count_kernel if assert_message is None else _assert_kernel
    msg = assert_message or ""
    sa_r, sa_c, sb_r, sb_c, words = a.stride(0), a.stride(1), bb.stride(0), bb.stride(1), bits.shape[1]
    args = (a, bb, rr, counts, bits, R, C, sa_r, sa_c, sb_r, sb_c, pred.lo, pred.hi, slot, words)
    ptrs = (a.data_ptr(), bb.data_ptr(), rr.data_ptr(), counts.data_ptr(), bits.data_ptr())
    consts = (int(pred.op), rows is not None, assert_message is not None, msg, block_r, block_c)
    grid = (R + block_r - 1) // block_r
    key = (
        kernel is _assert_kernel, a.device.index, a.dtype, bb.dtype, rr.dtype, type(pred.lo), type(pred.hi),
        tuple(p % 16 == 0 for p in ptrs), _spec((C, sa_r, sa_c, sb_r, sb_c, words)), consts,
    )  # fmt: skip
    compiled = _compiled.get(key)
    if compiled is not None:
        # What JITFunction.run does once it has found the compiled kernel, hooks included.
        stream = torch._C._cuda_getCurrentRawStream(a.device.index)
        hooks = triton.knobs.runtime
        meta = compiled.launch_metadata((grid, 1, 1), stream, *args, *consts)
        compiled.run(
            grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta,
            hooks.launch_enter_hook, hooks.launch_exit_hook, *args, *consts,
        )  # fmt: skip
        return
    launched = kernel[(grid,)](
        *args, OP=consts[0], HAS_ROWS=consts[1], ASSERT=consts[2], MSG=msg, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4,
    )  # fmt: skip
    if a.is_cuda:  # Triton's interpreter (CPU tests) has no compiled kernel to keep
        _compiled[key] = launched
