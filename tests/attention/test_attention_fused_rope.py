"""RoPE inside decode attention (`rope=`): the same output (up to float sum order) and the same cache
contents as RoPE first (the torch reference the RoPE kernel is held to), the store, then plain
attention. Ring and paged, with and without Qwen3's per-head norm, fp32 and bf16, split and unsplit;
and only decode shapes."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import NAN_FILL, TOLERANCE, make_batch

from shared.kernels import reference as model_reference
from shared.kernels.attention import ops_for
from shared.kernels.attention.fused_rope import RopeInKernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W, PAGE, D = 8, 4, 16
# Decode rows around the window and the page boundaries (cached length, one new token).
SPECS = [(6, 1), (7, 1), (8, 1), (3, 1), (16, 1), (33, 1)]


def rope_table(positions: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def case(dtype: torch.dtype, norm: bool):
    b = make_batch(SPECS, hq=4, hkv=2, d=D, page_size=PAGE, window=W, dtype=dtype, device=DEVICE, seed=5)
    gen = torch.Generator().manual_seed(6)
    weights = (
        [(1 + 0.5 * torch.randn(D, generator=gen)).to(dtype).to(DEVICE) for _ in "qk"]
        if norm
        else [None, None]
    )
    return b, b.q_start.long(), rope_table(64), weights


def rotated(b, positions, cos_sin, weights):
    return model_reference.rope(b.q, b.k_new, positions, cos_sin, *weights, 1e-6)


def page_rows(b) -> torch.Tensor:
    return torch.tensor(
        [int(b.block_table[i, l0 // PAGE]) * PAGE + l0 % PAGE for i, (l0, _) in enumerate(SPECS)],
        device=DEVICE,
    )


def assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.allclose(got, want, atol=0, rtol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, want, **TOLERANCE[want.dtype], equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_ring_rotates_stores_and_attends_like_rope_first(backend, dtype, norm, num_splits) -> None:
    if backend == "torch" and num_splits is not None:
        pytest.skip("split-K is a Triton launch choice")
    ops = ops_for(DEVICE, backend=backend)
    b, positions, cos_sin, weights = case(dtype, norm)
    ring_dst = (b.slots.long() * W + b.q_start.long() % W).to(DEVICE)
    split = {} if num_splits is None else {"num_splits": num_splits}
    call = ops._ring if backend == "triton" else ops.ring_attention  # the Triton wrapper takes num_splits

    qr, kr = rotated(b, positions, cos_sin, weights)
    k_ring, v_ring = b.k_ring.clone(), b.v_ring.clone()
    want = call(
        qr, kr, b.v_new, k_ring, v_ring, b.slots, b.cu_q, b.q_start, max_q=1, scale=b.scale, window=W, **split
    )
    ops.store_kv(kr, b.v_new, k_ring.view(-1, 2, D), v_ring.view(-1, 2, D), ring_dst)

    k_ring2, v_ring2 = b.k_ring.clone(), b.v_ring.clone()
    rope = RopeInKernel(
        positions, cos_sin, k_ring2.view(-1, 2, D), v_ring2.view(-1, 2, D), ring_dst, *weights, 1e-6
    )
    got = call(b.q, b.k_new, b.v_new, k_ring2, v_ring2, b.slots, b.cu_q, b.q_start, max_q=1, scale=b.scale,
               window=W, rope=rope, **split)  # fmt: skip
    # The chunk's key is read back from its ring entry with the history, not in the plain kernel's
    # block of chunk keys: the same up to float sum order. The rotated keys are exact where each product is
    # rounded to the dtype (bf16 and fp16, `rounding_options`; fp32 on CPU: a GPU may fuse fp32
    # products and sums), the norm's float32 sum aside.
    assert_same(got, want, exact=False)
    assert_same(k_ring2, k_ring, exact=not norm and (dtype != torch.float32 or DEVICE == "cpu"))
    assert torch.equal(v_ring2.nan_to_num(7.0), v_ring.nan_to_num(7.0))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_ring_reads_the_token_back_from_its_entry_wherever_the_ring_wraps(num_splits) -> None:
    """A window of four key tiles, split four ways or not, and rings wrapped at every point: the
    token's entry (L0 % W) sits at the start, the middle or the end of the ring's storage, or past the
    filled entries of a ring not yet full. The ring is read oldest first, so the token is the last key
    of the last split, which stores it before it reads it; no program sees the entry's old position.
    A padding row (negative store index) stores nothing."""
    window = 64
    specs = [(70, 1), (100, 1), (127, 1), (40, 1), (63, 1), (5, 1), (64, 1)]
    ops = ops_for(DEVICE, backend="triton")
    b = make_batch(
        specs, hq=4, hkv=2, d=D, page_size=PAGE, window=window, dtype=torch.bfloat16, device=DEVICE, seed=9
    )
    positions, cos_sin = b.q_start.long(), rope_table(160)
    ring_dst = (b.slots.long() * window + b.q_start.long() % window).to(DEVICE)
    qr, kr = model_reference.rope(b.q, b.k_new, positions, cos_sin, None, None, 1e-6)
    k_ring, v_ring = b.k_ring.clone(), b.v_ring.clone()
    want = ops._ring(qr, kr, b.v_new, k_ring, v_ring, b.slots, b.cu_q, b.q_start, max_q=1, scale=b.scale,
                     window=window, num_splits=num_splits)  # fmt: skip
    ops.store_kv(kr, b.v_new, k_ring.view(-1, 2, D), v_ring.view(-1, 2, D), ring_dst)

    padded = ring_dst.clone()
    padded[-1] = -1  # the last row is a graph's padding row
    k_ring2, v_ring2 = b.k_ring.clone(), b.v_ring.clone()
    rope = RopeInKernel(positions, cos_sin, k_ring2.view(-1, 2, D), v_ring2.view(-1, 2, D), padded)
    got = ops._ring(b.q, b.k_new, b.v_new, k_ring2, v_ring2, b.slots, b.cu_q, b.q_start, max_q=1,
                    scale=b.scale, window=window, rope=rope, num_splits=num_splits)  # fmt: skip
    assert_same(got[:-1], want[:-1], exact=False)
    assert torch.isfinite(got[-1]).all()
    last = int(b.slots[-1]) * window + specs[-1][0] % window
    k_ring.view(-1, 2, D)[last] = b.k_ring.view(-1, 2, D)[last]  # the padding row's entry: untouched
    v_ring.view(-1, 2, D)[last] = b.v_ring.view(-1, 2, D)[last]
    assert torch.equal(k_ring2.nan_to_num(7.0), k_ring.nan_to_num(7.0))
    assert torch.equal(v_ring2.nan_to_num(7.0), v_ring.nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_rotates_stores_and_attends_like_rope_first(backend, dtype, norm, num_splits) -> None:
    if backend == "torch" and num_splits is not None:
        pytest.skip("split-K is a Triton launch choice")
    ops = ops_for(DEVICE, backend=backend)
    b, positions, cos_sin, weights = case(dtype, norm)
    dst = page_rows(b)
    split = {} if num_splits is None else {"num_splits": num_splits}
    call = ops._paged if backend == "triton" else ops.paged_attention

    qr, kr = rotated(b, positions, cos_sin, weights)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    ops.store_kv(kr, b.v_new, k_cache.view(-1, 2, D), v_cache.view(-1, 2, D), dst)
    want = call(
        qr, k_cache, v_cache, b.block_table, b.cu_q, b.q_start, max_q=1, scale=b.scale, window=None, **split
    )

    # The chunk's rows hold NaN until the kernel stores them: attending to them before would show.
    k2, v2 = b.k_cache.clone(), b.v_cache.clone()
    k2.view(-1, 2, D)[dst] = NAN_FILL
    v2.view(-1, 2, D)[dst] = NAN_FILL
    rope = RopeInKernel(positions, cos_sin, k2.view(-1, 2, D), v2.view(-1, 2, D), dst, *weights, 1e-6)
    got = call(b.q, k2, v2, b.block_table, b.cu_q, b.q_start, max_q=1, scale=b.scale, window=None,
               k_new=b.k_new, v_new=b.v_new, rope=rope, **split)  # fmt: skip
    # The chunk's key joins the online softmax in a block of its own here (not in its page's block):
    # the same result up to the order of the float sums.
    assert_same(got, want, exact=False)
    assert_same(k2, k_cache, exact=not norm and (dtype != torch.float32 or DEVICE == "cpu"))
    assert torch.equal(v2.nan_to_num(7.0), v_cache.nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["ring", "paged"])
def test_an_input_row_scale_is_applied_to_q_k_and_v_first(backend, dtype, op) -> None:
    """`rms_x` (a layer whose input norm is folded into q/k/v's weight): the result and the stored
    K/V of q, k and v scaled by rsqrt(mean(x^2) + eps) of their token's row of x beforehand."""
    ops = ops_for(DEVICE, backend=backend)
    b, positions, cos_sin, weights = case(dtype, norm=True)
    gen = torch.Generator().manual_seed(8)
    x = (30 * torch.randn(b.q.shape[0], 24, generator=gen)).to(dtype).to(DEVICE)
    scaled = [model_reference.rms_scale(t.flatten(1), x, 1e-5).view_as(t) for t in (b.q, b.k_new, b.v_new)]
    runs = []
    for q, k, v, rms in ((b.q, b.k_new, b.v_new, x), (*scaled, None)):
        if op == "ring":
            dst = (b.slots.long() * W + b.q_start.long() % W).to(DEVICE)
            kc, vc = b.k_ring.clone(), b.v_ring.clone()
        else:
            dst = page_rows(b)
            kc, vc = b.k_cache.clone(), b.v_cache.clone()
        rope = RopeInKernel(
            positions, cos_sin, kc.view(-1, 2, D), vc.view(-1, 2, D), dst, *weights, 1e-6, rms, 1e-5
        )
        if op == "ring":
            out = ops.ring_attention(q, k, v, kc, vc, b.slots, b.cu_q, b.q_start, max_q=1, scale=b.scale,
                                     window=W, rope=rope)  # fmt: skip
        else:
            out = ops.paged_attention(q, kc, vc, b.block_table, b.cu_q, b.q_start, max_q=1, scale=b.scale,
                                      window=None, k_new=k, v_new=v, rope=rope)  # fmt: skip
        runs.append((out, kc, vc))
    for got, want in zip(*runs, strict=True):
        assert_same(got, want, exact=False)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rope_inside_attention_refuses_prefill_shapes_and_bad_arguments(backend) -> None:
    ops = ops_for(DEVICE, backend=backend)
    b, positions, cos_sin, _ = case(torch.float32, False)
    dst = page_rows(b)
    flat = b.k_cache.view(-1, 2, D), b.v_cache.view(-1, 2, D)
    args = (b.q, *b.paged_args()[1:])
    rope = RopeInKernel(positions, cos_sin, *flat, dst)
    with pytest.raises(ValueError, match=r"decode-shaped calls only \(max_q == 1\), got max_q=2"):
        ops.paged_attention(
            *args, max_q=2, scale=b.scale, window=None, k_new=b.k_new, v_new=b.v_new, rope=rope
        )
    with pytest.raises(ValueError, match="needs the chunk's k_new and v_new"):
        ops.paged_attention(*args, max_q=1, scale=b.scale, window=None, rope=rope)
    bad = RopeInKernel(positions[:2], cos_sin, *flat, dst)
    with pytest.raises(ValueError, match=r"rope.positions has 2 entries, expected T = 6"):
        ops.paged_attention(
            *args, max_q=1, scale=b.scale, window=None, k_new=b.k_new, v_new=b.v_new, rope=bad
        )
    half = RopeInKernel(positions, cos_sin, *flat, dst, q_weight=torch.ones(D, device=DEVICE))
    with pytest.raises(ValueError, match=r"pass both rope\.q_weight and rope\.k_weight"):
        ops.paged_attention(
            *args, max_q=1, scale=b.scale, window=None, k_new=b.k_new, v_new=b.v_new, rope=half
        )
    for rms_x, eps, message in [
        (torch.ones(5, 24, device=DEVICE), 1e-5, r"rope.rms_x must be \[T = 6, H\]"),
        (
            torch.ones(6, 24, device=DEVICE, dtype=torch.float16),
            1e-5,
            r"rope.rms_x must be .* in torch.float32",
        ),
        (torch.ones(6, 24, device=DEVICE), -1.0, "rope.rms_eps must be a non-negative float"),
    ]:
        scaled = RopeInKernel(positions, cos_sin, *flat, dst, rms_x=rms_x, rms_eps=eps)
        with pytest.raises(ValueError, match=message):
            ops.paged_attention(
                *args, max_q=1, scale=b.scale, window=None, k_new=b.k_new, v_new=b.v_new, rope=scaled
            )
