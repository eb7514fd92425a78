"""FP8 KV caches (`quant=`): the quantizer saturates and rounds to nearest-even, every Triton store
(store_kv, RoPE's store, RoPE inside decode attention) writes the torch reference's bytes, and paged
and ring attention over FP8 pages and rings compute what the naive attention computes over the
dequantized history: interpreted on CPU, compiled on CUDA (`gpu`: serving-sized shapes too)."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import TOLERANCE, Batch, assert_close, make_batch, naive
from cases import SPECS

from shared.kernels import KVStore, TorchKernels
from shared.kernels.attention import ops_for
from shared.kernels.attention.fused_rope import RopeInKernel
from shared.kernels.kv_quant import FP8_KV_DTYPE, FP8_MAX, KVQuant, dequantize, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = {"scale-1": KVQuant(), "calibrated": KVQuant(0.03, 4.0)}
BACKENDS = ["torch", "triton"]


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, NaN's sign aside (the GPU's cast and torch's may differ on it)."""
    nan = a.float().isnan()
    return torch.equal(nan, b.float().isnan()) and torch.equal(
        a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan]
    )


def awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over many octaves (e4m3's subnormals to past its range), with ties, saturation, inf, NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    flat = x.view(-1)
    special = [8.5, 9.5, -(2.0**-10), 1.5 * 2.0**-10, 2.0**-9, 447.0, 460.0, -1e6, float("inf"), float("nan")]
    flat[: len(special)] = torch.tensor(special)
    return x.to(dtype).to(DEVICE)


def test_quantize_saturates_rounds_to_nearest_even_and_keeps_nan() -> None:
    x = torch.tensor([0.0, 1.0, 7.9, 8.5, 9.5, 447.9, 448.0, 449.0, 1e6, float("inf"), -float("inf"),
                      2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-12, -3.3, float("nan")])  # fmt: skip
    want = [0.0, 1.0, 8.0, 8.0, 10.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0,
            2.0**-9, 0.0, 2.0**-9, 0.0, -3.25]  # fmt: skip
    q = quantize(x, 1.0)
    assert q.dtype == FP8_KV_DTYPE and FP8_MAX == 448.0
    assert q.float()[:-1].tolist() == want and q.float()[-1].isnan()
    # A scale maps the range: 1000 / 4 = 250 -> 256 (steps of 16 there), read back as 1024.
    assert dequantize(quantize(torch.tensor([1000.0]), KVQuant(4.0).inv_k), 4.0).item() == 1024.0


def test_scales_are_float32_and_positive() -> None:
    q = KVQuant(0.1, 2)
    assert q.k_scale == torch.tensor(0.1).item() and q.v_scale == 2.0 and q.inv_v == 0.5
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e-300, 1e300, True):
        with pytest.raises(ValueError, match="positive float32"):
            KVQuant(k_scale=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", list(QUANTS))
def test_store_kv_quantizes_like_the_reference(backend: str, dtype: torch.dtype, quant: str) -> None:
    q = QUANTS[quant]
    k_new, v_new = awkward((6, 2, 16), dtype, 1), awkward((6, 2, 16), dtype, 2)
    index = torch.tensor([7, -1, 0, 19, -1, 12], device=DEVICE)
    k_dst = torch.full((20, 2, 16), 3.0, device=DEVICE).to(FP8_KV_DTYPE)
    v_dst = k_dst.clone()
    ops_for(DEVICE, backend=backend).store_kv(k_new, v_new, k_dst, v_dst, index, q)
    want_k = torch.full((20, 2, 16), 3.0).to(FP8_KV_DTYPE)
    want_v = want_k.clone()
    for t, dst in enumerate(index.tolist()):
        if dst >= 0:
            want_k[dst], want_v[dst] = quantize(k_new[t].cpu(), q.inv_k), quantize(v_new[t].cpu(), q.inv_v)
    assert same_fp8(k_dst.cpu(), want_k) and same_fp8(v_dst.cpu(), want_v)


def test_an_fp8_cache_needs_its_scales_and_scales_an_fp8_cache() -> None:
    ops = ops_for(DEVICE, backend="torch")
    k = torch.randn(2, 1, 4, device=DEVICE)
    fp8 = torch.zeros(4, 1, 4, device=DEVICE).to(FP8_KV_DTYPE)
    index = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="needs quant="):
        ops.store_kv(k, k, fp8, fp8.clone(), index)
    with pytest.raises(ValueError, match=r"needs a torch\.float8_e4m3fn cache"):
        ops.store_kv(k, k, k.new_zeros(4, 1, 4), k.new_zeros(4, 1, 4), index, KVQuant())
    b = make_batch([(3, 1)], device=DEVICE)
    k8, v8 = (quantize(c, 1.0) for c in (b.k_cache, b.v_cache))
    with pytest.raises(ValueError, match="an FP8 cache needs quant="):
        ops.paged_attention(
            b.q, k8, v8, b.block_table, b.cu_q, b.q_start, max_q=1, scale=b.scale, window=None
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", list(QUANTS))
def test_ropes_store_quantizes_like_the_reference(dtype: torch.dtype, quant: str) -> None:
    from shared.kernels import rope as rope_kernel

    q_scales = QUANTS[quant]
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 4, 2, 16
    q, k, v = (torch.randn(t, h, d, generator=gen).mul(8).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 3, 9, 17, 2], device=DEVICE)
    freqs = torch.arange(32, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    index = torch.tensor([4, 0, -1, 9, 2], device=DEVICE)
    caches = []
    for store in (rope_kernel.rope, TorchKernels().rope_store):
        kd, vd = (torch.zeros(12, hkv, d, device=DEVICE).to(FP8_KV_DTYPE) for _ in "kv")
        target = KVStore(kd, vd, index, q_scales)
        if store is rope_kernel.rope:
            store(q, k, positions, cos_sin, store=target, v=v)
        else:
            store(q, k, v, positions, cos_sin, target)
        caches.append((kd.cpu(), vd.cpu()))
    (kt, vt), (kr, vr) = caches
    assert same_fp8(vt, vr)
    if dtype != torch.float32 or DEVICE == "cpu":  # a GPU may fuse fp32 products and sums
        assert same_fp8(kt, kr)
    else:
        torch.testing.assert_close(kt.float(), kr.float(), rtol=0.07, atol=0)


def fp8_batch(
    specs: list[tuple[int, int]], quant: KVQuant, **kw
) -> tuple[Batch, list[torch.Tensor], list[torch.Tensor]]:
    """make_batch with its pages and rings stored in FP8 (NaN fill stays NaN: reading outside a
    sequence shows), and the history as attention must see it: quantized and back, in float32."""
    b = make_batch(specs, device=DEVICE, **kw)
    b.k_cache, b.v_cache = quantize(b.k_cache, quant.inv_k), quantize(b.v_cache, quant.inv_v)
    if b.k_ring is not None and b.v_ring is not None:
        b.k_ring, b.v_ring = quantize(b.k_ring, quant.inv_k), quantize(b.v_ring, quant.inv_v)
    hist_k = [dequantize(quantize(h, quant.inv_k), quant.k_scale) for h in b.hist_k]
    hist_v = [dequantize(quantize(h, quant.inv_v), quant.v_scale) for h in b.hist_v]
    return b, hist_k, hist_v


CASES = ["prefill-from-0", "prefill-mid", "decode-around-W", "mixed"]


# float16 too: interpreted, bfloat16 takes attend_block's exact-fp32 products (F32_DOT) and float16
# the tensor-core path, both over the float16 tiles an FP8 cache is read as.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_over_fp8_pages(backend, dtype, quant, window, case) -> None:
    q = QUANTS[quant]
    b, hist_k, hist_v = fp8_batch(SPECS[case], q, hq=4, hkv=2, d=16, page_size=4, window=window, dtype=dtype)
    out = ops_for(DEVICE, backend=backend).paged_attention(
        *b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, quant=q
    )
    assert_close(out, naive(b.q, hist_k, hist_v, b.specs, window=window, scale=b.scale))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("window", [1, 5, 8])
@pytest.mark.parametrize("case", CASES)
def test_ring_attention_over_fp8_rings(backend, dtype, quant, window, case) -> None:
    """The chunk's own keys come from k_new/v_new, and are attended as the ring will hold them."""
    q = QUANTS[quant]
    b, hist_k, hist_v = fp8_batch(SPECS[case], q, hq=6, hkv=2, d=24, page_size=4, window=window, dtype=dtype)
    out = ops_for(DEVICE, backend=backend).ring_attention(
        *b.ring_args(), max_q=b.max_q, scale=b.scale, window=window, quant=q
    )
    assert_close(out, naive(b.q, hist_k, hist_v, b.specs, window=window, scale=b.scale))


@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_fp8_attention_takes_bf16_queries_past_float16s_range(kind: str) -> None:
    """An FP8 cache's dots run in float16 with the softmax scale folded into q first, so a bf16 query
    past float16's 65504 (|q| up to ~1.3e5, head_dim 128) stays finite and matches the reference."""
    q = QUANTS["scale-1"]
    b, hist_k, hist_v = fp8_batch(SPECS["mixed"], q, hq=4, hkv=2, d=128, page_size=4, window=8,
                                  dtype=torch.bfloat16)  # fmt: skip
    b.q = (b.q.float() * 3e4).to(torch.bfloat16)
    assert b.q.float().abs().max() > 65504
    ops = ops_for(DEVICE, backend="triton")
    if kind == "paged":
        out = ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=8, quant=q)
    else:
        out = ops.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=8, quant=q)
    assert_close(out, naive(b.q, hist_k, hist_v, b.specs, window=8, scale=b.scale))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_over_fp8(num_splits: int) -> None:
    q = QUANTS["calibrated"]
    ops = ops_for(DEVICE, backend="triton")
    b, hist_k, hist_v = fp8_batch(SPECS["decode-pages"], q, hq=8, hkv=2, window=5, dtype=torch.bfloat16)
    want = naive(b.q, hist_k, hist_v, b.specs, window=5, scale=b.scale)
    paged = ops._paged(*b.paged_args(), max_q=1, scale=b.scale, window=5, num_splits=num_splits, quant=q)
    ring = ops._ring(*b.ring_args(), max_q=1, scale=b.scale, window=5, num_splits=num_splits, quant=q)
    assert_close(paged, want)
    assert_close(ring, want)


