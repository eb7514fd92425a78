"""Gemma 3: our decoder against transformers' Gemma3ForCausalLM, on random-weight checkpoints built with
transformers' own Gemma3TextConfig and on the real Gemma 3 270M GGUF.

What makes it Gemma: local/global layers (`layer_types` or `sliding_window_pattern`), a RoPE base per
layer type (and linear scaling on the global ones), q/k norms, (1 + w) norms around both sublayers,
embeddings times sqrt(hidden), GeGLU (GELU-tanh), query_pre_attn_scalar, final logit softcapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_testutil import TINY, WINDOW, gemma3_gguf_or_skip, save_hf_model, transformers_reads_gguf

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.kernels.attention import ops_for
from shared.model import FULL, SLIDING, DenseAttention, config_from_hf, load_model, pack, reference_logits

ABS_TOL = 1e-4
S, F = SLIDING, FULL
CASES = {
    # Every 2nd layer full (the pattern, as older configs give it); query_pre_attn_scalar's default
    # 256, not head_dim 16, scales the scores.
    "pattern": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "linear-rope-softcap-bias": dict(
        sliding_window=WINDOW,
        layer_types=[F, S, S, F],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=100.0,
        query_pre_attn_scalar=24,
        final_logit_softcapping=20.0,
        attention_bias=True,
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    return request.param, path, save_hf_model(path, "Gemma3TextConfig", **CASES[request.param])


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_the_config_is_read_as_transformers_reads_it(case) -> None:
    _, path, hf = case
    cfg, their = load_model(path).config, hf.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_types == tuple(their.layer_types)
    assert cfg.sliding_window == WINDOW and cfg.tie_word_embeddings
    assert cfg.rope_local_layers == tuple(i for i, t in enumerate(their.layer_types) if t == S)
    assert cfg.rope_theta == their.rope_parameters[F]["rope_theta"]
    assert cfg.rope_local_theta == their.rope_parameters[S]["rope_theta"]
    assert cfg.attn_scale == their.query_pre_attn_scalar**-0.5
    assert cfg.final_logit_softcapping == their.final_logit_softcapping
    assert cfg.hidden_act == "gelu_tanh" and cfg.qk_norm and cfg.sandwich_norms and cfg.scale_embeddings


def test_an_older_config_json_reads_the_same() -> None:
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern at the top level, no
    layer_types: what transformers 4 wrote, and what Gemma3TextConfig still takes."""
    from transformers import Gemma3TextConfig

    old = dict(
        TINY, num_hidden_layers=6, sliding_window=WINDOW, sliding_window_pattern=3, rope_theta=5e5,
        rope_local_base_freq=2e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    cfg = config_from_hf({"architectures": ["Gemma3ForCausalLM"], **old})
    their = Gemma3TextConfig(**old)
    assert cfg.layer_types == tuple(their.layer_types) == (S, S, F, S, S, F)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (5e5, 2e4)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)  # type: ignore[union-attr]
    assert their.rope_parameters[F]["factor"] == 4.0 and their.rope_parameters[S]["rope_theta"] == 2e4


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ({"use_bidirectional_attention": True}, "not causal"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ],
)
def test_what_we_do_not_implement_is_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_hf({"architectures": ["Gemma3ForCausalLM"], **TINY, **change})


@pytest.mark.parametrize("length", ["W-1", "W", "W+1", "3W+2"])
def test_logits_match_transformers(case, prompts, length: str) -> None:
    _, path, hf = case
    ids = prompts[length]
    assert max_abs(reference_logits(load_model(path).model, [ids])[0], hf_logits(hf, ids)) <= ABS_TOL


def test_window_w_and_w_plus_1_differ(case, prompts) -> None:
    """An off-by-one in the window would show: W and W+1 agree until a query sees W+1 keys, then differ
    far above the parity tolerance (on the sliding layers' output, whichever RoPE base they use)."""
    _, path, _ = case
    ids = prompts["W+1"]
    exact = reference_logits(load_model(path).model, [ids])[0]
    wider = reference_logits(load_model(path, sliding_window=WINDOW + 1).model, [ids])[0]
    assert max_abs(wider[:-1], exact[:-1]) <= 1e-5
    assert max_abs(wider[-1], exact[-1]) > 100 * ABS_TOL


def _dense_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):  # full recompute each step: the dense reference has no KV cache
        out.append(int(reference_logits(model, [prompt + out])[0][-1].argmax()))
    return out


