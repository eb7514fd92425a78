"""The FP8 KV cache (`KVConfig(dtype=FP8_KV_DTYPE)`, `--kv-cache-dtype fp8_e4m3`) through the engine.

Teacher-forced, the engine over FP8 pages and rings computes what one dense pass computes with every
layer's K and V quantized and back (the oracle: chunked prefill, decode with and without RoPE inside
attention, scales of 1.0 and per-layer ones), so every store quantizes once and every read dequantizes
with its layer's scales; and it stays close to the float32 cache's logits. Window snapshots of the
prefix cache, the inline transfer and bounded replay move FP8 bytes as they are: tokens equal the FP8
engine's without them, at half the bytes of a bfloat16 cache. On CUDA (`gpu`) the Triton path against
the same oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.batch import Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams
from shared.kernels.kv_quant import FP8_KV_DTYPE, KVQuant, dequantize, quantize
from shared.model.reference import DenseAttention, pack
from shared.model.transformer import Transformer
from shared.transfer.base import KVLayout, mismatches
from shared.transfer.inline import apply_chunk, begin_receive, extract_chunks
from tests.engine.engine_testutil import W, random_tokens, reference, tiny_config, tiny_model
from tests.engine.test_engine_handoff import run_to_end
from tests.engine.test_engine_parity import Seq, run

P = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Per-layer (k_scale, v_scale) of the 4-layer test models: calibrated-looking values, not 1.0.
SCALES = ((0.02, 0.05), (0.5, 0.01), (0.013, 0.2), (1.5, 0.04))
# Engine against the oracle: float32 sums in another order, and now and then a K or V element whose
# float32 value sits on an e4m3 rounding boundary lands one step apart (the GEMM of a chunk rounds
# differently from the dense pass's): measured at most 1.6e-4 (most rows ~1e-5). A quantization
# missing, done twice, or with another layer's scales moves logits by tenths.
ORACLE = {"rtol": 2e-3, "atol": 2e-3}


class QuantizedDense(DenseAttention):
    """The dense reference with each layer's K and V stored in FP8 and read back: the oracle."""

    def __init__(self, cache: KVCache, cu_seqlens: torch.Tensor) -> None:
        super().__init__(cache.model, cu_seqlens)
        self.quant = cache.quant

    def fp8_out_scale(self, layer: int) -> torch.Tensor:
        qt = self.quant[layer]
        assert qt is not None
        return torch.tensor([qt.v_scale])

    def __call__(self, layer, q, k, v, rope=None, fp8_out=False):  # type: ignore[no-untyped-def]
        qt = self.quant[layer]
        assert qt is not None
        k = dequantize(quantize(k, qt.inv_k), qt.k_scale).to(k.dtype)
        v = dequantize(quantize(v, qt.inv_v), qt.v_scale).to(v.dtype)
        out = super().__call__(layer, q, k, v, rope)
        return quantize(out, qt.inv_v) if fp8_out else out  # e4m3 codes at V's scale


@torch.inference_mode()
def quantized_reference(model: Transformer, cache: KVCache, tokens: list[int]) -> torch.Tensor:
    ids, positions, cu = pack([tokens], "cpu")
    return model.compute_logits(model(ids, positions, QuantizedDense(cache, cu)))


def fp8(**kw: object) -> KVConfig:
    return KVConfig(**{"page_size": P, "num_pages": 128, "max_requests": 4, "dtype": FP8_KV_DTYPE, **kw})  # type: ignore[arg-type]


def test_an_fp8_cache_takes_half_the_bytes_and_one_scale_pair_per_layer() -> None:
    cfg = tiny_config("SSFS")
    bf16 = KVCache(cfg, KVConfig(page_size=P, num_pages=8, max_requests=2, dtype=torch.bfloat16))
    cache = KVCache(cfg, fp8(num_pages=8, max_requests=2, scales=SCALES))
    assert cache.k_pages.dtype == cache.v_ring.dtype == FP8_KV_DTYPE
    assert 2 * cache.page_bytes() == bf16.page_bytes()
    assert 2 * KVCache.window_pool_bytes(cfg, 2, FP8_KV_DTYPE) - 4 * 3 * 3 * W == KVCache.window_pool_bytes(
        cfg, 2, torch.bfloat16
    )  # ring positions stay int32: 3 sliding layers x 3 slots x W
    assert cache.quant[1] == KVQuant(0.5, 0.01) and len(cache.scale_values) == 8
    assert all(q is None for q in bf16.quant) and bf16.scale_values == ()
    assert KVCache(cfg, fp8()).quant == (KVQuant(),) * 4
    with pytest.raises(ValueError, match=r"2 \(k_scale, v_scale\) pairs for 4 layers"):
        KVCache(cfg, fp8(scales=SCALES[:2]))
    with pytest.raises(ValueError, match="FP8 cache's"):
        KVConfig(scales=SCALES)  # float32: no scales
    with pytest.raises(ValueError, match="positive float32"):
        fp8(scales=((1.0, 0.0),) * 4)
    with pytest.raises(ValueError, match=r"KVConfig\.dtype"):
        KVConfig(dtype=torch.float8_e5m2)


