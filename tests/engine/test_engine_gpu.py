"""On a CUDA device: the Triton path computes what the dense reference computes, with no host sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import invariants
from invariants import levels
from invariants.testing import no_host_sync
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingBatch, SamplingParams
from tests.engine.engine_testutil import W, build_batch, random_tokens, reference, tiny_config, tiny_model
from tests.engine.test_engine_parity import Seq

pytestmark = pytest.mark.gpu


def cuda_runner(
    layout: str = "SSFS", *, qk_norm: bool = False, rope_in_attention: bool = False, fold: bool = True
):  # fmt: skip
    cfg = dataclasses.replace(tiny_config(layout), qk_norm=qk_norm)
    cpu_model = tiny_model(cfg)
    model = tiny_model(cfg).cuda()
    cache = KVCache(cfg, KVConfig(page_size=16, num_pages=64, max_requests=8, device="cuda"))
    runner = ModelRunner(model, cache, rope_in_attention=rope_in_attention, fold_norms=fold)
    assert model.norms_folded == fold
    return cpu_model, cache, runner


@pytest.mark.parametrize(
    ("layout", "gemm", "qk_norm", "rope_in_attention", "fold"),
    [
        ("SSFS", "cublas", False, False, True),
        ("FSFS", "cublas", False, False, True),
        ("SSFS", "skinny", False, False, True),
        (
            "SSFS",
            "cublas",
            False,
            True,
            True,
        ),  # decode's RoPE inside attention (EngineConfig.rope_in_attention)
        ("FSFS", "cublas", False, True, True),
        ("SSFS", "cublas", True, True, True),  # with Qwen3's per-head norm
        ("SSFS", "cublas", False, True, False),  # the norms not folded (EngineConfig.fold_norms)
        ("FSFS", "skinny", False, False, False),
    ],
)
def test_triton_path_matches_the_reference_teacher_forced(layout, gemm, qk_norm, rope_in_attention, fold):
    cpu_model, cache, runner = cuda_runner(
        layout, qk_norm=qk_norm, rope_in_attention=rope_in_attention, fold=fold
    )
    runner.model.gemm_backend = gemm
    lengths = [W - 1, 3 * W + 2, 1, 40]
    seqs = [Seq(cache, i, random_tokens(n + 5, seed=20 + i)) for i, n in enumerate(lengths)]
    wants = [reference(cpu_model, s.tokens) for s in seqs]
    batch = ForwardBatch.build([s.chunk(n) for s, n in zip(seqs, lengths, strict=True)], Mode.EXTEND, cache)
    for step in range(6):
        logits = runner.forward(batch, None, return_logits=True).logits.cpu()
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=2e-2, atol=2e-2)  # tf32 dots
        if step < 5:
            batch = ForwardBatch.build([s.chunk(1) for s in seqs], Mode.DECODE, cache)


@pytest.mark.parametrize("layout", ["SSFS", "FSFS"])
def test_a_mixed_step_on_cuda_matches_the_reference(layout):
    # What `EngineConfig.mixed` schedules: decode rows first, then a prompt chunk, in one EXTEND
    # batch. The decode rows take the decode kernels, the chunk the prefill ones.
    cpu_model, cache, runner = cuda_runner(layout)
    old = [Seq(cache, i, random_tokens(W + 9, seed=30 + i)) for i in range(2)]
    new = Seq(cache, 2, random_tokens(2 * W + 3, seed=40))
    seqs = [*old, new]
    wants = [reference(cpu_model, s.tokens) for s in seqs]
    runner.forward(ForwardBatch.build([s.chunk(W + 2) for s in old], Mode.EXTEND, cache), None)
    for chunk in (W - 1, W - 1, 5):
        batch = ForwardBatch.build([*(s.chunk(1) for s in old), new.chunk(chunk)], Mode.EXTEND, cache)
        assert batch.decode_rows == 2
        logits = runner.forward(batch, None, return_logits=True).logits.cpu()
        for row, s, want in zip(logits, seqs, wants, strict=True):
            torch.testing.assert_close(row, want[s.done - 1], rtol=2e-2, atol=2e-2)  # tf32 dots


@pytest.mark.parametrize("level", ["off", "warn", "strict"])
def test_model_runner_forward_never_syncs(level):
    _, cache, runner = cuda_runner()
    seqs = [Seq(cache, i, random_tokens(30, seed=i)) for i in range(3)]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=5)]  # fmt: skip
    sampling = SamplingBatch.build(params, cache.device)
    with levels(level):
        for _ in range(2):  # warm-up with the guarded shapes: compile every kernel first
            runner.forward(ForwardBatch.build([s.chunk(5) for s in seqs], Mode.EXTEND, cache), sampling)
            runner.forward(ForwardBatch.build([s.chunk(1) for s in seqs], Mode.DECODE, cache), sampling)
        torch.cuda.synchronize()
        prefill = ForwardBatch.build([s.chunk(5) for s in seqs], Mode.EXTEND, cache)
        decode = ForwardBatch.build([s.chunk(1) for s in seqs], Mode.DECODE, cache)
        with no_host_sync():
            runner.forward(prefill, sampling)
            runner.forward(decode, sampling)


def test_engine_on_cuda_generates_and_frees_everything():
    cfg = tiny_config("SSFS")
    kv = KVConfig(page_size=16, num_pages=64, max_requests=4, device="cuda")
    engine = Engine(tiny_model(cfg).cuda(), kv, EngineConfig(max_batch_tokens=32))
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 50)]
    reqs = engine.generate(prompts, SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True))
    assert all(len(r.output) == 12 and r.finish_reason == "length" for r in reqs)
    engine.check_idle_integrity()


def test_decode_graphs_replay_what_eager_decode_computes():
    _, graph_cache, graph_runner = cuda_runner()
    _, eager_cache, eager_runner = cuda_runner()  # same seed: the same weights
    graph_runner.capture_decode_graphs([1, 4, 8], max_pages=8)

    def decode(runner, cache, seqs):
        batch = build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE)  # into a graph when one fits
        assert runner is eager_runner or batch.num_seqs in (1, 4, 8), "the graph path was not taken"
        return runner.forward(batch, None, return_logits=True).logits.clone()

    for n in (1, 3, 8):  # 3 rides the 4-row graph with a padded row
        pairs = [(Seq(graph_cache, 10 * n + i, random_tokens(40, seed=i)),
                  Seq(eager_cache, 10 * n + i, random_tokens(40, seed=i))) for i in range(n)]  # fmt: skip
        for k, (cache, runner) in enumerate(((graph_cache, graph_runner), (eager_cache, eager_runner))):
            runner.forward(ForwardBatch.build([p[k].chunk(20) for p in pairs], Mode.EXTEND, cache), None)
        for _ in range(5):
            got = decode(graph_runner, graph_cache, [p[0] for p in pairs])
            want = decode(eager_runner, eager_cache, [p[1] for p in pairs])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for p in pairs:
            p[0].window.free()
            p[1].window.free()
    scratch = graph_cache.ring_pos[:, graph_cache.scratch_slot]
    assert int((scratch != -1).sum()) == 0, "padded rows wrote the scratch ring"


def test_engine_with_graphs_matches_eager_and_never_syncs_in_decode():
    cfg = tiny_config("SSFS")
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 50, 7, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for sizes in ((), (1, 2, 4, 8)):
        kv = KVConfig(page_size=16, num_pages=64, max_requests=8, device="cuda")
        engine = Engine(tiny_model(cfg).cuda(), kv, EngineConfig(max_batch_tokens=64, cuda_graph_sizes=sizes))
        outs.append([r.output for r in engine.generate(prompts, sp)])
        engine.check_idle_integrity()
    assert outs[0] == outs[1]
    _, cache, runner = cuda_runner()
    runner.capture_decode_graphs([4], max_pages=8)
    seqs = [Seq(cache, i, random_tokens(30, seed=i)) for i in range(3)]
    runner.forward(ForwardBatch.build([s.chunk(20) for s in seqs], Mode.EXTEND, cache), None)
    runner.forward(build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE), None)
    torch.cuda.synchronize()
    decode = build_batch(runner, [s.chunk(1) for s in seqs], Mode.DECODE)
    assert decode.num_seqs == 4 and decode.num_real == 3, "a graph batch, padded"
    with no_host_sync():
        runner.forward(decode, None)


def test_a_steady_greedy_decode_step_copies_nothing():
    """The step's tokens reach the host and the token table from the argmax kernel itself, and the
    graph moved its own inputs on (`shared/kernels/decode_advance.py`): a steady step copies nothing
    either way."""
    kv = KVConfig(page_size=16, num_pages=64, max_requests=8, device="cuda")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Production's level, and a checker of its own: one that other tests registered invariants with
    # copies its counters home at every poll (how WARN reports without a sync), two more copies.
    invariants.reset_checkers()
    with levels("off"):
        engine = Engine(tiny_model(tiny_config("SSFS")).cuda(), kv, EngineConfig(cuda_graph_sizes=(4,)))
        reqs = [engine.add_request(random_tokens(n, seed=n), sp) for n in (5, 9, 2 * W + 1)]
        while not all(len(r.output) >= 3 for r in reqs):
            engine.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    copies = [e.name for e in prof.events() if e.device_type == gpu and "Memcpy" in e.name]
    assert not copies, copies
    with levels("off"):
        while not engine.idle:
            engine.step()
    invariants.reset_checkers()
    eager = Engine(tiny_model(tiny_config("SSFS")).cuda(), kv, EngineConfig(cuda_graph_sizes=()))
    assert [r.output for r in reqs] == [r.output for r in eager.generate([r.prompt for r in reqs], sp)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engines_on_two_gpus_of_one_process_each_capture_on_their_own():
    # torch's default capture stream lives on the device that captured first: an engine on cuda:1
    # built after one on cuda:0 must still capture (and launch every kernel) on cuda:1.
    cfg = tiny_config("SSFS")
    prompts = [random_tokens(n, seed=n) for n in (5, 2 * W + 3, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for device in ("cuda:0", "cuda:1"):
        kv = KVConfig(page_size=16, num_pages=64, max_requests=4, device=device)
        cfg_engine = EngineConfig(max_batch_tokens=64, cuda_graph_sizes=(1, 4))
        engine = Engine(tiny_model(cfg).to(device), kv, cfg_engine)
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "captured"
        outs.append([r.output for r in engine.generate(prompts, sp)])
        engine.check_idle_integrity()
    assert outs[0] == outs[1]


def test_after_warm_up_prompts_of_new_lengths_compile_no_kernel():
    # What a first request would otherwise wait on: a Triton compile (~1 s on an H200) for a launch
    # constant not seen yet. Lengths none of `warm_up`'s, arriving together and one by one.
    from triton import knobs

    cfg = tiny_config("SSFS")
    kv = KVConfig(page_size=16, num_pages=256, max_requests=8, device="cuda")
    engine = Engine(tiny_model(cfg).cuda(), kv, EngineConfig(max_batch_tokens=64))
    assert engine.warm_up() > 0
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        engine.generate([random_tokens(n, seed=n) for n in (4, 7, 23, 40)], sp)
        late = []
        for n in (70, 150, 300, 11, 6):
            late.append(engine.add_request(random_tokens(n, seed=n), sp))
            engine.step()
        while not all(r.finished for r in late) or engine.in_flight:
            engine.step()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], f"compiled after warm-up: {compiled}"
    engine.check_idle_integrity()


def test_prefix_cache_hits_on_cuda_decode_as_without_it_and_restore_windows_without_a_sync():
    cfg = tiny_config("SSFS")
    base = random_tokens(80, seed=9)
    # Turns that extend each other (snapshot restores), prompts that diverge inside a prefix (a snapshot
    # left where they diverge), a prefix under W and one ending inside a page.
    prompts = [base[:40], [*base[:40], 1, 2], [*base[:33], 5], [*base[:33], 6, 7], base[:5], [*base[:70], 3]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs, engines = [], []
    for cache in (False, True):
        kv = KVConfig(page_size=4, num_pages=256, max_requests=8, device="cuda")
        cfg_e = EngineConfig(max_batch_tokens=64, cuda_graph_sizes=(1, 2, 4), prefix_cache=cache)
        engine = Engine(tiny_model(cfg).cuda(), kv, cfg_e)
        outs.append([engine.generate([p], sp)[0].output for p in prompts])
        engine.check_idle_integrity()
        engines.append(engine)
    assert outs[0] == outs[1]
    engine = engines[1]
    assert engine.kv.hit_tokens > 0 and engine.kv.prefix.num_snapshots > 0  # type: ignore[union-attr]
    req = engine._new_request([*base[:70], 3, 4], sp)
    torch.cuda.synchronize()
    with no_host_sync():
        assert engine.kv.allocate(req, share=True)
        assert req.cached_tokens == 72 - 4 and req.snapshot_at == [72]
    engine.kv.free_now([req])
    engine.check_idle_integrity()