def assert_codes_of(codes: torch.Tensor, want: torch.Tensor, v_scale: float) -> None:
    """e4m3 codes at V's scale hold `want` (float64 naive attention) to e4m3's rounding: half a step
    of 3 mantissa bits (1/16 of the value) plus the float32 sums' slack, or a subnormal's step."""
    assert codes.dtype == FP8_KV_DTYPE and codes.shape == want.shape
    got = dequantize(codes.cpu(), v_scale).double()
    want = want.cpu().double().clamp(-FP8_MAX * v_scale, FP8_MAX * v_scale)
    torch.testing.assert_close(got, want, rtol=1 / 16 + 1e-3, atol=2.0**-10 * v_scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["paged", "ring"])
@pytest.mark.parametrize("case", ["prefill-mid", "decode-around-W", "mixed"])
def test_an_fp8_output_is_e4m3_codes_at_vs_scale(backend: str, kind: str, case: str) -> None:
    """`fp8_out`: attention's output as the FP8 o projection takes it, e4m3 codes at V's scale, on
    every path (prompt chunks, decodes, mixed batches); the torch path's codes are exactly its float32
    output quantized at V's scale, and the Triton kernels' codes are the torch path's to one step."""
    q = QUANTS["calibrated"]
    b, hist_k, hist_v = fp8_batch(SPECS[case], q, hq=4, hkv=2, d=16, page_size=4, window=5,
                                  dtype=torch.bfloat16)  # fmt: skip
    ops = ops_for(DEVICE, backend=backend)
    call = ops.paged_attention if kind == "paged" else ops.ring_attention
    args = b.paged_args() if kind == "paged" else b.ring_args()
    codes = call(*args, max_q=b.max_q, scale=b.scale, window=5, quant=q, fp8_out=True)
    assert_codes_of(codes, naive(b.q.float(), hist_k, hist_v, b.specs, window=5, scale=b.scale), q.v_scale)
    if backend == "triton":
        want = ops_for(DEVICE, backend="torch")
        want_codes = getattr(want, f"{kind}_attention")(
            *args, max_q=b.max_q, scale=b.scale, window=5, quant=q, fp8_out=True
        )
        steps = (codes.float() - want_codes.float()).abs() / want_codes.float().abs().clamp(min=2.0**-6)
        assert steps.max() <= 1 / 8  # one e4m3 step at most


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_split_decodes_merge_into_e4m3_codes(kind: str, num_splits: int) -> None:
    """A split decode leaves V's scale off its partials too, and the merge stores the codes."""
    q = QUANTS["calibrated"]
    ops = ops_for(DEVICE, backend="triton")
    b, hist_k, hist_v = fp8_batch(SPECS["decode-pages"], q, hq=8, hkv=2, window=5, dtype=torch.bfloat16)
    call = ops._paged if kind == "paged" else ops._ring
    args = b.paged_args() if kind == "paged" else b.ring_args()
    codes = call(*args, max_q=1, scale=b.scale, window=5, num_splits=num_splits, quant=q, fp8_out=True)
    assert_codes_of(codes, naive(b.q.float(), hist_k, hist_v, b.specs, window=5, scale=b.scale), q.v_scale)


