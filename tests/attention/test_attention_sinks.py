"""Attention sinks (gpt-oss, `sinks=`): query head h's softmax runs over the keys it sees plus one
learned logit sinks[h] (not scaled by the softmax scale), whose probability is dropped:

    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)),  m = max(max_j s_j, sinks[h])

The Triton kernels (interpreted on CPU) and the torch reference are held to a naive attention written
from Hugging Face's eager gpt-oss: paged (full and windowed) and ring attention, decode and prefill
chunks, forced split-K (only one split may count the sink), RoPE inside attention, FP8 caches, GQA
groups of 1 to 3. A sink of +20 all but silences a head; a sink of -1e4 is no sink at all.
"""

from __future__ import annotations

import pytest
import torch
from attn_testutil import NAN_FILL, TOLERANCE, Batch, assert_close, make_batch
from cases import SPECS

from shared.kernels import reference as model_reference
from shared.kernels.attention import AttentionOps, ops_for
from shared.kernels.attention.fused_rope import RopeInKernel
from shared.kernels.kv_quant import KVQuant, dequantize, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
CASES = ["decode-around-W", "mixed"]  # decode rows around W = 8; prefill chunks from 0 and mid-sequence
# (hq, hkv, d, page_size): query heads per kv head 1, 2 and 3.
LAYOUTS = {"group1": (2, 2, 16, 4), "group2": (4, 2, 16, 4), "group3-d24": (6, 2, 24, 4)}
# Decode rows around a window of 24 (16-key tiles in the interpreter): 3 splits give most rows keys in
# every split, 8 leave many splits empty, split 0 among them (rows at 5 and 24; the empty ring at 0).
DECODE = [(0, 1), (5, 1), (24, 1), (41, 1), (100, 1)]
# A small mix of a prefill chunk and decode rows, for the tests that launch many variants.
SMALL = [(0, 5), (12, 1), (40, 1)]
FP8 = KVQuant(0.03, 4.0)


def hf_sink_attention(
    q: torch.Tensor, hist_k: list[torch.Tensor], hist_v: list[torch.Tensor], specs: list[tuple[int, int]],
    *, window: int | None, scale: float, sinks: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Hugging Face's eager gpt-oss, one query at a time in float64: the sink joins the scores as one
    more column, the softmax runs over them all, and the sink's column is dropped."""
    group = q.shape[1] // hist_k[0].shape[1]
    sink = sinks.double().view(-1, 1)
    out, t = [], 0
    for (l0, n), hk, hv in zip(specs, hist_k, hist_v, strict=True):
        for i in range(n):
            pos = l0 + i
            keys = list(range(0 if window is None else max(0, pos - window + 1), pos + 1))
            k = hk[keys].double().repeat_interleave(group, dim=1)  # [K, Hq, D]
            v = hv[keys].double().repeat_interleave(group, dim=1)
            combined = torch.cat([torch.einsum("hd,khd->hk", q[t].double(), k) * scale, sink], dim=-1)
            probs = torch.softmax(combined - combined.max(-1, keepdim=True).values, dim=-1)[:, :-1]
            out.append(torch.einsum("hk,khd->hd", probs, v))
            t += 1
    return torch.stack(out).to(q.dtype)


def head_sinks(hq: int, seed: int = 0) -> torch.Tensor:
    """A different sink per head, shuffled (a head read at the wrong index shows), around the scores'
    scale so each one takes a real share of its head's softmax."""
    gen = torch.Generator().manual_seed(seed)
    return torch.linspace(-2.0, 3.0, hq)[torch.randperm(hq, generator=gen)].to(DEVICE)


def expected(b: Batch, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    return hf_sink_attention(b.q, b.hist_k, b.hist_v, b.specs, window=window, scale=b.scale, sinks=sinks)


def paged(
    ops: AttentionOps, b: Batch, window: int | None, num_splits: int | None = None, **kw
) -> torch.Tensor:
    """The op, or with num_splits the Triton wrapper (`ops._paged`), which takes a forced split."""
    if num_splits is None:
        return ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, **kw)
    return ops._paged(
        *b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, num_splits=num_splits, **kw
    )


def ring(ops: AttentionOps, b: Batch, window: int, num_splits: int | None = None, **kw) -> torch.Tensor:
    if num_splits is None:
        return ops.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window, **kw)
    return ops._ring(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window, num_splits=num_splits, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["group2", "group3-d24"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_with_sinks_is_hf_gpt_oss(backend: str, layout: str, window: int | None, case: str):
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window, device=DEVICE)
    sinks = head_sinks(hq)
    assert_close(paged(ops_for(DEVICE, backend=backend), b, window, sinks=sinks), expected(b, sinks, window))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["group1", "group3-d24"])