@pytest.mark.parametrize("kernels", ["torch", "triton-folded"])
def test_the_engine_generates_what_the_dense_reference_does(case, prompts, kernels: str) -> None:
    """Paged KV, sliding-window rings, chunked prefill across the window, decode. `triton-folded` is
    the CUDA path on CPU (interpreted): norms folded into the GEMMs, fused RoPE + q/k norm, RoPE inside
    decode attention, the GeGLU kernel, the sublayer output norms unfolded."""
    _, path, _ = case
    model = load_model(path).model
    prompt = prompts["3W+2"]
    # Chunks of W - 1 tokens: every chunk but the first reads ring history, and one crosses the window.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = _dense_greedy(model, prompt, params.max_tokens)
    if kernels == "triton-folded":
        model.fold_norms()
        model.kernel_backend = "triton"
    kv = KVConfig(page_size=4, num_pages=32, max_requests=2)
    engine = Engine(model, kv, EngineConfig(max_batch_tokens=WINDOW - 1))
    if kernels == "triton-folded":
        engine.runner.ops = ops_for("cpu", backend="triton")
    [req] = engine.generate([prompt], params)
    assert req.output == want
    engine.check_idle_integrity()


# ---------------------------------------------------------------------------------------------------------
# W = 512, as the real checkpoint's: rings, bounded replay and prefix-cache snapshots on a tiny model

BIG_W = 512


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gemma3-w512")
    wide = dict(sliding_window=BIG_W, sliding_window_pattern=2, max_position_embeddings=4 * BIG_W)
    save_hf_model(path, "Gemma3TextConfig", **wide)
    return path


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: Path, prefix_cache: bool = False) -> Engine:
    kv = KVConfig(page_size=16, num_pages=160, max_requests=2)
    return Engine(load_model(path).model, kv, EngineConfig(max_batch_tokens=300, prefix_cache=prefix_cache))


@pytest.mark.parametrize("history", [True, False], ids=["window-shipped", "bounded-replay"])
def test_a_handoff_at_w_512_decodes_as_one_engine(wide, history: bool) -> None:
    """Prefill in one engine, the KV copied into another's reservation: the full layers' pages, and the
    rings' last W tokens or (without them) a replay of them."""
    prompt = _tokens(2 * BIG_W + 77, seed=3)
    [want] = _engine(wide).generate([prompt], GREEDY)
    prefill, decode = _engine(wide), _engine(wide)
    p = prefill.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    d = decode.reserve(prompt, GREEDY)
    assert d is not None
    while not p.finished:
        prefill.step()
    prefill.flush()
    n = decode.cache.pages_needed(len(prompt))
    src, dst = torch.tensor(p.pages[:n]), torch.tensor(d.pages[:n])
    decode.cache.k_pages[:, dst] = prefill.cache.k_pages[:, src]
    decode.cache.v_pages[:, dst] = prefill.cache.v_pages[:, src]
    if history:
        for name in ("k_ring", "v_ring", "ring_pos"):
            getattr(decode.cache, name)[:, d.slot] = getattr(prefill.cache, name)[:, p.slot]
    prefill.release(p)
    decode.admit_prefilled(d, p.output[0], history=history)
    while not decode.idle:
        decode.step()
    assert d.output == want.output
    decode.check_idle_integrity()


def test_a_second_turn_at_w_512_restores_the_window_from_a_snapshot(wide) -> None:
    first = _tokens(BIG_W + 208, seed=4)  # whole pages: the hit ends where it does
    second = [*first, *_tokens(40, seed=5)]
    engine = _engine(wide, prefix_cache=True)
    engine.generate([first], GREEDY)
    assert engine.kv.prefix.num_snapshots >= 1  # type: ignore[union-attr]
    [turn] = engine.generate([second], GREEDY)
    assert turn.cached_tokens == len(first)
    [want] = _engine(wide).generate([second], GREEDY)
    assert turn.output == want.output
    engine.check_idle_integrity()


# ---------------------------------------------------------------------------------------------------------
# The real checkpoint: Gemma 3 270M, Q4_K_M


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_gguf_or_skip()


@pytest.fixture(scope="module")
def gemma_reader(gemma_path: Path) -> Callable[[str | Path], object]:
    """In place of opening the file: its header parsed once for the module, by the reader our loader
    makes (gguf's GGUFReader over plain views of the memory map). Every field, the 262k-token vocabulary
    included, takes seconds to parse, and three loads below would parse it (ours, and transformers'
    config and weights). The reader is read only: each load still reads the metadata and dequantizes the
    tensors itself."""
    from shared.model import gguf_loader

    reader = gguf_loader._reader(gemma_path)

    def parsed(path: str | Path) -> object:
        assert Path(path) == gemma_path, path
        return reader

    return parsed