def test_outputs_past_vs_range_saturate_and_an_fp8_output_needs_an_fp8_cache() -> None:
    """Codes saturate at +-448 (never NaN); a cache in the model's dtype has no codes to give."""
    q = KVQuant(1.0, 1.0)
    b, _, _ = fp8_batch([(3, 1)], q, hq=2, hkv=1, d=16, dtype=torch.float32)
    b.v_cache = torch.full_like(b.v_cache.float(), 448.0).to(FP8_KV_DTYPE)
    for backend in BACKENDS:
        codes = ops_for(DEVICE, backend=backend).paged_attention(
            *b.paged_args(), max_q=1, scale=b.scale, window=None, quant=q, fp8_out=True
        )
        assert codes.float().eq(448.0).all()
    plain = make_batch([(3, 1)], device=DEVICE)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="fp8_out needs an FP8 cache"):
            ops_for(DEVICE, backend=backend).paged_attention(
                *plain.paged_args(), max_q=1, scale=plain.scale, window=None, fp8_out=True
            )


ROPE_SPECS = [(6, 1), (7, 1), (8, 1), (3, 1), (16, 1), (33, 1)]
ROPE_QUANT, ROPE_PAGE, ROPE_D = QUANTS["calibrated"], 4, 16


def rope_fp8_case(
    kind: str, specs: list[tuple[int, int]], w: int, dtype: torch.dtype, seed: int, page: int = ROPE_PAGE
) -> tuple[Batch, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A decode batch with RoPE inside over an FP8 cache: the batch (rings of w entries, pages of
    `page` keys), its cos/sin table, each row's store index in the ring or pages, and the quantized
    K and V caches."""
    d, q = ROPE_D, ROPE_QUANT
    b = make_batch(specs, hq=4, hkv=2, d=d, page_size=page, window=w, dtype=dtype, device=DEVICE, seed=seed)
    positions = max(l0 for l0, _ in specs) + 32
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    if kind == "ring":
        dst = (b.slots.long() * w + b.q_start.long() % w).to(DEVICE)
        caches = (quantize(b.k_ring, q.inv_k), quantize(b.v_ring, q.inv_v))
    else:
        dst = torch.tensor([int(b.block_table[i, l0 // page]) * page + l0 % page for i, (l0, _) in
                            enumerate(specs)], device=DEVICE)  # fmt: skip
        caches = (quantize(b.k_cache, q.inv_k), quantize(b.v_cache, q.inv_v))
    return b, cos_sin, dst, caches


def rope_fp8_decode(
    kind: str, b: Batch, cos_sin: torch.Tensor, store: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor], backend: str, window: int | None, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode call with RoPE inside on fresh copies of `caches` (`store`: each row's store index;
    `window`: the ring's W, or paged attention's window); returns the output and the K and V caches
    after it, on the CPU. The torch path takes no split factor."""
    d, q = ROPE_D, ROPE_QUANT
    kc, vc = (c.clone() for c in caches)
    rope = RopeInKernel(b.q_start.long(), cos_sin, kc.view(-1, 2, d), vc.view(-1, 2, d), store)
    ops = ops_for(DEVICE, backend=backend)
    split = {"num_splits": num_splits} if backend == "triton" else {}
    if kind == "ring":
        call = ops._ring if backend == "triton" else ops.ring_attention
        out = call(b.q, b.k_new, b.v_new, kc, vc, b.slots, b.cu_q, b.q_start, max_q=1, scale=b.scale,
                   window=window, rope=rope, quant=q, **split)  # fmt: skip
    else:
        call = ops._paged if backend == "triton" else ops.paged_attention
        out = call(b.q, kc, vc, b.block_table, b.cu_q, b.q_start, max_q=1, scale=b.scale, window=window,
                   k_new=b.k_new, v_new=b.v_new, rope=rope, quant=q, **split)  # fmt: skip
    return out.cpu(), kc.cpu(), vc.cpu()


@pytest.mark.parametrize("kind", ["ring", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rope_inside_attention_stores_fp8_like_the_reference(kind: str, dtype, num_splits: int) -> None:
    """Decode's RoPE inside attention: the Triton kernel's quantized K/V store is the torch path's,
    byte for byte, and so is what it attends (the token read back from its FP8 page or entry)."""
    w = 8
    b, cos_sin, dst, caches = rope_fp8_case(kind, ROPE_SPECS, w, dtype, seed=5)
    window = w if kind == "ring" else None
    (want, k_want, v_want), (got, k_got, v_got) = (
        rope_fp8_decode(kind, b, cos_sin, dst, caches, backend, window, num_splits) for backend in BACKENDS
    )
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert same_fp8(v_got, v_want)
    if dtype != torch.float32 or DEVICE == "cpu":  # a GPU may fuse fp32 products and sums
        assert same_fp8(k_got, k_want)


# Pages of 4 keys (a 64-key tile reads 16 of them), 128 (two tiles a page) and 24 (tiles and pages
# not nested).
@pytest.mark.parametrize(
    ("kind", "window", "page"),
    [("ring", 64, 4), ("paged", None, 4), ("paged", None, 128), ("paged", None, 24), ("paged", 24, 4)],
)
def test_an_unsplit_fp8_decode_reads_its_whole_tiles_unmasked_as_the_reference(kind, window, page) -> None:
    """An unsplit decode over an FP8 cache with RoPE inside reads its whole key tiles without masks
    (`_launch.whole_tiles`) and only its last, partial tile masked: contexts over several tiles, on
    tile edges and between them, rings wrapped at several points (a tile's edge among them) and not
    yet full, pages that nest with the tiles and pages that do not, sliding pages. It
    attends what the torch path attends; a padding row (no key of its own) stays finite and stores
    nothing."""
    from shared.kernels._launch import whole_tiles

    assert whole_tiles(True, True, 1)
    assert (
        not whole_tiles(True, True, 2) and not whole_tiles(True, False, 1) and not whole_tiles(False, True, 1)
    )
    # Ring (W = 64, 32-key tiles): wrapped mid-tile (70, 100, 111), on a tile's edge (95), not wrapped
    # with the ring full (127, 63) or filling (40, 5, 16); the last row pads.
    specs = [(70, 1), (100, 1), (127, 1), (40, 1), (63, 1), (5, 1), (95, 1), (111, 1), (16, 1), (64, 1)]
    w = window or 64
    b, cos_sin, dst, caches = rope_fp8_case(kind, specs, w, torch.bfloat16, seed=11, page=page)
    window = w if kind == "ring" else window
    padded_dst = torch.cat([dst[:-1], dst.new_full((1,), -1)])
    want, k_want, v_want = rope_fp8_decode(kind, b, cos_sin, dst, caches, "torch", window, 1)
    got, k_got, v_got = rope_fp8_decode(kind, b, cos_sin, dst, caches, "triton", window, 1)
    padded, k_padded, _ = rope_fp8_decode(kind, b, cos_sin, padded_dst, caches, "triton", window, 1)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])
    assert same_fp8(k_got, k_want) and same_fp8(v_got, v_want)
    torch.testing.assert_close(padded[:-1], want[:-1], **TOLERANCE[torch.bfloat16])
    assert torch.isfinite(padded[-1].float()).all()
    last = int(dst[-1])
    assert same_fp8(
        k_padded.view(-1, 2, ROPE_D)[last], caches[0].cpu().view(-1, 2, ROPE_D)[last]
    )  # untouched


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1024])
def test_fp8_kernels_at_serving_shapes_match_the_reference(window: int | None) -> None:
    """Compiled on the GPU, at an engine's shapes: GQA 32/8 x 128, pages of 16, a decode batch of 48
    rows with contexts up to ~1500 (split-K picked by the launch rule) beside prompt chunks, and a
    decode batch of 72 whose programs fill the GPU alone (an FP8 cache's own tiles); FP8 pages and
    rings against the torch reference on the same device, and the hardware's stores against torch's
    quantizer."""
    q = KVQuant(0.02, 0.5)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1500, (48,), generator=gen).tolist()
    specs = [(n, 1) for n in lengths] + [(0, 200), (700, 64)]
    b = make_batch(specs, hq=32, hkv=8, d=128, page_size=16, window=window, dtype=torch.bfloat16,
                   device="cuda", seed=1)  # fmt: skip
    b.k_cache, b.v_cache = quantize(b.k_cache, q.inv_k), quantize(b.v_cache, q.inv_v)
    triton_ops, torch_ops = ops_for("cuda"), ops_for("cuda", backend="torch")
    assert triton_ops.name == "triton"
    want = torch_ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, quant=q)
    got = triton_ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, quant=q)
    assert_close(got, want)
    lengths += torch.randint(1, 1500, (24,), generator=gen).tolist()
    decode = make_batch([(n, 1) for n in lengths], hq=32, hkv=8, d=128, page_size=16, window=window,
                        dtype=torch.bfloat16, device="cuda", seed=2)  # fmt: skip
    decode.k_cache, decode.v_cache = quantize(decode.k_cache, q.inv_k), quantize(decode.v_cache, q.inv_v)
    want = torch_ops.paged_attention(
        *decode.paged_args(), max_q=1, scale=decode.scale, window=window, quant=q
    )
    got = triton_ops.paged_attention(
        *decode.paged_args(), max_q=1, scale=decode.scale, window=window, quant=q
    )
    assert_close(got, want)
    if window is not None:
        for batch, max_q in ((b, b.max_q), (decode, 1)):
            assert batch.k_ring is not None and batch.v_ring is not None
            batch.k_ring, batch.v_ring = quantize(batch.k_ring, q.inv_k), quantize(batch.v_ring, q.inv_v)
            want = torch_ops.ring_attention(*batch.ring_args(), max_q=max_q, scale=batch.scale, window=window,
                                            quant=q)  # fmt: skip
            got = triton_ops.ring_attention(*batch.ring_args(), max_q=max_q, scale=batch.scale, window=window,
                                            quant=q)  # fmt: skip
            assert_close(got, want)
    x = awkward((4096, 8, 128), torch.bfloat16, 4)
    k_dst, v_dst = (torch.zeros(5000, 8, 128, device="cuda").to(FP8_KV_DTYPE) for _ in "kv")
    index = torch.randperm(5000, device="cuda")[:4096]
    triton_ops.store_kv(x, x, k_dst, v_dst, index, q)
    for dst, inv in ((k_dst, q.inv_k), (v_dst, q.inv_v)):  # rows gathered as bytes: few float8 ops on CUDA
        assert same_fp8(dst.view(torch.uint8)[index].view(FP8_KV_DTYPE).cpu(), quantize(x, inv).cpu())
