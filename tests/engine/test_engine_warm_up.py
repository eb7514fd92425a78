"""`Engine.warm_up`: throwaway requests before traffic, so that first launches (Triton compiles) do not
stall real requests; it leaves nothing behind."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import NARROW, W, random_tokens, tiny_config, tiny_model


def engine(mixed: bool = False) -> Engine:
    kv = KVConfig(page_size=4, num_pages=512, max_requests=4)
    return Engine(tiny_model(tiny_config("SSFS")), kv, EngineConfig(max_batch_tokens=64, mixed=mixed))


@pytest.mark.parametrize("mixed", [False, True])
def test_a_warmed_up_engine_is_idle_and_generates_what_a_fresh_one_does(mixed):
    prompts = [random_tokens(n, seed=n) for n in (3, W + 2, 50)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=3, seed=1, max_tokens=4, ignore_eos=True)]  # fmt: skip
    warmed = engine(mixed)
    assert warmed.warm_up(force=True) > 0
    assert warmed.idle and warmed.cache.pages.num_used == 0 and warmed.cache.slots.num_used == 0
    got = [r.output for r in warmed.generate(prompts, params)]
    assert got == [r.output for r in engine(mixed).generate(prompts, params)]
    warmed.check_idle_integrity()


def test_on_a_cpu_warm_up_does_nothing_unless_forced():
    eng = engine()
    assert eng.warm_up() == 0.0
    assert eng.idle and eng.cache.pages.num_used == 0


def test_warm_up_refuses_an_engine_with_requests():
    eng = engine()
    eng.add_request(random_tokens(5), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before its first request"):
        eng.warm_up(force=True)


@pytest.mark.parametrize("num_pages", [1, 2, 3])
def test_warm_up_fits_any_pool_that_holds_a_request(num_pages):
    # 4, 8 and 12 tokens of context: the lengths and the mixed step shrink to what fits.
    kv = KVConfig(page_size=4, num_pages=num_pages, max_requests=2)
    eng = Engine(tiny_model(tiny_config("SSFS")), kv, EngineConfig(max_batch_tokens=8))
    eng.warm_up(force=True)
    assert eng.idle and eng.cache.pages.num_used == 0 and eng.cache.slots.num_used == 0


@pytest.fixture
def triton_checks_at_warn():
    """The process's CPU Checker through the Triton check kernel (interpreted), at WARN."""
    import invariants

    invariants.reset_checkers()
    invariants.checker("cpu", use_triton=True)
    with invariants.levels("warn"):
        yield
    invariants.reset_checkers()


def _new_variants_after_warm_up() -> tuple[set, set]:
    from shared.kernels.attention import ops_for
    from tests.engine.variants_testutil import launched_variants

    # Narrow, and 2/1 heads rather than 4/2 (two query heads a K/V head still): the variants this test is
    # about are set by the packed batch's lengths and offsets and the alignment of views into it, which
    # neither changes (every launch's argument kinds, alignments included, are those of the 4/2-head
    # model at full width; only constexprs fixed per model differ), at under 2/3 of the interpreted
    # programs (GEMM column blocks, attention's K/V-head programs).
    model = tiny_model(tiny_config("SF", **NARROW, heads=2, kv_heads=1))
    model.kernel_backend = "triton"
    kv = KVConfig(page_size=4, num_pages=16, max_requests=4)
    eng = Engine(model, kv, EngineConfig(max_batch_tokens=32))
    eng.runner.ops = ops_for(eng.cache.device, backend="triton")
    with launched_variants() as warmed:
        eng.warm_up(force=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with launched_variants() as traffic:
        eng.generate([random_tokens(n, seed=n) for n in (7, 23, 50)], sp)
        late = []
        for n in (30, 11):
            late.append(eng.add_request(random_tokens(n, seed=n), sp))
            eng.step()
        while not all(r.finished for r in late) or eng.in_flight:
            eng.step()
    return warmed, traffic


def test_after_warm_up_prompts_of_new_lengths_launch_no_kernel_variant_it_did_not(triton_checks_at_warn):
    # The Triton kernels (interpreted here), keyed as a GPU compiles them: every variant a trace of
    # other lengths, together and arriving one by one, needs was compiled by the warm-up (a packed
    # per-sequence field deciding an attention kernel's alignment key would fail it).
    # At WARN every check is a launch of the fused check kernel too, whose key includes the alignment
    # of what it reads (some of it views into the packed batch): the warm-up's mix of lengths covers
    # them as well (one run for both: the interpreter makes it the suite's slowest).
    warmed, traffic = _new_variants_after_warm_up()
    assert {key[0] for key in traffic} >= {
        "_ring_attention_kernel",
        "_paged_attention_kernel",
        "_rope_kernel",
        "_check_rows",
    }
    assert traffic <= warmed, f"variants first launched after the warm-up: {traffic - warmed}"