@pytest.mark.parametrize("window", [1, 8])
@pytest.mark.parametrize("case", CASES)
def test_ring_attention_with_sinks_is_hf_gpt_oss(backend: str, layout: str, window: int, case: str):
    """Sliding layers take sinks too; a window of 1 leaves each query its own key and the sink."""
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window, device=DEVICE)
    sinks = head_sinks(hq, seed=1)
    assert_close(ring(ops_for(DEVICE, backend=backend), b, window, sinks=sinks), expected(b, sinks, window))


@pytest.mark.parametrize("num_splits", [3, 8])
@pytest.mark.parametrize("kind", ["paged", "paged-window", "ring"])
def test_split_k_counts_the_sink_once(kind: str, num_splits: int) -> None:
    """Split 0 starts its softmax with the sink and the merge weighs it in once, whether or not
    split 0 sees a key."""
    b = make_batch(DECODE, hq=4, hkv=2, d=16, page_size=4, window=24, device=DEVICE, seed=2)
    ops, sinks = ops_for(DEVICE, backend="triton"), head_sinks(4, seed=2)
    if kind == "ring":
        out, window = ring(ops, b, 24, num_splits, sinks=sinks), 24
    else:
        window = 24 if kind == "paged-window" else None
        out = paged(ops, b, window, num_splits, sinks=sinks)
    assert_close(out, expected(b, sinks, window))


@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_split_k_forced_on_prefill_chunks(kind: str) -> None:
    b = make_batch(SPECS["mixed"], hq=6, hkv=2, d=24, window=5, device=DEVICE, seed=3)
    ops, sinks = ops_for(DEVICE, backend="triton"), head_sinks(6, seed=3)
    out = paged(ops, b, 5, 3, sinks=sinks) if kind == "paged" else ring(ops, b, 5, 3, sinks=sinks)
    assert_close(out, expected(b, sinks, 5))


def fp8_history(b: Batch, quant: KVQuant) -> None:
    """Store b's pages and ring in FP8 (NaN stays NaN), and its history as attention must see it."""
    b.k_cache, b.v_cache = quantize(b.k_cache, quant.inv_k), quantize(b.v_cache, quant.inv_v)
    assert b.k_ring is not None and b.v_ring is not None
    b.k_ring, b.v_ring = quantize(b.k_ring, quant.inv_k), quantize(b.v_ring, quant.inv_v)
    b.hist_k = [dequantize(quantize(h, quant.inv_k), quant.k_scale) for h in b.hist_k]
    b.hist_v = [dequantize(quantize(h, quant.inv_v), quant.v_scale) for h in b.hist_v]


@pytest.mark.parametrize(("backend", "num_splits"), [("torch", None), ("triton", None), ("triton", 3)])
@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_fp8_cache_with_sinks(backend: str, num_splits: int | None, kind: str) -> None:
    """K's scale is folded into the kernels' softmax scale; the sink, a logit, is not scaled by it."""
    b = make_batch(SPECS["mixed"], hq=4, hkv=2, d=16, window=5, dtype=torch.bfloat16, device=DEVICE, seed=4)
    fp8_history(b, FP8)
    ops, sinks = ops_for(DEVICE, backend=backend), head_sinks(4, seed=4)
    if kind == "paged":
        out = paged(ops, b, None, num_splits, sinks=sinks, quant=FP8)
    else:
        out = ring(ops, b, 5, num_splits, sinks=sinks, quant=FP8)
    assert_close(out, expected(b, sinks, None if kind == "paged" else 5))


ROPE_SPECS = [(6, 1), (7, 1), (8, 1), (3, 1), (16, 1), (33, 1)]


