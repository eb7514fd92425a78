"""The sampler draws from the right distribution, honours each row's own filters, and a seeded row's tokens
depend on (seed, position, logits) alone. Statistics are real draws with fixed seeds, checked by chi-square.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shared.engine.sampling import GREEDY_EPS, SamplingBatch, SamplingParams, sample
from shared.kernels.sampling import hashed_uniform

P = SamplingParams


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, *, seeded: bool = False) -> torch.Tensor:
    """n independent draws from one row of logits: n rows, seeds 0..n-1 (hash noise) or a fixed generator."""
    rows = [P(**{**params.__dict__, "seed": i}) for i in range(n)] if seeded else [params] * n
    gen = torch.Generator().manual_seed(1234)
    batch = SamplingBatch.build(rows)
    return sample(logits.expand(n, -1).contiguous(), batch, torch.full((n,), 7), generator=gen)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, float, float]:
    """Pearson's chi-square against `probs` at p = 0.001 (Wilson-Hilferty); no draws where probs is 0."""
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, "a token outside the support was drawn"
    cells = probs > 0
    n = counts.sum()
    exp = probs[cells] * n
    stat = float(((counts[cells] - exp) ** 2 / exp).sum())
    df = int(cells.sum()) - 1
    if df == 0:
        return True, stat, 0.0
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def _renorm(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


# --- SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
        ("top_k", -2), ("top_k", 2.0), ("top_k", True),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
        ("min_p", -0.1), ("min_p", 1.0), ("min_p", math.nan),
        ("seed", 1.5), ("seed", True),
        ("max_tokens", 0), ("max_tokens", 2.0),
        ("stop", [""]), ("stop", [3]),
        ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
        ("ignore_eos", "yes"),
    ],
)  # fmt: skip
def test_validation_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_are_normalised_and_hashable() -> None:
    p = P(stop=["a", "b"], stop_token_ids=[2], top_k=-1)
    assert (
        p.stop == ("a", "b")
        and p.stop_token_ids == (2,)
        and hash(p) == hash(P(stop=("a", "b"), stop_token_ids=(2,), top_k=-1))
    )
    assert P(stop="x").stop == ("x",)
    assert P(temperature=0).greedy and P(top_k=1).greedy and P(temperature=GREEDY_EPS / 2).greedy
    assert not P().greedy and not P(temperature=0.01, top_k=2).greedy


# --- greedy -------------------------------------------------------------------------------------------


def test_all_greedy_batch_is_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.build([P(temperature=0)] * 5 + [P(top_k=1, temperature=2.0)])
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch, torch.arange(6)), logits.argmax(-1))


def test_temperature_to_zero_becomes_argmax() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    top2 = logits.topk(2).values[0]
    gap = float(top2[0] - top2[1])
    # exp(-gap / T) per rival: with T = gap / 40 a rival wins with probability < 50 * e**-40.
    for seeded in (False, True):
        tokens = _draws(logits, P(temperature=gap / 40), 2000, seeded=seeded)
        assert (tokens == logits.argmax()).all()
    # Lower still, greedy takes over outright (vLLM's epsilon): no overflow from logits / T.
    assert SamplingBatch.build([P(temperature=GREEDY_EPS / 10)]).all_greedy


def test_top_k_1_equals_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    batch = SamplingBatch.build([P(top_k=1, temperature=5.0, seed=i) for i in range(8)])
    assert torch.equal(sample(logits, batch, torch.arange(8)), logits.argmax(-1))
    # The filter itself, not only the greedy shortcut: k = 1 through the sort path keeps one token.
    k1 = dataclasses.replace(
        SamplingBatch.build([P(top_k=2, temperature=5.0)] * 8), top_k=torch.ones(8, dtype=torch.int32)
    )
    assert torch.equal(sample(logits, k1, torch.arange(8)), logits.argmax(-1))