@pytest.fixture(scope="module")
def gemma(gemma_path: Path, gemma_reader):
    from shared.model import gguf_loader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_loader, "_reader", gemma_reader)
        return load_model(gemma_path, progress=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path: Path, gemma_reader):
    """transformers loading the same file: its own reading of the metadata, gguf's dequantization.

    It opens the file twice (the config, then the weights): both times the module's reader, and gguf's
    tensor name map built once rather than for each of its modules (`transformers_reads_gguf`)."""
    from transformers import AutoModelForCausalLM

    with transformers_reads_gguf(gemma_path, gemma_reader(gemma_path)):
        model = AutoModelForCausalLM.from_pretrained(
            gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32, attn_implementation="eager"
        )
    return model.eval()


LONG_TEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(50))


def test_real_checkpoint_config(gemma) -> None:
    cfg = gemma.config
    assert gemma.name == "gemma-3-270m" and cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.layer_types == ((S,) * 5 + (F,)) * 3 and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.rope_local_layers == cfg.sliding_layers and cfg.attn_scale == 256**-0.5
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and cfg.eos_token_ids == (1,)


def test_real_checkpoint_tokenizer_and_chat_template(gemma) -> None:
    tok = gemma.tokenizer
    text = "Hello world,  how are   you?\n\tTabs <start_of_turn>user ünïcödé 😀 1234567"
    # transformers' GGUF tokenizer (GemmaTokenizer from the file) gives these ids
    assert tok.encode(text) == [
        2, 9259, 1902, 236764, 138, 7843, 659, 139, 7624, 236881, 107, 255968, 76222, 236743, 105, 2364,
        174898, 238527, 236755, 55515, 236859, 163543, 236743, 236770, 236778, 236800, 236812, 236810,
        236825, 236832,
    ]  # fmt: skip
    assert tok.decode(tok.encode(text)) == text.replace("<start_of_turn>", "")
    # The file has no template: Gemma 3's own, which ends a turn with <end_of_turn> (106).
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert chat == "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode_chat([{"role": "user", "content": "Hi!"}])[:2] == [2, 105]
    assert tok.end_of_turn_ids == (106,)


def _our_rows(loaded, ids: list[int], rows: list[int]) -> torch.Tensor:
    model = loaded.model
    with torch.inference_mode():
        flat, positions, cu = pack([ids], "cpu")
        hidden = model(flat, positions, DenseAttention(model.cfg, cu))
        return model.compute_logits(hidden[rows])


@pytest.mark.slow
def test_real_checkpoint_logits_match_transformers_past_the_window(gemma, hf_gemma) -> None:
    ids = gemma.tokenizer.encode(LONG_TEXT)
    assert len(ids) > 512
    rows = [0, 255, 510, 511, 512, 513, len(ids) - 1]  # up to, at, and past the window
    with torch.no_grad():
        theirs = hf_gemma(torch.tensor([ids]), logits_to_keep=torch.tensor(rows)).logits[0].float()
    assert max_abs(_our_rows(gemma, ids, rows), theirs) <= ABS_TOL


@pytest.mark.slow
def test_real_checkpoint_greedy_tokens_equal_transformers(gemma, hf_gemma) -> None:
    """The engine (paged KV, 512-token rings, chunked prefill) against transformers' generate."""
    prompt = gemma.tokenizer.encode(LONG_TEXT)
    engine = Engine(gemma.model, KVConfig(page_size=16, num_pages=64, max_requests=1), EngineConfig())
    [ours] = engine.generate([prompt], GREEDY)
    with torch.no_grad():
        out = hf_gemma.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    assert ours.output == out[0, len(prompt) :].tolist()
    assert "Line 50" in gemma.tokenizer.decode(ours.output)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_checkpoint_on_cuda_decodes_as_on_cpu(gemma_path: Path, gemma, dtype: torch.dtype) -> None:
    """The CUDA path: Triton kernels, norms folded into the GEMMs, RoPE and the q/k norm inside decode
    attention, the GeGLU kernel, decode CUDA graphs. float32: the CPU engine's greedy tokens; bfloat16
    (what --dtype auto serves on a GPU): the same text continued."""
    cuda = load_model(gemma_path, device="cuda", dtype=dtype, progress=False)
    prompt = gemma.tokenizer.encode(LONG_TEXT)
    kv = KVConfig(page_size=16, num_pages=64, max_requests=1)
    [want] = Engine(gemma.model, kv, EngineConfig()).generate([prompt], GREEDY)
    engine = Engine(
        cuda.model, dataclasses.replace(kv, dtype=dtype, device="cuda"),
        EngineConfig(cuda_graph_sizes=(1,), tune_gemms=False),
    )  # fmt: skip
    assert engine.runner.model.norms_folded
    [got] = engine.generate([prompt], GREEDY)
    if dtype == torch.float32:
        assert got.output == want.output
    assert "Line 50" in gemma.tokenizer.decode(got.output)
