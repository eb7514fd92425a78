"""Mixed steps (`EngineConfig.mixed`): every decoding request gets a token in every step, beside the
prompt chunks, and nothing changes but when tokens come."""

from __future__ import annotations

import dataclasses

import pytest

from shared.engine.batch import Mode
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.engine.schedule import schedule
from tests.engine.engine_testutil import NARROW, W, build_batch, random_tokens, tiny_config, tiny_model

BUDGET = 12


def engine(mixed: bool, overlap: bool = True, layers: str = "SSFS", **dims: int) -> Engine:
    kv = KVConfig(page_size=4, num_pages=128, max_requests=4)
    cfg = EngineConfig(max_batch_tokens=BUDGET, overlap=overlap, mixed=mixed)
    return Engine(tiny_model(tiny_config(layers, **dims)), kv, cfg)


ARRIVALS = [  # (step at which it arrives, prompt length, sampling)
    (0, 5, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
    (0, W + 1, SamplingParams(temperature=0.9, seed=7, max_tokens=25, ignore_eos=True)),
    (4, 3 * W + 5, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
    (6, 2 * W, SamplingParams(temperature=1.0, top_k=4, seed=2, max_tokens=8, ignore_eos=True)),
    (7, 9, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
]


def run(eng: Engine, arrivals: list = ARRIVALS) -> list[tuple[list[int], str | None]]:  # type: ignore[type-arg]
    reqs, step = [], 0
    while len(reqs) < len(arrivals) or not all(r.finished for r in reqs) or eng.in_flight:
        for at, n, params in arrivals:
            if at == step:
                reqs.append(eng.add_request(random_tokens(n, seed=n), params))
        eng.step()
        step += 1
    eng.check_idle_integrity()
    return [(r.output, r.finish_reason) for r in reqs]


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_produce_the_tokens_prefill_first_does(overlap):
    # Greedy and seeded rows alike: a token depends on the sequence, never on the step it came in.
    assert run(engine(mixed=True, overlap=overlap)) == run(engine(mixed=False, overlap=overlap))


def test_a_decoding_request_gets_a_token_in_every_step_while_a_long_prompt_is_computed():
    def tokens_of_a_while_b_prefills(mixed: bool) -> list[int]:
        eng = engine(mixed=mixed, overlap=False)
        a = eng.add_request(random_tokens(4, seed=1), SamplingParams(temperature=0.0, max_tokens=40))
        while not a.output:
            eng.step()
        b = eng.add_request(random_tokens(5 * BUDGET, seed=2), SamplingParams(temperature=0.0, max_tokens=2))
        counts = []
        while b.num_computed < len(b.prompt):
            before = len(a.output)
            eng.step()
            counts.append(len(a.output) - before)
        return counts

    mixed = tokens_of_a_while_b_prefills(mixed=True)
    assert len(mixed) >= 5 and all(n == 1 for n in mixed)  # B's prompt took > 5 steps, A never waited
    assert sum(tokens_of_a_while_b_prefills(mixed=False)) == 0  # prefill first: A waits for all of it


def test_a_mixed_step_puts_the_decode_tokens_first_and_prompts_in_what_is_left():
    eng = engine(mixed=True)
    a = eng.add_request(random_tokens(4, seed=1), SamplingParams(temperature=0.0, max_tokens=40))
    while not a.output:
        eng.step()
    b = eng.add_request(random_tokens(3 * BUDGET, seed=2), SamplingParams(temperature=0.0, max_tokens=2))
    eng.step()  # admits B; A's token of this step is still in flight when the next step is planned
    plan = schedule(eng.running, BUDGET, mixed=True)
    assert plan.mode is Mode.EXTEND and plan.reqs == [a, b]
    assert plan.items[0].token_ids == [-1]  # in flight: gathered on the device from the step's output
    assert len(plan.items[1].token_ids) == BUDGET - 1 and plan.emits == [True, False]
    assert schedule(eng.running, BUDGET, mixed=False).reqs == [b]  # prefill first: B alone
    # Attention runs the leading one-token rows apart, as a decode, not padded to B's chunk length.
    assert build_batch(eng.runner, plan.items, plan.mode).decode_rows == 1


def test_mixed_steps_through_the_triton_kernels_produce_the_same_tokens():
    # The interpreter runs the same wrappers as a GPU: the decode rows of a mixed step go through the
    # decode-shaped attention call (split-K), the prompt chunks through the prefill-shaped one.
    from shared.kernels.attention import ops_for

    # One sliding and one full layer: both attention kernels, each layer type's own path, at half the
    # interpreted kernels of SSFS; NARROW: the same kernels (the schedule does not see the widths) at
    # fewer GEMM programs.
    def triton_engine(mixed: bool) -> Engine:
        eng = engine(mixed, layers="SF", **NARROW)
        eng.runner.model.kernel_backend = "triton"
        eng.runner.ops = ops_for("cpu", backend="triton")
        return eng

    # The first two requests still decode when the others arrive (steps 4-7): mixed steps happen with
    # a dozen tokens each, and the interpreter's cost grows with every step.
    short = [(at, n, dataclasses.replace(p, max_tokens=min(p.max_tokens, 12))) for at, n, p in ARRIVALS]
    assert run(triton_engine(mixed=True), short) == run(engine(mixed=False, layers="SF", **NARROW), short)