@pytest.mark.parametrize(
    ("backend", "num_splits", "quant"),
    [
        ("torch", None, None),
        ("triton", None, None),
        ("triton", 3, None),
        ("torch", None, FP8),
        ("triton", 3, FP8),
    ],
)
@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_rope_inside_decode_attention_with_sinks(backend, num_splits, quant, kind) -> None:
    """Decode with RoPE inside attention: the kernel rotates q and k, stores k (into an FP8 cache:
    quantized) and attends with the sink as with RoPE applied first."""
    w, page, d = 8, 4, 16
    b = make_batch(ROPE_SPECS, hq=4, hkv=2, d=d, page_size=page, window=w, device=DEVICE, seed=5)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    positions = b.q_start.long()
    qr, kr = model_reference.rope(b.q, b.k_new, positions, cos_sin, None, None, 1e-6)
    # What attention must see: the rotated query against the history, whose last key is rotated.
    want_b = make_batch(ROPE_SPECS, hq=4, hkv=2, d=d, page_size=page, window=w, device=DEVICE, seed=5)
    want_b.q = qr
    for i, (l0, _) in enumerate(ROPE_SPECS):
        want_b.hist_k[i][l0] = kr[i]
    if kind == "ring":
        assert b.slots is not None
        dst = (b.slots.long() * w + positions % w).to(DEVICE)
    else:  # the token's rows hold NaN until the kernel stores them: attending to them first would show
        dst = torch.tensor([int(b.block_table[i, l0 // page]) * page + l0 % page for i, (l0, _) in
                            enumerate(ROPE_SPECS)], device=DEVICE)  # fmt: skip
        b.k_cache.view(-1, 2, d)[dst] = NAN_FILL
        b.v_cache.view(-1, 2, d)[dst] = NAN_FILL
    if quant is not None:
        fp8_history(b, quant)
        fp8_history(want_b, quant)
    kc, vc = (b.k_ring, b.v_ring) if kind == "ring" else (b.k_cache, b.v_cache)
    assert kc is not None and vc is not None
    ops, sinks = ops_for(DEVICE, backend=backend), head_sinks(4, seed=5)
    split = {} if num_splits is None else {"num_splits": num_splits}
    rope = RopeInKernel(positions, cos_sin, kc.view(-1, 2, d), vc.view(-1, 2, d), dst)
    common = {"max_q": 1, "scale": b.scale, "rope": rope, "quant": quant, "sinks": sinks, **split}
    if kind == "ring":
        call = ops._ring if num_splits is not None else ops.ring_attention
        out = call(b.q, b.k_new, b.v_new, kc, vc, b.slots, b.cu_q, b.q_start, window=w, **common)
    else:
        call = ops._paged if num_splits is not None else ops.paged_attention
        out = call(b.q, kc, vc, b.block_table, b.cu_q, b.q_start, window=None, k_new=b.k_new, v_new=b.v_new,
                   **common)  # fmt: skip
    assert_close(out, expected(want_b, sinks, w if kind == "ring" else None))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_a_large_sink_all_but_silences_its_head(backend: str, num_splits: int | None) -> None:
    """sinks = +20 takes ~all of each head's softmax (e^20 against a few e^(+-3) scores): outputs
    shrink towards zero by the sink's share, which the kernels still get right to fp32 precision."""
    if backend == "torch" and num_splits is not None:
        pytest.skip("split-K is a Triton launch choice")
    b = make_batch(SMALL, hq=4, hkv=2, d=16, window=5, device=DEVICE, seed=6)
    ops, sinks = ops_for(DEVICE, backend=backend), torch.full((4,), 20.0, device=DEVICE)
    for window, out in (
        (None, paged(ops, b, None, num_splits, sinks=sinks)),
        (5, ring(ops, b, 5, num_splits, sinks=sinks)),
    ):
        plain = paged(ops, b, window, num_splits) if window is None else ring(ops, b, 5, num_splits)
        assert out.abs().max() < 1e-4 * plain.abs().max()
        torch.testing.assert_close(out, expected(b, sinks, window), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_a_sink_of_minus_1e4_is_no_sink(backend: str, num_splits: int | None) -> None:
    """e^(-1e4 - m) is 0 in float32: the kernels' results are the sink-less ones bit for bit (the
    sink's l = 1 is scaled to exactly 0 by the first key), the reference's to rounding."""
    if backend == "torch" and num_splits is not None:
        pytest.skip("split-K is a Triton launch choice")
    b = make_batch(SMALL, hq=4, hkv=2, d=16, window=5, device=DEVICE, seed=7)
    ops, sinks = ops_for(DEVICE, backend=backend), torch.full((4,), -1e4, device=DEVICE)
    pairs = [
        (paged(ops, b, None, num_splits, sinks=sinks), paged(ops, b, None, num_splits)),
        (paged(ops, b, 5, num_splits, sinks=sinks), paged(ops, b, 5, num_splits)),
        (ring(ops, b, 5, num_splits, sinks=sinks), ring(ops, b, 5, num_splits)),
    ]
    for with_sink, without in pairs:
        if backend == "triton":
            assert torch.equal(with_sink, without)
        else:
            torch.testing.assert_close(with_sink, without, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_query_rows_stay_finite(backend: str) -> None:
    """max_q may overstate every chunk (graph-sized batches): the padding rows of the query grid see
    no key, and with a sink must neither produce NaN nor disturb the real rows."""
    b = make_batch(SPECS["mixed"], hq=4, hkv=2, d=16, window=5, device=DEVICE, seed=8)
    ops, sinks = ops_for(DEVICE, backend=backend), head_sinks(4, seed=8)
    for window in (None, 5):
        out = ops.paged_attention(
            *b.paged_args(), max_q=b.max_q + 3, scale=b.scale, window=window, sinks=sinks
        )
        assert_close(out, expected(b, sinks, window))
    out = ops.ring_attention(*b.ring_args(), max_q=b.max_q + 3, scale=b.scale, window=5, sinks=sinks)
    assert_close(out, expected(b, sinks, 5))


def test_a_ring_row_that_sees_no_key_gives_zeros() -> None:
    """A graph's padding row in a decode with RoPE inside stores nothing (store index -1); at
    position 0 its ring is empty, so the kernel's row sees no key at all: only the sink, no NaN."""
    w, d = 8, 16
    b = make_batch([(5, 1), (0, 1)], hq=4, hkv=2, d=d, window=w, device=DEVICE, seed=9)
    cos_sin = torch.cat([torch.ones(16, d // 2), torch.zeros(16, d // 2)], dim=-1).to(DEVICE)
    assert b.k_ring is not None and b.v_ring is not None and b.slots is not None
    dst = torch.tensor([int(b.slots[0]) * w + 5, -1], device=DEVICE)
    rope = RopeInKernel(b.q_start.long(), cos_sin, b.k_ring.view(-1, 2, d), b.v_ring.view(-1, 2, d), dst)
    out = ops_for(DEVICE, backend="triton").ring_attention(
        *b.ring_args(), max_q=1, scale=b.scale, window=w, rope=rope, sinks=head_sinks(4)
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all() and out[0].abs().max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["paged", "ring"])
def test_bad_sinks_are_refused_naming_sinks(backend: str, kind: str) -> None:
    b = make_batch([(3, 2), (7, 1)], hq=4, hkv=2, d=16, window=5, device=DEVICE)
    ops = ops_for(DEVICE, backend=backend)
    bad = {
        r"got shape \[5\]": torch.zeros(5, device=DEVICE),
        r"got shape \[1, 4\]": torch.zeros(1, 4, device=DEVICE),
        r"got shape \[2\]": torch.zeros(2, device=DEVICE),  # one per kv head: sinks are per query head
        r"got dtype torch.bfloat16": torch.zeros(4, dtype=torch.bfloat16, device=DEVICE),
        r"got dtype torch.float64": torch.zeros(4, dtype=torch.float64, device=DEVICE),
        r"got device meta": torch.zeros(4, device="meta"),
        r"got stride \(2,\)": torch.zeros(8, device=DEVICE)[::2],
        r"or None, got list": [0.0] * 4,
    }
    for message, sinks in bad.items():
        with pytest.raises(
            ValueError, match=rf"{kind}_attention: sinks must be a contiguous float32 .*{message}"
        ):
            if kind == "paged":
                ops.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=5, sinks=sinks)
            else:
                ops.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=5, sinks=sinks)