def _runner(layout: str, scales: tuple, rope_in_attention: bool) -> tuple[Transformer, KVCache, ModelRunner]:
    cfg = tiny_config(layout)
    model = tiny_model(cfg)
    cache = KVCache(cfg, fp8(scales=scales))
    return model, cache, ModelRunner(model, cache, rope_in_attention=rope_in_attention)


@pytest.mark.parametrize("layout", ["SSFS", "FSFS", "SSSS"])
@pytest.mark.parametrize("scales", [(), SCALES], ids=["scale-1", "per-layer"])
@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_teacher_forced_logits_are_the_dense_models_over_quantized_kv(
    layout, scales, rope_in_attention
) -> None:
    model, cache, runner = _runner(layout, scales, rope_in_attention)
    lengths, chunk = [W - 1, 3 * W + 2, 1, 2 * W + 3], 5
    seqs = [Seq(cache, i, random_tokens(n + 6, seed=40 + i)) for i, n in enumerate(lengths)]
    wants = [quantized_reference(model, cache, s.tokens) for s in seqs]
    plain = [reference(model, s.tokens) for s in seqs]
    while any(s.done < n for s, n in zip(seqs, lengths, strict=True)):  # chunked prefill, then decode
        live = [(s, w, p) for s, w, p, n in zip(seqs, wants, plain, lengths, strict=True) if s.done < n]
        n_of = {id(s): min(chunk, n - s.done) for s, n in zip(seqs, lengths, strict=True) if s.done < n}
        logits = run(runner, [s.chunk(n_of[id(s)]) for s, _, _ in live], Mode.EXTEND)
        for row, (s, want, _) in zip(logits, live, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], **ORACLE)
    rows, fp32_rows = [], []
    for _ in range(6):
        logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
        for row, s, want, fp32 in zip(logits, seqs, wants, plain, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], **ORACLE)
            rows.append(row)
            fp32_rows.append(fp32[s.done - 1])
    # Against the float32 cache, the quantization's own error (e4m3 keeps 3 mantissa bits: within 6.25%
    # of the value stored). These random weights make attention sharp and logits close (they are
    # chosen so that an off-by-one shows), which magnifies it: measured, a mean |difference| of
    # 0.13-0.16 of the logits' spread and a KL of 0.06-0.07 nats. The accuracy that matters is a real
    # model's: tests/engine/test_fp8_kv_perplexity.py.
    got, fp32_logits = torch.stack(rows), torch.stack(fp32_rows)
    spread = (got - fp32_logits).abs().mean() / fp32_logits.std(dim=-1).mean()
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), fp32_logits.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert spread < 0.25 and kl < 0.15, (float(spread), float(kl))


@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_with_fp8_weights_the_o_projection_takes_attentions_e4m3_codes(rope_in_attention: bool) -> None:
    """FP8 projections over an FP8 cache: attention hands the o projection its output as e4m3 codes at
    V's scale, no quantizer between them. Teacher-forced through chunked prefill, mixed steps and
    decode, the engine computes what the dense oracle computes with its output quantized so (a
    per-token quantizer in its place moves these logits by far more than the tolerance)."""
    from shared.model.quant import quantize_model

    model, cache, _ = _runner("SFSF", SCALES, rope_in_attention)
    model = quantize_model(model, "fp8")
    runner = ModelRunner(model, cache, rope_in_attention=rope_in_attention)
    prompts, chunk = [2 * W + 3, 2, W + 1], 4
    seqs = [Seq(cache, i, random_tokens(n + 12, seed=60 + i)) for i, n in enumerate(prompts)]
    wants = [quantized_reference(model, cache, s.tokens) for s in seqs]
    steps = 0
    while steps < 3 * W:  # prompts in chunks, the finished ones decoding beside them (mixed steps)
        decoding = [(s, w, 1) for s, w, n in zip(seqs, wants, prompts, strict=True) if s.done >= n]
        prefilling = [(s, w, min(chunk, n - s.done)) for s, w, n in zip(seqs, wants, prompts, strict=True)
                      if s.done < n]  # fmt: skip
        if not prefilling:
            break
        live = decoding + prefilling  # decode rows first, as the scheduler lays out a mixed step
        logits = run(runner, [s.chunk(n) for s, _, n in live], Mode.EXTEND)
        for row, (s, want, _) in zip(logits, live, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], **ORACLE)
        steps += 1
    for _ in range(3):
        logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], **ORACLE)


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out = [engine.generate([p], GREEDY)[0].output for p in prompts]
    engine.check_idle_integrity()
    return out


