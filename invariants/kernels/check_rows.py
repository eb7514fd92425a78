"""One fused kernel for every built-in predicate: evaluate, reduce per row, then count or assert.

Counting mode adds the number of failing rows to `counts[slot]` and sets the failing rows' bits in
`bits[slot]` (atomics, no host involvement). Assert mode compiles with debug=True so that
`tl.device_assert` survives, with the invariant's STRICT message baked in as a constexpr.

Wide rows with few of them (logits [8, 128k]) split their columns over a second grid axis. A row
must still count once, so split programs OR their per-row verdicts into a scratch vector and the
last program to finish (a ticket counter) counts the rows, records them and clears the scratch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from invariants.predicates import Op, Predicate


@triton.jit
def _record(rows_ptr, counts_ptr, bits_ptr, r, rbad, slot, words_per_slot, HAS_ROWS: tl.constexpr):
    """Count the failing rows, and set their ids' bits: check row r's id is rows[r] (the caller maps a
    layered check's rows to their index entries first)."""
    n = tl.sum(rbad.to(tl.int32), axis=0).to(tl.int64)
    tl.atomic_add(counts_ptr + slot, n, mask=n > 0)
    if HAS_ROWS:
        rid = tl.load(rows_ptr + r, mask=rbad, other=0).to(tl.int32)
        hit = rbad & (rid >= 0) & (rid < words_per_slot * 32)
        word = tl.where(hit, rid // 32, 0)
        bit = tl.full(r.shape, 1, tl.int32) << (rid % 32)
        tl.atomic_or(bits_ptr + slot * words_per_slot + word, bit, mask=hit)


@triton.jit
def _rows_bad(
    a_ptr, b_ptr, ra, r64, rmask, C, sa_r, sa_c, sb_r, sb_c, lo, hi, c_start, chunk,
    OP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """1 for each row of the block with a failing element among columns [c_start, c_start + chunk).
    EVICT: the checked tensors' eviction policy ("evict_first": the step's own data keeps L2)."""
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    if OP == 5:
        L = tl.load(b_ptr + r64 * sb_r, mask=rmask, other=0).to(tl.int32)
        k = (L - 1 + C) % C
    # `chunk` is a multiple of BLOCK_C, so `c < C` is the only column mask (and stays vectorizable).
    for c0 in range(c_start, c_start + chunk, BLOCK_C):
        c = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        m = rmask[:, None] & (c < C)[None, :]
        a = tl.load(a_ptr + ra[:, None] * sa_r + c[None, :] * sa_c, mask=m, other=0, eviction_policy=EVICT)
        if OP == 0:
            b = tl.load(
                b_ptr + r64[:, None] * sb_r + c[None, :] * sb_c, mask=m, other=0, eviction_policy=EVICT
            )
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
    return bad


def _check_rows(
    a_ptr, b_ptr, index_ptr, rows_ptr, counts_ptr, bits_ptr, scratch_ptr, done_ptr,
    R, C, sa_r, sa_c, sb_r, sb_c, lo, hi, slot, words_per_slot, chunk, index_rows, layer_rows,
    OP: tl.constexpr, HAS_ROWS: tl.constexpr, ASSERT: tl.constexpr, MSG: tl.constexpr,
    SPLIT: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    EVICT: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    r64 = r.to(tl.int64)
    ra = r64  # the row of `a` this check row reads
    rb = r64  # ... of `b`, and of its row ids: a layered check's row l * index_rows + i reads entry i
    if HAS_INDEX:
        rb = r64 % index_rows
        ra = tl.load(index_ptr + rb, mask=rmask, other=0).to(tl.int64) + (r64 // index_rows) * layer_rows
    bad = _rows_bad(
        a_ptr, b_ptr, ra, rb, rmask, C, sa_r, sa_c, sb_r, sb_c, lo, hi, tl.program_id(1) * chunk, chunk,
        OP, BLOCK_R, BLOCK_C, EVICT,
    )  # fmt: skip
    if ASSERT:
        tl.device_assert(bad == 0, MSG)  # asserting needs no per-row dedupe, split or not
    elif SPLIT:
        tl.atomic_or(scratch_ptr + r, bad, mask=rmask & (bad > 0))
        tl.debug_barrier()  # every thread's OR is issued before the ticket releases them
        ticket = tl.atomic_add(done_ptr, 1)
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
            for r0 in range(0, R, 1024):
                rr = r0 + tl.arange(0, 1024)
                flags = tl.atomic_xchg(scratch_ptr + rr, tl.zeros([1024], tl.int32), mask=rr < R)
                rbad = (rr < R) & (flags > 0)
                ids = rr
                if HAS_INDEX:
                    ids = rr % index_rows
                _record(rows_ptr, counts_ptr, bits_ptr, ids, rbad, slot, words_per_slot, HAS_ROWS)
            tl.atomic_xchg(done_ptr, 0)
    else:
        _record(rows_ptr, counts_ptr, bits_ptr, rb, rmask & (bad > 0), slot, words_per_slot, HAS_ROWS)


# C stays specialized: knowing C % 16 == 0 lets the masked column loads vectorize.
_NO_SPECIALIZE = ["R", "lo", "hi", "slot", "index_rows", "layer_rows"]
_count_kernel = triton.jit(do_not_specialize=_NO_SPECIALIZE)(_check_rows)
_assert_kernel = triton.jit(debug=True, do_not_specialize=_NO_SPECIALIZE)(_check_rows)


@triton.jit
def _check_rows_grouped(
    desc_ptr, counts_ptr, bits_ptr, words_per_slot, C, sa_r, sa_c, sb_r, sb_c,
    A_TY: tl.constexpr, B_TY: tl.constexpr, R_TY: tl.constexpr, OP: tl.constexpr, HAS_ROWS: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """Counting mode over many checks of one kind: axis 1 picks a check's row of the table (`_FIELDS`
    int64 each: its tensors' addresses, rows, bounds and slot), axis 0 its row blocks. The checks of
    one launch share their width and strides, passed as arguments: Triton specializes on them (and
    ALIGNED vouches for the addresses), so the loads vectorize as in the one-check kernel. A block
    with no failing row (nearly all) records nothing: it skips the record's reduction, barriers and
    slot load."""
    d = desc_ptr + tl.program_id(1).to(tl.int64) * 7
    R = tl.load(d + 3)
    first = tl.program_id(0) * BLOCK_R
    if first < R:  # checks with fewer rows than the grid's longest leave programs idle
        a_ptr = tl.load(d).to(tl.pointer_type(A_TY))
        b_ptr = tl.load(d + 1).to(tl.pointer_type(B_TY))
        if ALIGNED:
            a_ptr = tl.multiple_of(a_ptr, 16)
            b_ptr = tl.multiple_of(b_ptr, 16)
        rows_ptr = tl.load(d + 2).to(tl.pointer_type(R_TY))
        r = first + tl.arange(0, BLOCK_R)
        rmask = r < R
        r64 = r.to(tl.int64)
        bad = _rows_bad(
            a_ptr, b_ptr, r64, r64, rmask, C, sa_r, sa_c, sb_r, sb_c, tl.load(d + 4), tl.load(d + 5),
            0, tl.cdiv(C, BLOCK_C) * BLOCK_C, OP, BLOCK_R, BLOCK_C, EVICT,
        )  # fmt: skip
        rbad = rmask & (bad > 0)
        if tl.max(rbad.to(tl.int32), axis=0) > 0:
            _record(rows_ptr, counts_ptr, bits_ptr, r, rbad, tl.load(d + 6), words_per_slot, HAS_ROWS)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_PROGRAMS = 1024  # enough to fill 132 SMs several times over


def plan(rows: int, cols: int, scratch_rows: int) -> tuple[int, int, int, int, int]:
    """(block_r, block_c, num_warps, column splits, chunk): one row of up to 4096 elements, or
    short rows up to ~1024 elements, per program (`check_kernel_tune.py --sweep`, read from HBM: one
    1024-element row a program beats two on a 4096x1024 ring); rows spread over programs first (small
    batches are latency-bound), then wide rows split."""
    block_c = min(_pow2(max(cols, 1)), 4096)
    block_r = min(max(1024 // block_c, 1), _pow2(max(rows // 256, 1)), 64)
    row_programs = (rows + block_r - 1) // block_r
    col_blocks = (cols + block_c - 1) // block_c
    splits = 1
    if rows <= scratch_rows and col_blocks > 1:
        splits = min(col_blocks, max(_PROGRAMS // row_programs, 1))
    chunk = ((col_blocks + splits - 1) // splits) * block_c
    splits = (cols + chunk - 1) // chunk
    return block_r, block_c, 8 if block_c >= 4096 else 4, splits, chunk


def grouped_plan(rows: int, cols: int) -> tuple[int, int, int, str]:
    """(block_r, block_c, num_warps, eviction policy) of a grouped launch: twice the one-check tile's
    rows, up to 2048 elements, read evict-first (no column splits: the group's checks already give
    the grid its programs). `check_kernel_tune.py --grouped` picks it: on rings of 4096x1024 a 2x1024
    tile read evict-first comes closest to one amax of the same bytes, recording only the blocks with
    a failing row is a little faster than recording every block, the one-check tile is slower, and
    one launch per check slower still. Loop kernels (persistent, or pipelined by Triton or by hand)
    are slower at every setting."""
    block_r, block_c, warps = plan(rows, cols, 0)[:3]
    if block_r * block_c <= 1024 and rows > block_r:
        block_r *= 2
    return block_r, block_c, warps, "evict_first"


# Compiled kernels by everything Triton specializes on, so that a repeat launch skips Triton's
# argument binding and cache-key hashing (most of a check's host time).
_compiled: dict[tuple, object] = {}


def _spec(values: tuple[int, ...]) -> tuple[tuple[bool, bool], ...]:
    return tuple((v == 1, v % 16 == 0) for v in values)


def launch(
    pred: Predicate,
    *,
    counts: torch.Tensor,
    bits: torch.Tensor,
    scratch: torch.Tensor,
    ticket: torch.Tensor,
    slot: int,
    rows: torch.Tensor | None,
    assert_message: str | None,
    fork: Callable[[], torch.cuda.Stream] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Enqueue the check on the current stream, or on the stream `fork()` returns, called just
    before the launch (after any copy the 2-D views need). `assert_message` set = STRICT-style
    assert. Returns the tensors the kernel reads: a forked caller keeps them alive until it joins
    (invariants/concurrent.py). Nothing to check: nothing launched, no fork, ().

    `scratch` (int32 [max rows], zeroed) and `ticket` (int32 [1], zeroed) serve split launches;
    launches sharing them must be stream-ordered, as one Checker per device and stream is.
    """
    a, b = pred.as_2d()
    R, C = pred.num_rows, a.shape[1]
    if R == 0 or C == 0 or (pred.op is Op.FINITE and not a.is_floating_point()):
        return ()
    bb = a if b is None else b
    rr = a if rows is None else rows
    ii = a if pred.index is None else pred.index
    block_r, block_c, warps, splits, chunk = plan(R, C, scratch.shape[0])
    kernel = _count_kernel if assert_message is None else _assert_kernel
    msg = assert_message or ""
    sa_r, sa_c, sb_r, sb_c, words = a.stride(0), a.stride(1), bb.stride(0), bb.stride(1), bits.shape[1]
    lo, hi = pred.lo, pred.hi
    tensors = (a, bb, ii, rr, counts, bits, scratch, ticket)
    args = (*tensors, R, C, sa_r, sa_c, sb_r, sb_c, lo, hi, slot, words, chunk, pred.id_rows, pred.layer_rows)
    # Every pointer Triton specializes on (16-byte alignment), or the cache could run a kernel
    # compiled for an aligned slot index on a misaligned one.
    ptrs = (a.data_ptr(), bb.data_ptr(), ii.data_ptr(), rr.data_ptr(), counts.data_ptr(), bits.data_ptr())
    split = splits > 1
    has_index = pred.index is not None
    consts = (int(pred.op), rows is not None, assert_message is not None, msg, split, has_index)
    consts += (block_r, block_c, "")  # no eviction hint
    grid = ((R + block_r - 1) // block_r, splits, 1)
    key = (
        kernel is _assert_kernel, a.device.index, a.dtype, bb.dtype, rr.dtype, ii.dtype,
        type(pred.lo), type(pred.hi),
        tuple(p % 16 == 0 for p in ptrs), _spec((C, sa_r, sa_c, sb_r, sb_c, words, chunk)), consts, warps,
    )  # fmt: skip
    stream = fork() if fork is not None else None
    compiled = _compiled.get(key)
    if compiled is not None:
        # What JITFunction.run does once it has found the compiled kernel, hooks included.
        raw = stream.cuda_stream if stream is not None else torch._C._cuda_getCurrentRawStream(a.device.index)
        hooks = triton.knobs.runtime
        meta = compiled.launch_metadata(grid, raw, *args, *consts)
        compiled.run(
            *grid, raw, compiled.function, compiled.packed_metadata, meta,
            hooks.launch_enter_hook, hooks.launch_exit_hook, *args, *consts,
        )  # fmt: skip
        return tensors
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():  # Triton's choice
        launched = kernel[grid](
            *args, OP=consts[0], HAS_ROWS=consts[1], ASSERT=consts[2], MSG=msg, SPLIT=split,
            HAS_INDEX=has_index, BLOCK_R=block_r, BLOCK_C=block_c, EVICT="", num_warps=warps,
        )  # fmt: skip
    if a.is_cuda:  # Triton's interpreter (CPU tests) has no compiled kernel to keep
        _compiled[key] = launched
    return tensors


# One row of the grouped kernel's table: a, b and rows addresses, rows, lo, hi, slot.
_FIELDS = 7
_TL_TYPES = {
    torch.bool: tl.uint8, torch.uint8: tl.uint8, torch.int8: tl.int8, torch.int16: tl.int16,
    torch.int32: tl.int32, torch.int64: tl.int64, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32, torch.float64: tl.float64,
}  # fmt: skip


def groupable(pred: Predicate) -> bool:
    """Whether `launch_grouped` takes this check: no index, integer bounds, a dtype it knows."""
    bounds_ok = pred.op is not Op.IN_RANGE or not isinstance(pred.lo, float)
    return pred.index is None and bounds_ok and pred.a.dtype in _TL_TYPES


Pending = tuple[Predicate, "torch.Tensor | None", int]  # predicate, row ids, slot


def launch_grouped(
    checks: list[Pending],
    *,
    counts: torch.Tensor,
    bits: torch.Tensor,
    fork: Callable[[], torch.cuda.Stream] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Count `checks` (all `groupable`) with one kernel per kind (operation, dtypes, tile). Returns
    (the tensors the kernels read, the host tables their uploads read): a forked caller holds the
    first until it joins; a caller capturing a CUDA graph keeps the second alive as long as the graph,
    whose replays upload them again."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Predicate, int]]] = {}
    for pred, rows, slot in checks:
        a, b = pred.as_2d()
        R, C = pred.num_rows, a.shape[1]
        if R == 0 or C == 0 or (pred.op is Op.FINITE and not a.is_floating_point()):
            continue
        bb = a if b is None else b
        aligned = all(t.data_ptr() % 16 == 0 for t in (a, bb))
        rows_dtype = None if rows is None else rows.dtype
        strides = (a.stride(0), a.stride(1), bb.stride(0), bb.stride(1))
        key = (int(pred.op), a.dtype, bb.dtype, rows_dtype, C, *strides, aligned)
        groups.setdefault(key, []).append((a, bb, rows, pred, slot))
    used: list[torch.Tensor] = []
    tables: list[torch.Tensor] = []
    stream = fork() if fork is not None and groups else None
    for key, members in groups.items():
        op, a_dtype, b_dtype, rows_dtype, C, sa_r, sa_c, sb_r, sb_c, aligned = key
        table = torch.tensor(
            [
                [a.data_ptr(), bb.data_ptr(), 0 if rows is None else rows.data_ptr(), pred.num_rows,
                 int(pred.lo), int(pred.hi), slot]
                for a, bb, rows, pred, slot in members
            ],
            dtype=torch.int64,
        )  # fmt: skip
        device = members[0][0].device
        if device.type == "cuda":
            table = table.pin_memory()
        block_r, block_c, warps, evict = grouped_plan(max(pred.num_rows for _, _, _, pred, _ in members), C)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            desc = table.to(device, non_blocking=True)
            grid = (max(-(-pred.num_rows // block_r) for _, _, _, pred, _ in members), len(members))
            _check_rows_grouped[grid](
                desc, counts, bits, bits.shape[1], C, sa_r, sa_c, sb_r, sb_c,
                A_TY=_TL_TYPES[a_dtype], B_TY=_TL_TYPES[b_dtype], R_TY=_TL_TYPES[rows_dtype or torch.int32],
                OP=op, HAS_ROWS=rows_dtype is not None, ALIGNED=aligned, BLOCK_R=block_r, BLOCK_C=block_c,
                EVICT=evict, num_warps=warps,
            )  # fmt: skip
        used += [desc, *(t for a, bb, rows, _, _ in members for t in (a, bb, rows) if t is not None)]
        tables.append(table)
    return used, tables
