"""Through the KV cache and RequestWindow rings, the engine computes what one dense pass computes.

Teacher-forced: a prompt is prefilled in chunks, then decoded token by token, and every logit row the
runner produces is compared with the dense reference over the whole sequence (fp32).
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.window import RequestWindow
from shared.engine.runner import ModelRunner, expected_positions
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import W, random_tokens, reference, tiny_config, tiny_model

PAGE = 4
LAYOUTS = ["SSFS", "SSSS", "FFFF", "FSFS"]


class Seq:
    """One request driven by hand through a runner: pages, a window, a cursor."""

    def __init__(self, cache: KVCache, owner: int, tokens: list[int]) -> None:
        self.tokens = tokens
        self.window = RequestWindow(cache, owner)
        self.pages = cache.pages.alloc(owner, cache.pages_needed(len(tokens)))
        self.done = 0

    def chunk(self, n: int) -> ChunkItem:
        item = ChunkItem(self.window.slot, self.done, self.tokens[self.done : self.done + n], self.pages)
        self.done += n
        return item


def run(runner: ModelRunner, items: list[ChunkItem], mode: Mode) -> torch.Tensor:
    batch = ForwardBatch.build(items, mode, runner.cache)
    return runner.forward(batch, None, return_logits=True).logits


def make(layout: str, max_requests: int = 4, fold: bool = False):
    """A CPU runner; with `fold`, over a model with its norms folded (as a CUDA runner folds them)."""
    cfg = tiny_config(layout)
    model = tiny_model(cfg)
    if fold:
        model.fold_norms()
    cache = KVCache(cfg, KVConfig(page_size=PAGE, num_pages=128, max_requests=max_requests))
    return model, cache, ModelRunner(model, cache)


def test_the_window_matters_for_these_weights():
    # Guard sensitivity: windows W and W+1 give different logits, so an off-by-one would show.
    tokens = random_tokens(3 * W)
    a = reference(tiny_model(tiny_config("SSFS", window=W)), tokens)
    b = reference(tiny_model(tiny_config("SSFS", window=W + 1)), tokens)
    assert (a[-1] - b[-1]).abs().max() > 1e-2 * a[-1].abs().max()


PROMPT_LENS = [W - 1, W, W + 1, 3 * PAGE, 2 * W + 3]
CHUNKS = [3, W - 1, W, W + 1, 64]
# Every chunk at least as long as the prompt prefills it in one chunk, the same batches whichever it is:
# the shortest of them runs it.
CHUNKINGS = [(n, c) for n in PROMPT_LENS for c in CHUNKS if c < n or c == min(x for x in CHUNKS if x >= n)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("prompt_len", "chunk"), CHUNKINGS)
def test_chunked_prefill_then_decode_matches_one_dense_pass(layout, prompt_len, chunk):
    assert_chunked_prefill_then_decode(*make(layout), prompt_len, chunk)


@pytest.mark.parametrize("chunk", [3, W + 1])
def test_with_the_norms_folded_chunked_prefill_then_decode_matches_one_dense_pass(chunk):
    assert_chunked_prefill_then_decode(*make("SSFS", fold=True), 2 * W + 3, chunk)


def assert_chunked_prefill_then_decode(model, cache, runner, prompt_len: int, chunk: int) -> None:
    tokens = random_tokens(prompt_len + 6, seed=prompt_len)
    want = reference(model, tokens)
    seq = Seq(cache, 0, tokens)
    while seq.done < prompt_len:
        logits = run(runner, [seq.chunk(min(chunk, prompt_len - seq.done))], Mode.EXTEND)
        torch.testing.assert_close(logits[0], want[seq.done - 1], rtol=1e-4, atol=1e-4)
    while seq.done < len(tokens):
        logits = run(runner, [seq.chunk(1)], Mode.DECODE)
        torch.testing.assert_close(logits[0], want[seq.done - 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("layout", ["SSFS", "FSFS"])
def test_a_mixed_batch_equals_each_sequence_alone(layout, fold):
    model, cache, runner = make(layout, fold=fold)
    lengths = [W - 1, 2 * W + 5, 1, W + 1]
    seqs = [Seq(cache, i, random_tokens(n + 4, seed=10 + i)) for i, n in enumerate(lengths)]
    wants = [reference(model, s.tokens) for s in seqs]
    logits = run(runner, [s.chunk(n) for s, n in zip(seqs, lengths, strict=True)], Mode.EXTEND)
    for row, s, want in zip(logits, seqs, wants, strict=True):
        torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)
    for _ in range(4):
        logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("layout", ["SSFS", "SFFF", "SSSS"])
def test_bounded_replay_rebuilds_the_history_a_single_pass_computed(layout, fold):
    model = tiny_model(tiny_config(layout))
    if fold:  # replay steps scale q/k/v in a kernel of their own (no RoPE inside attention there)
        model.fold_norms()
    kv = KVConfig(page_size=PAGE, num_pages=128, max_requests=2)
    engine = Engine(model, kv, EngineConfig(max_batch_tokens=16))
    prompt = random_tokens(5 * W + 3, seed=3)
    [req] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    req2 = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    while req2.num_computed < len(prompt):
        engine.step()
    engine.flush()  # nothing in flight while the rings are compared and rebuilt
    cache, slot = engine.cache, req2.slot
    k, v, pos = (t[:, slot].clone() for t in (cache.k_ring, cache.v_ring, cache.ring_pos))
    replayed = engine.rebuild_window(req2)  # clears the rings, then recomputes
    assert 0 < replayed < len(prompt) or layout == "SSSS"
    assert torch.equal(cache.ring_pos[:, slot], pos)
    torch.testing.assert_close(cache.k_ring[:, slot], k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v_ring[:, slot], v, rtol=1e-5, atol=1e-5)
    while not req2.finished:  # and decoding goes on from the rebuilt history
        engine.step()
    assert req2.output[0] == req.output[0]


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_engine_greedy_generation_matches_the_reference_and_frees_everything():
    model = tiny_model(tiny_config("SSFS"))
    kv = KVConfig(page_size=PAGE, num_pages=128, max_requests=3)
    engine = Engine(model, kv, EngineConfig(max_batch_tokens=10))
    prompts = [random_tokens(n, seed=n) for n in (W - 1, 2 * W + 1, 3, W)]  # 4 requests, 3 slots: one waits
    reqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.finish_reason == "length"
        assert req.output == greedy_reference(model, prompt, 8)
    engine.check_idle_integrity()


@pytest.mark.parametrize("fold", [False, True])
def test_the_triton_kernels_through_the_runner_match_too(fold: bool):
    # On CPU the Triton kernels run in the interpreter: the same wrappers and views as on a GPU. With
    # `fold`, the model as a CUDA runner makes it (EngineConfig.fold_norms), its kernels Triton's.
    from shared.kernels.attention import ops_for

    cfg = tiny_config("SSFS")
    model = tiny_model(cfg)
    cache = KVCache(cfg, KVConfig(page_size=PAGE, num_pages=32, max_requests=2))
    seqs = [Seq(cache, 0, random_tokens(W + 5, seed=4)), Seq(cache, 1, random_tokens(W + 5, seed=5))]
    wants = [reference(model, s.tokens) for s in seqs]
    if fold:
        model.fold_norms()
        model.kernel_backend = "triton"
    runner = ModelRunner(model, cache, ops_for(cache.device, backend="triton"))
    logits = run(runner, [seqs[0].chunk(W + 2), seqs[1].chunk(3)], Mode.EXTEND)
    for row, s, want in zip(logits, seqs, wants, strict=True):
        torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)
    logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
    for row, s, want in zip(logits, seqs, wants, strict=True):
        torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)


def test_a_runner_folds_the_mlp_norms_on_cuda_only_and_never_undoes_a_fold():
    model, cache, _ = make("SSFS")
    assert not model.norms_folded, "on a CPU the model stays as it was given"
    model.fold_norms()
    with pytest.raises(ValueError, match="fold_norms=False, but the model's norms are folded already"):
        ModelRunner(model, cache, fold_norms=False)


@pytest.mark.parametrize(
    ("variant", "rope_in_attention"),
    [("llama", True), ("qwen3-qk-norm", True), ("one-kv-head", True), ("llama", False)],
)
def test_decode_with_rope_storing_kv_in_one_kernel_matches_the_reference_past_the_window(
    variant, rope_in_attention
):
    # Triton kernels: a decode step's attention applies RoPE (and the q/k norm) and writes each layer's
    # K/V into the pages and rings itself (`BatchAttention.takes_rope`), or (False) the RoPE kernel
    # does (`store_target`), a sliding layer's before its attention, where the token's ring index
    # still holds position L - W (its q/k norm and head layouts: tests/model/test_model_kernels.py).
    # Four steps wrap both rings: the first sequence's from its first step (W - 1 prompt tokens), the
    # second's from its third (W - 3), and its first two steps still write into a ring not yet full.
    import dataclasses

    from shared.kernels.attention import ops_for

    # Two sliding layers and a full one between them: each layer's rings and pages found by its index
    # among its kind, not its own.
    cfg = tiny_config("SFS")
    if variant == "qwen3-qk-norm":  # the kernel norms each head of q and k before rotating and storing
        cfg = dataclasses.replace(cfg, qk_norm=True)
    elif variant == "one-kv-head":  # four query heads share one stored K/V head
        cfg = dataclasses.replace(cfg, num_kv_heads=1)
    model = tiny_model(cfg)
    cache = KVCache(cfg, KVConfig(page_size=PAGE, num_pages=32, max_requests=2))
    seqs = [Seq(cache, 0, random_tokens(3 * W + 1, seed=6)), Seq(cache, 1, random_tokens(3 * W + 1, seed=7))]
    # The dense reference through torch's kernels, as every other test here takes it (not interpreted:
    # Triton's kernels in it were most of this test's time, and the reference would share their errors).
    wants = [reference(model, s.tokens) for s in seqs]
    # Triton's RoPE and norm kernels; the layers' GEMMs torch's (the skinny GEMM's own tests, and the
    # runner's above, take it): the interpreter runs what this test is about.
    model.kernel_backend, model.gemm_backend = "triton", "cublas"
    runner = ModelRunner(
        model, cache, ops_for(cache.device, backend="triton"), rope_in_attention=rope_in_attention
    )
    run(runner, [seqs[0].chunk(W - 1), seqs[1].chunk(W - 3)], Mode.EXTEND)
    for _ in range(4):
        logits = run(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)


def test_rows_padding_a_graph_batch_change_nothing_for_the_real_ones():
    # What a CUDA graph of 6 rows sees for 2 sequences, run eagerly here: the padding rows point at the
    # scratch slot, store nothing, and leave its ring empty.
    model, cache, runner = make("SSFS")
    seqs = [Seq(cache, i, random_tokens(2 * W + 4, seed=30 + i)) for i in range(2)]
    wants = [reference(model, s.tokens) for s in seqs]
    run(runner, [s.chunk(2 * W) for s in seqs], Mode.EXTEND)
    for _ in range(4):
        items = [s.chunk(1) for s in seqs]
        batch = ForwardBatch.build(items, Mode.DECODE, cache, pad_to=6, table_width=12)
        assert (batch.num_seqs, batch.num_real, tuple(batch.block_table.shape)) == (6, 2, (6, 12))
        logits = runner.forward(batch, None, return_logits=True).logits
        assert logits.shape[0] == 2
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=1e-4, atol=1e-4)
    assert bool((cache.ring_pos[:, cache.scratch_slot] == -1).all())


@pytest.mark.parametrize("mode", [Mode.EXTEND, Mode.DECODE])
def test_tokens_out_of_position_trip_positions_consecutive(mode):
    from invariants import InvariantViolation, levels

    _, cache, runner = make("SSFS")
    seqs = [Seq(cache, i, random_tokens(12, seed=i)) for i in range(2)]
    if mode is Mode.DECODE:  # one token a row: the expected positions are the rows' starts
        runner.forward(ForwardBatch.build([s.chunk(5) for s in seqs], Mode.EXTEND, cache), None)
    batch = ForwardBatch.build([s.chunk(6 if mode is Mode.EXTEND else 1) for s in seqs], mode, cache)
    assert torch.equal(expected_positions(batch), batch.positions)
    batch.positions[-1] += 1  # a builder bug: a skipped position
    with levels("strict"), pytest.raises(InvariantViolation, match=r"engine.positions_consecutive"):
        runner.forward(batch, None)


def test_a_page_id_outside_the_pool_trips_page_ids_in_range_before_attention_reads_it():
    from invariants import InvariantViolation, levels

    _, cache, runner = make("SSFS")
    seq = Seq(cache, 0, random_tokens(12))
    batch = ForwardBatch.build([seq.chunk(6)], Mode.EXTEND, cache)
    batch.block_table[0, 1] = cache.cfg.num_pages  # one past the pool
    with levels("strict"), pytest.raises(InvariantViolation, match=r"kv.page_ids_in_range"):
        runner.forward(batch, None)