@pytest.mark.parametrize("layout", ["SSFS", "SFSF"])
def test_the_prefix_caches_snapshots_restore_fp8_windows(layout: str) -> None:
    """Turns that extend earlier prompts: their hits restore the sliding layers' FP8 rings from
    snapshots kept in FP8 pages (copied as bytes), and decode as the FP8 engine without the cache."""
    base = random_tokens(40, seed=5)
    first = base[:24]
    prompts = [first, [*first, 5, 6, 7], [*base[:12], 9, 9], [*first, 5, 6, 7, 1, 2, 3, 4, 5]]

    def make(cache: bool) -> Engine:
        return Engine(tiny_model(tiny_config(layout)), fp8(scales=SCALES), EngineConfig(prefix_cache=cache))

    cached = make(True)
    got = _generate(cached, prompts[:1])
    assert cached.kv.prefix is not None and cached.kv.prefix.num_snapshots >= 1
    turn = cached.add_request(prompts[1], GREEDY)
    cached.step()
    assert turn.cached_tokens == 24  # the prefix's pages and its snapshot's window
    run_to_end(cached)
    cached.free_finished()
    got += [turn.output, *_generate(cached, prompts[2:])]
    assert got == _generate(make(False), prompts)


def _held(engine: Engine, prompt: list[int]):  # type: ignore[no-untyped-def]
    p = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while not p.finished:
        engine.step()
    engine.flush()
    return p


@pytest.mark.parametrize("history", [True, False], ids=["window-shipped", "replay"])
def test_inline_ships_fp8_bytes_and_decode_continues_like_one_fp8_engine(history: bool) -> None:
    cfg, n = tiny_config("SSFS"), 3 * W + 5
    prompt = random_tokens(n, seed=11)

    def make(kv: KVConfig, dtype: torch.dtype = torch.float32) -> Engine:
        return Engine(tiny_model(cfg).to(dtype), kv, EngineConfig(max_batch_tokens=16))

    prefill, decode = make(fp8(scales=SCALES)), make(fp8(scales=SCALES))
    [want] = make(fp8(scales=SCALES)).generate([prompt], GREEDY)
    p, d = _held(prefill, prompt), decode.reserve(prompt, GREEDY)
    assert d is not None
    begin_receive(decode.cache, d.slot)
    chunks = list(extract_chunks(prefill.cache, p.pages, p.slot, n, window=history))
    for chunk in chunks:
        apply_chunk(decode.cache, d.pages, d.slot, chunk)
    full = torch.tensor(d.pages[: decode.cache.pages_needed(n)])
    src = torch.tensor(p.pages[: prefill.cache.pages_needed(n)])
    for name in ("k_pages", "v_pages"):  # the same bytes landed (the page tail past n is never read)
        a, b = (getattr(c.cache, name).view(torch.uint8)[:, i].flatten(1, 2)[:, :n] for c, i in
                ((decode, full), (prefill, src)))  # fmt: skip
        assert torch.equal(a, b)
    prefill.release(p)
    decode.admit_prefilled(d, p.output[0], history=history)
    run_to_end(decode)
    assert d.output == want.output
    decode.check_idle_integrity()

    bf16 = make(KVConfig(page_size=P, num_pages=128, max_requests=4, dtype=torch.bfloat16), torch.bfloat16)
    q = _held(bf16, prompt)
    bf16_bytes = sum(c.nbytes for c in extract_chunks(bf16.cache, q.pages, q.slot, n, window=history))
    assert 2 * sum(c.nbytes for c in chunks) == bf16_bytes


