"""Decode attention that writes its output quantized for an FP8 o projection (`quantize_out=True`).

An unsplit decode call's kernel stores e4m3 rows [T, Hq * D] with one scale a token and kv head:
exactly the bits the FP8 quantizer (`shared/kernels/fp8/reference.py` `quantize`, groups of one kv
head's query heads) gives for the output the same call stores when not asked, with RoPE inside or
not, over caches in the model's dtype or FP8, padded head groups and head dims included. A split call,
a prefill chunk and the torch implementation give the output as it is: the caller quantizes it.
Interpreted on CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import Batch, make_batch

from shared.kernels.attention import ops_for
from shared.kernels.attention.fused_rope import RopeInKernel
from shared.kernels.fp8 import Fp8Act
from shared.kernels.fp8 import reference as fp8_reference
from shared.kernels.kv_quant import KVQuant, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W, PAGE = 8, 4
DECODES = [(6, 1), (7, 1), (8, 1), (3, 1), (16, 1), (33, 1)]  # around the window and page boundaries
# (query heads, kv heads, head dim): 2 heads a kv head; 3 (a padded head group) over a padded head dim
SHAPES = {"4x2x16": (4, 2, 16), "6x2x24": (6, 2, 24)}


def batch(shape: str, dtype: torch.dtype, fp8_cache: bool, specs=DECODES) -> tuple[Batch, KVQuant | None]:
    hq, hkv, d = SHAPES[shape]
    b = make_batch(specs, hq=hq, hkv=hkv, d=d, page_size=PAGE, window=W, dtype=dtype, device=DEVICE, seed=3)
    b.q = b.q * 4  # outputs well past 1, so the scales differ by kv head and token
    b.v_new = b.v_new * 4
    b.v_cache, b.v_ring = b.v_cache * 4, b.v_ring * 4  # type: ignore[operator]
    if not fp8_cache:
        return b, None
    quant = KVQuant(0.03, 0.05)
    b.k_cache, b.v_cache = quantize(b.k_cache, quant.inv_k), quantize(b.v_cache, quant.inv_v)
    b.k_ring, b.v_ring = quantize(b.k_ring, quant.inv_k), quantize(b.v_ring, quant.inv_v)  # type: ignore[arg-type]
    return b, quant


def attend(kind: str, b: Batch, quant: KVQuant | None, rope: bool, **kw):
    """One Triton call over fresh copies of the caches (RoPE inside stores into them)."""
    ops = ops_for(DEVICE, backend="triton")
    hkv, d = b.k_new.shape[1], b.k_new.shape[2]
    if kind == "ring":
        k_ring, v_ring = b.k_ring.clone(), b.v_ring.clone()  # type: ignore[union-attr]
        inside = {}
        if rope:
            dst = (b.slots.long() * W + b.q_start.long() % W).to(DEVICE)  # type: ignore[union-attr]
            inside["rope"] = rope_in(b, k_ring.view(-1, hkv, d), v_ring.view(-1, hkv, d), dst)
        return ops._ring(b.q, b.k_new, b.v_new, k_ring, v_ring, b.slots, b.cu_q, b.q_start, max_q=b.max_q,
                         scale=b.scale, window=W, quant=quant, **inside, **kw)  # fmt: skip
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    inside = {}
    if rope:
        dst = torch.tensor(
            [int(b.block_table[i, l0 // PAGE]) * PAGE + l0 % PAGE for i, (l0, _) in enumerate(b.specs)],
            device=DEVICE,
        )  # fmt: skip
        rows = (k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d))
        inside = {"k_new": b.k_new, "v_new": b.v_new, "rope": rope_in(b, *rows, dst)}
    return ops._paged(b.q, k_cache, v_cache, b.block_table, b.cu_q, b.q_start, max_q=b.max_q, scale=b.scale,
                      window=None, quant=quant, **inside, **kw)  # fmt: skip


def rope_in(b: Batch, k_dst: torch.Tensor, v_dst: torch.Tensor, dst: torch.Tensor) -> RopeInKernel:
    d = b.q.shape[2]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    return RopeInKernel(b.q_start.long(), cos_sin, k_dst, v_dst, dst)


def same_bits(got: Fp8Act, want: Fp8Act) -> None:
    assert got.group == want.group and got.dtype == want.dtype
    assert torch.equal(got.scale.cpu(), want.scale.cpu())
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu())


@pytest.mark.parametrize("kind", ["ring", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rope", [False, True], ids=["rope-before", "rope-inside"])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache-dtype", "cache-fp8"])
def test_an_unsplit_decode_call_writes_the_quantizers_bits(kind, dtype, shape, rope, fp8_cache) -> None:
    b, quant = batch(shape, dtype, fp8_cache)
    plain = attend(kind, b, quant, rope, num_splits=1)
    got = attend(kind, b, quant, rope, num_splits=1, quantize_out=True)
    assert isinstance(got, Fp8Act)
    hq, hkv, d = SHAPES[shape]
    t = plain.shape[0]
    assert got.data.shape == (t, hq * d) and got.scale.shape == (t, hkv)
    same_bits(got, fp8_reference.quantize(plain.reshape(t, -1), hq // hkv * d))


@pytest.mark.parametrize("kind", ["ring", "paged"])
def test_a_split_call_or_a_prefill_chunk_gives_the_output_as_it_is(kind) -> None:
    b, _ = batch("4x2x16", torch.bfloat16, fp8_cache=False)
    split = attend(kind, b, None, rope=False, num_splits=2, quantize_out=True)
    assert isinstance(split, torch.Tensor)
    torch.testing.assert_close(split, attend(kind, b, None, rope=False, num_splits=2), atol=0, rtol=0)
    chunks, _ = batch("4x2x16", torch.bfloat16, fp8_cache=False, specs=[(5, 3), (0, 4), (9, 2)])
    out = attend(kind, chunks, None, rope=False, quantize_out=True)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, attend(kind, chunks, None, rope=False), atol=0, rtol=0)


def test_the_torch_implementation_gives_the_output_as_it_is() -> None:
    b, _ = batch("4x2x16", torch.bfloat16, fp8_cache=False)
    ops = ops_for(DEVICE, backend="torch")
    args = dict(max_q=1, scale=b.scale, window=None)
    out = ops.paged_attention(*b.paged_args(), **args, quantize_out=True)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, ops.paged_attention(*b.paged_args(), **args))