# --- filters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_stays_in_the_k_largest_with_renormalised_frequencies(k: int) -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(k)) * 1.5
    tokens = _draws(logits, P(top_k=k, temperature=0.8), 20000)
    keep = logits[0].topk(k).indices.tolist()
    ok, stat, crit = _chi2_ok(_counts(tokens, 40), _renorm(torch.softmax(logits[0] / 0.8, -1), keep))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


# probs 0.5 0.3 0.1 0.06 0.04: nucleus of 0.75 is {0, 1}; of 0.85 is {0, 1, 2}; of 0.3 is {0}.
PROBS = torch.tensor([0.04, 0.3, 0.06, 0.5, 0.1])  # shuffled, so the sort is exercised
BY_RANK = [3, 1, 4, 2, 0]


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.3, 1), (0.75, 2), (0.85, 3), (0.95, 4), (1.0, 5)])
@pytest.mark.parametrize("seeded", [False, True])
def test_top_p_stays_in_the_nucleus(top_p: float, nucleus: int, seeded: bool) -> None:
    tokens = _draws(PROBS.log()[None], P(top_p=top_p), 20000, seeded=seeded)
    ok, stat, crit = _chi2_ok(_counts(tokens, 5), _renorm(PROBS, BY_RANK[:nucleus]))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def test_top_p_sees_the_top_k_renormalised_distribution() -> None:
    # top-3 renormalised: 0.5/0.9, 0.3/0.9, 0.1/0.9; mass before the third is 0.889 >= 0.85: two stay.
    # (On the raw distribution the mass before it is 0.8 < 0.85, and it would stay: SGLang's order.)
    tokens = _draws(PROBS.log()[None], P(top_k=3, top_p=0.85), 20000)
    ok, stat, crit = _chi2_ok(_counts(tokens, 5), _renorm(PROBS, BY_RANK[:2]))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("sort_path", [False, True])
@pytest.mark.parametrize(("min_p", "kept"), [(0.1, 4), (0.15, 3), (0.5, 2), (0.9, 1)])
def test_min_p_keeps_tokens_above_a_ratio_of_the_top(min_p: float, kept: int, sort_path: bool) -> None:
    n = 20000
    rows = [P(min_p=min_p)] * n + ([P(top_k=3)] if sort_path else [])  # a top-k row forces the sort path
    batch = SamplingBatch.build(rows)
    assert batch.needs_sort == sort_path
    logits = PROBS.log()[None].expand(len(rows), -1).contiguous()
    gen = torch.Generator().manual_seed(5)
    tokens = sample(logits, batch, torch.zeros(len(rows), dtype=torch.int64), generator=gen)[:n]
    ok, stat, crit = _chi2_ok(_counts(tokens, 5), _renorm(PROBS, BY_RANK[:kept]))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


# --- the distribution itself --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_match_softmax_over_temperature(temperature: float, seeded: bool) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    tokens = _draws(logits, P(temperature=temperature), 30000, seeded=seeded)
    ok, stat, crit = _chi2_ok(_counts(tokens, 8), torch.softmax(logits[0] / temperature, -1))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def test_one_seed_over_many_positions_follows_softmax() -> None:
    """The position, not only the seed, moves the noise: one request's steps are independent draws."""
    n = 30000
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, 0.25]]).expand(n, -1).contiguous()
    tokens = sample(logits, SamplingBatch.build([P(seed=42)] * n), torch.arange(n))
    ok, stat, crit = _chi2_ok(_counts(tokens, 5), torch.softmax(logits[0], -1))
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def _splitmix_reference(seed: int, position: int, v: int) -> float:
    m = (1 << 64) - 1

    def fmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    key = fmix(fmix((seed & m) ^ 0xD1B54A32D192ED03) ^ position)
    bits = fmix((key + (v + 1) * 0x9E3779B97F4A7C15) & m)
    return ((bits >> 41) + 0.5) / 2**23