def test_the_layout_names_the_kv_dtype_and_the_scales() -> None:
    cfg = tiny_config("SSFS")
    bf16 = KVLayout.of(KVCache(cfg, KVConfig(page_size=P, num_pages=4, dtype=torch.bfloat16)), "m", "w")
    ones = KVLayout.of(KVCache(cfg, fp8(num_pages=4)), "m", "w")
    calibrated = KVLayout.of(KVCache(cfg, fp8(num_pages=4, scales=SCALES)), "m", "w")
    assert (bf16.dtype, bf16.kv_scale_kind, bf16.kv_scales) == ("bfloat16", "", ())
    assert (ones.dtype, ones.kv_scale_kind, ones.kv_scales) == ("float8_e4m3fn", "per_tensor", (1.0,) * 8)
    assert KVLayout.from_pb(calibrated.to_pb()) == calibrated  # doubles: the float32 values exactly
    assert mismatches(bf16, ones)[0] == "dtype: 'bfloat16' != 'float8_e4m3fn'"
    assert [m.split(":")[0] for m in mismatches(bf16, ones)] == ["dtype", "kv_scale_kind", "kv_scales"]
    (line,) = mismatches(ones, calibrated)
    assert line.startswith("kv_scales: (1.0, 1.0,") and line.endswith(
        "(first at [0]: 1.0 != 0.019999999552965164)"
    )
    other = KVLayout.of(KVCache(cfg, fp8(num_pages=4, scales=(*SCALES[:3], (1.5, 0.08)))), "m", "w")
    assert mismatches(calibrated, other)[0].endswith(
        "(first at [7]: 0.03999999910593033 != 0.07999999821186066)"
    )


def test_checkpoint_scales_are_read_for_every_layer_or_not_at_all(tmp_path) -> None:
    from safetensors.torch import save_file

    from shared.serving.kv_scales import checkpoint_kv_scales

    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_kv_scales(str(tmp_path), 2) == ()  # no safetensors with scales: 1.0
    assert checkpoint_kv_scales("", 2) == () and checkpoint_kv_scales("random:{}", 2) == ()
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale":
               torch.tensor([0.25]), "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}  # fmt: skip
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert checkpoint_kv_scales(str(tmp_path), 2) == ((0.5, 0.25), (2.0, 4.0))
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="cover 1 of 4"):
        checkpoint_kv_scales(str(tmp_path), 2)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="positive"):
        checkpoint_kv_scales(str(tmp_path), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["SSFS", "FSFS"])
@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_on_cuda_the_triton_path_matches_the_quantized_reference(layout, rope_in_attention) -> None:
    """Triton's FP8 stores (RoPE's, store_kv, RoPE inside decode attention) and reads, compiled."""
    cfg = tiny_config(layout)
    cpu_model, cpu_cache = tiny_model(cfg), KVCache(cfg, fp8(scales=SCALES))
    model = tiny_model(cfg).cuda()
    cache = KVCache(cfg, dataclasses.replace(fp8(scales=SCALES), device="cuda"))
    runner = ModelRunner(model, cache, rope_in_attention=rope_in_attention)
    lengths = [W - 1, 3 * W + 2, 1, 40]
    seqs = [Seq(cache, i, random_tokens(n + 5, seed=20 + i)) for i, n in enumerate(lengths)]
    wants = [quantized_reference(cpu_model, cpu_cache, s.tokens) for s in seqs]
    items = [s.chunk(n) for s, n in zip(seqs, lengths, strict=True)]
    for step in range(6):
        logits = run(runner, items, Mode.EXTEND if step == 0 else Mode.DECODE).cpu()
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=2e-2, atol=2e-2)  # tf32 dots
        items = [s.chunk(1) for s in seqs]


@pytest.mark.gpu
def test_an_fp8_engine_on_cuda_decodes_in_graphs_as_eagerly_and_frees_everything() -> None:
    cfg = tiny_config("SSFS")
    kv = dataclasses.replace(fp8(scales=SCALES, num_pages=64), device="cuda")
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 50)]
    outs = []
    for sizes in ((1, 2, 4), ()):
        engine = Engine(
            tiny_model(cfg).cuda(),
            kv,
            EngineConfig(cuda_graph_sizes=sizes, prefix_cache=True, tune_gemms=False),
        )
        outs.append([r.output for r in engine.generate(prompts, GREEDY)])
        engine.check_idle_integrity()
    assert outs[0] == outs[1]