def test_hash_is_splitmix64_with_wrapping_int64_arithmetic() -> None:
    seeds = [0, 1, -1, 2**63 - 1, 123456789, 2**64 + 5]
    stored = torch.tensor([SamplingBatch.build([P(seed=s)]).seed.item() for s in seeds])
    positions = torch.tensor([0, 1, 2**40, 7, 99999, 3])
    u = hashed_uniform(stored, positions, 300)
    for r, (s, pos) in enumerate(zip(seeds, positions.tolist(), strict=True)):
        for v in (0, 1, 150, 299):
            assert u[r, v].item() == _splitmix_reference(s, pos, v)
    assert u.min() > 0 and u.max() < 1
    assert (
        SamplingBatch.build([P(seed=5)]).seed.item() == SamplingBatch.build([P(seed=5 + 2**64)]).seed.item()
    )


# --- seeds and batches --------------------------------------------------------------------------------


def test_a_seeded_row_draws_the_same_tokens_in_any_batch_and_row() -> None:
    gen = torch.Generator().manual_seed(9)
    vocab, steps = 500, 40
    mine = P(seed=2024, temperature=1.3, min_p=0.01)
    mine_logits = torch.randn(steps, vocab, generator=gen)
    others_a = [P(), P(temperature=0), P(temperature=0.5, seed=1)]  # no sort: the plain path
    others_b = [P(min_p=0.2), P(temperature=0.4, seed=77), P(), P(temperature=0), P(top_k=20)]
    batch_a = SamplingBatch.build([mine, *others_a])  # mine at row 0
    batch_b = SamplingBatch.build([*others_b[:3], mine, *others_b[3:]])  # mine at row 3; sorted path
    assert not batch_a.needs_sort and batch_b.needs_sort
    got_a, got_b = [], []
    for step in range(steps):
        pos = 100 + step
        la = torch.cat([mine_logits[step : step + 1], torch.randn(3, vocab, generator=gen)])
        lb = torch.randn(6, vocab, generator=gen)
        lb[3] = mine_logits[step]
        pa = torch.tensor([pos, 5, 6, 7])
        pb = torch.tensor([1, 2, 3, pos, 4, 5])
        got_a.append(sample(la, batch_a, pa, generator=gen)[0].item())
        got_b.append(sample(lb, batch_b, pb, generator=gen)[3].item())
    assert got_a == got_b
    assert len(set(got_a)) > steps // 2  # a real draw, not a constant


def test_different_seeds_give_different_tokens_and_the_same_seed_repeats() -> None:
    logits = torch.zeros(64, 1000)  # uniform: any two streams agree on a step with probability 1/1000

    def run(seed: int) -> list[int]:
        return sample(logits, SamplingBatch.build([P(seed=seed)] * 64), torch.arange(64)).tolist()

    a, b = run(1), run(2)
    assert a == run(1)
    assert sum(x == y for x, y in zip(a, b, strict=True)) <= 3


def test_unseeded_rows_follow_the_engine_generator() -> None:
    logits = torch.zeros(16, 1000)
    batch = SamplingBatch.build([P()] * 16)

    def run(seed: int) -> list[int]:
        return sample(logits, batch, torch.arange(16), generator=torch.Generator().manual_seed(seed)).tolist()

    assert run(3) == run(3) and run(3) != run(4)


def test_mixed_batch_rows_each_follow_their_own_params() -> None:
    logits_row = PROBS.log()
    kinds = [
        (P(temperature=0), _renorm(PROBS, BY_RANK[:1])),
        (P(top_k=2), _renorm(PROBS, BY_RANK[:2])),
        (P(top_p=0.85, seed=3), _renorm(PROBS, BY_RANK[:3])),
        (P(min_p=0.15), _renorm(PROBS, BY_RANK[:3])),
        (P(temperature=2.0), torch.softmax(logits_row / 2.0, -1)),
        (
            P(temperature=0.5, top_k=4, top_p=0.99, seed=8),
            _renorm(torch.softmax(logits_row / 0.5, -1), BY_RANK[:4]),
        ),
    ]
    reps = 10000
    rows = [p for p, _ in kinds] * reps  # interleaved: row r has kind r % 6
    positions = torch.arange(len(rows)) // len(kinds)  # seeded rows need a fresh position per draw
    tokens = sample(logits_row.expand(len(rows), -1).contiguous(), SamplingBatch.build(rows), positions,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    for i, (_, probs) in enumerate(kinds):
        ok, stat, crit = _chi2_ok(_counts(tokens[i :: len(kinds)], 5), probs)
        assert ok, f"row kind {i}: chi2 {stat:.1f} >= {crit:.1f}"


# --- robustness ---------------------------------------------------------------------------------------


def test_non_finite_logits_do_not_crash() -> None:
    nan, inf = math.nan, math.inf
    logits = torch.tensor(
        [
            [0.0, nan, 1.0, -inf],  # NaN is never drawn by a sampled row
            [0.0, inf, 1.0, 2.0],  # +inf takes all the mass
            [-inf, -inf, -inf, -inf],  # nothing finite: some id in range
            [nan, nan, nan, nan],
            [0.0, nan, inf, -inf],
        ]
    ).repeat(200, 1)
    for extra in ([], [P(top_k=2, top_p=0.9, min_p=0.1)]):  # the plain and the sorted path
        n = len(logits) + len(extra)
        rows = [P(temperature=0.7, seed=None if i % 2 else i) for i in range(len(logits))] + extra
        padded = torch.cat([logits, torch.zeros(len(extra), 4)])
        tokens = sample(padded, SamplingBatch.build(rows), torch.arange(n))[: len(logits)]
        assert ((tokens >= 0) & (tokens < 4)).all()
        assert (tokens[0::5] != 1).all() and (tokens[1::5] == 1).all() and (tokens[4::5] == 2).all()
    greedy = sample(logits, SamplingBatch.build([P(temperature=0)] * len(logits)), torch.arange(len(logits)))
    assert ((greedy >= 0) & (greedy < 4)).all()


def test_empty_batch_and_bad_shapes() -> None:
    empty = sample(torch.zeros(0, 10), SamplingBatch.build([]), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0,) and empty.dtype == torch.int64
    batch = SamplingBatch.build([P(), P()])
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3, 10), batch, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        sample(torch.zeros(2, 10), batch, torch.zeros(2, dtype=torch.int32))


# --- GPU: no host sync --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_sample_makes_no_host_sync_on_cuda() -> None:
    from invariants.testing import no_host_sync

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(64, 32000, device=dev)
    positions = torch.arange(64, device=dev)
    kinds = [
        P(),
        P(temperature=0),
        P(top_k=50),
        P(top_p=0.9, seed=1),
        P(min_p=0.05),
        P(temperature=0.7, seed=2),
    ]
    batches = [
        SamplingBatch.build([kinds[i % len(kinds)] for i in range(64)], dev),  # everything at once
        SamplingBatch.build([P(temperature=0)] * 64, dev),  # the argmax fast path
        SamplingBatch.build([P(seed=i) for i in range(64)], dev),  # hash noise only
        SamplingBatch.build([P(min_p=0.1)] * 64, dev),  # no sort
    ]
    for batch in batches:
        sample(logits, batch, positions, generator=gen)  # warm up outside the guard
    torch.cuda.synchronize()
    with no_host_sync():
        out = [sample(logits, batch, positions, generator=gen) for batch in batches]
    assert all(t.shape == (64,) and t.dtype == torch.int64 and t.device.type == "cuda" for t in out)
    assert torch.equal(out[1], logits.argmax(-1))


@pytest.mark.gpu
def test_build_makes_no_host_sync_and_hash_matches_cpu() -> None:
    from invariants.testing import no_host_sync

    params = [P(seed=s, top_k=5) for s in (0, -7, 2**63 + 3)] + [P(temperature=0), P()]
    SamplingBatch.build(params, "cuda")  # warm up
    with no_host_sync():
        batch = SamplingBatch.build(params, "cuda")
    cpu = SamplingBatch.build(params)
    positions = torch.tensor([0, 5, 2**33, 1, 2])
    u_gpu = hashed_uniform(batch.seed, positions.cuda(), 1000).cpu()
    assert torch.equal(u_gpu, hashed_uniform(cpu.seed, positions, 1000))
