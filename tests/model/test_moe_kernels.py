"""Mixture-of-experts kernels (`shared/kernels/moe`): the router against a naive one, the torch
reference against a per-token loop of the formula, and the Triton `fused_moe` (interpreted on CPU,
compiled on CUDA) against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testutil import assert_matches

from shared.kernels.moe import fused_moe_for, reference, route
from shared.kernels.moe.fused_moe import align, fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, INTER, E = 64, 96, 8  # hidden size, each expert's intermediate size, experts


def naive_route(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[list, list]:
    """Softmax routing one token at a time: the k largest probabilities, ties to the lower id."""
    weights, ids = [], []
    for row in logits.double().tolist():
        z = sum(math.exp(v) for v in row)
        p = [math.exp(v) / z for v in row]
        top = sorted(range(len(row)), key=lambda e: (-p[e], e))[:k]
        w = [p[e] for e in top]
        s = sum(w) if renormalize else 1.0
        weights.append([v / s for v in w])
        ids.append(top)
    return weights, ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing_matches_a_naive_router(renormalize: bool) -> None:
    logits = torch.randn(33, E, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    weights, ids = route(logits, 3, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (33, 3)
    want_w, want_ids = naive_route(logits.cpu(), 3, renormalize)
    assert ids.cpu().tolist() == want_ids
    torch.testing.assert_close(weights.cpu(), torch.tensor(want_w, dtype=torch.float32))
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(33))
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "ids in descending order of weight"


def test_bf16_logits_are_routed_in_float32() -> None:
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    weights, ids = route(logits, 2)
    want_w, want_ids = route(logits.float(), 2)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_sigmoid_routing_chooses_by_biased_scores_and_weighs_by_unbiased_ones() -> None:
    # Scores 0.9 > 0.8 > 0.7 > 0.6 > ...; the bias lifts experts 6 and 7 above them all.
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.2, 0.1]])
    logits = torch.log(scores / (1 - scores)).to(DEVICE)  # sigmoid(logits) = scores
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 2.0], device=DEVICE)
    weights, ids = route(logits, 3, scoring="sigmoid", bias=bias, scaling=2.5)
    # chosen: 7 (2.1), 6 (1.2), 0 (0.9); ordered by unbiased weight: 0.9, 0.2, 0.1
    assert ids.cpu().tolist() == [[0, 6, 7]]
    want = torch.tensor([[0.9, 0.2, 0.1]]) / 1.2 * 2.5
    torch.testing.assert_close(weights.cpu(), want)
    raw, raw_ids = route(logits, 3, scoring="sigmoid", bias=bias, renormalize=False)
    assert raw_ids.cpu().tolist() == [[0, 6, 7]]
    torch.testing.assert_close(raw.cpu(), torch.tensor([[0.9, 0.2, 0.1]]))
    plain_w, plain_ids = route(logits, 3, scoring="sigmoid")
    assert plain_ids.cpu().tolist() == [[0, 1, 2]], "without a bias: the highest scores"
    torch.testing.assert_close(plain_w.sum(-1).cpu(), torch.ones(1))


def test_ties_go_to_the_lower_expert_id() -> None:
    logits = torch.zeros(4, E, device=DEVICE)
    logits[1, [2, 5, 6]] = 1.0  # three equal winners
    logits[2, [7, 3]] = 2.0
    logits[3] = torch.tensor([1.0, 0, 1.0, 0, 0, 0, 0, 1.0])
    _, ids = route(logits, 3)
    assert ids.cpu().tolist() == [[0, 1, 2], [2, 5, 6], [3, 7, 0], [0, 2, 7]]
    bias = torch.zeros(E, device=DEVICE)
    bias[[4, 1]] = 5.0  # chosen by bias, equal unbiased weights: still the lower id first
    _, ids = route(torch.zeros(2, E, device=DEVICE), 2, scoring="sigmoid", bias=bias)
    assert ids.cpu().tolist() == [[1, 4], [1, 4]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": E + 1}, "top_k"),
        ({"scoring": "softplus"}, "scoring"),
        ({"bias": torch.zeros(E + 1)}, "bias"),
        ({"bias": torch.zeros(E, dtype=torch.bfloat16)}, "bias"),
        ({"scaling": "2"}, "scaling"),
        ({"logits": torch.zeros(2, 3, E)}, "logits"),
        ({"logits": torch.zeros(2, E, dtype=torch.int64)}, "logits"),
    ],
)
def test_route_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"logits": torch.zeros(2, E), "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        route(args.pop("logits"), args.pop("top_k"), **args)


def operands(t: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> dict:
    """A random layer and routing: gate_up values spread past swiglu_oai's limit of 7."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen)
    layer = {
        "x": x,
        "w_gate_up": 3 * torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5,
        "w_down": torch.randn(E, H, INTER, generator=gen) / INTER**0.5,
        "b_gate_up": torch.randn(E, 2 * INTER, generator=gen) if bias else None,
        "b_down": torch.randn(E, H, generator=gen) if bias else None,
    }
    out = {n: v.to(DEVICE, dtype) if v is not None else None for n, v in layer.items()}
    out["weights"], out["ids"] = route(torch.randn(t, E, generator=gen).to(DEVICE), k)
    return out


def assert_kernel_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:  # only the dots' order differs
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        assert_matches(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize(("t", "bias"), [(1, True), (5, False), (33, True)])
def test_triton_matches_the_reference(dtype: torch.dtype, activation: str, t: int, bias: bool) -> None:
    ops = operands(t, 2, dtype, bias, seed=t)
    got = fused_moe(**ops, activation=activation)
    want = reference.fused_moe(**ops, activation=activation)
    assert got.shape == (t, H) and got.dtype == dtype
    assert_kernel_matches(got, want)


def chosen(ids: list[list[int]], t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed expert ids (one row repeated to T rows) with random positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids_t = torch.tensor(ids, dtype=torch.int32).repeat(t // len(ids) + 1, 1)[:t]
    return torch.rand(ids_t.shape, generator=gen).to(DEVICE), ids_t.to(DEVICE)


@pytest.mark.parametrize(
    ("t", "ids", "activation"),
    [
        (33, [[5]], "silu"),  # every token on one expert: several blocks of one expert's rows
        (33, [[5, 2]], "swiglu_oai"),
        (5, [[0, 1], [1, 0], [6, 0], [0, 6], [1, 6]], "silu"),  # experts 2..5 and 7 chosen by no one
        (5, [[7, 6, 5, 4], [0, 1, 2, 3], [3, 5, 7, 1]], "swiglu_oai"),  # k = 4
        (1, [[3]], "silu"),  # T = 1, k = 1
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference_for_any_routing(
    t: int, ids: list, activation: str, dtype: torch.dtype
) -> None:
    ops = operands(t, 1, dtype, bias=True)
    ops["weights"], ops["ids"] = chosen(ids, t)
    got = fused_moe(**ops, activation=activation)
    assert_kernel_matches(got, reference.fused_moe(**ops, activation=activation))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_partial_slots_naming_another_ranks_expert_add_nothing(impl: str) -> None:
    """Expert parallelism: id E names an expert another rank holds; with `partial`, those slots add
    nothing, so the output is the one with their weights zero (here: their experts' ids 0..E-1 kept
    and the weights zeroed; the other ranks add the rest)."""
    t = 9
    ops = operands(t, 2, torch.float32, bias=True)
    ids = [[0, E], [E, 3], [E, E], [5, 1]]
    ops["weights"], ops["ids"] = chosen(ids, t)
    absent = ops["ids"] == E
    run = fused_moe if impl == "triton" else reference.fused_moe
    got = run(**ops, partial=True)
    zeroed = dict(
        ops, weights=torch.where(absent, 0.0, ops["weights"]), ids=torch.where(absent, 0, ops["ids"])
    )
    assert_kernel_matches(got, reference.fused_moe(**zeroed))
    assert got[2::4].abs().max() == 0  # rows with both slots elsewhere: exactly zero


def test_routing_from_route_with_k1_and_k4() -> None:
    for k in (1, 4):
        ops = operands(5, k, torch.bfloat16, bias=False, seed=k)
        assert_kernel_matches(fused_moe(**ops), reference.fused_moe(**ops))


def per_token_loop(ops: dict, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The formula, one token and one slot at a time, rounding where a 16-bit layer rounds."""
    x, dtype = ops["x"], ops["x"].dtype

    def r(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype).float()

    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(H)
        for j in range(ops["ids"].shape[1]):
            e = int(ops["ids"][t, j])
            gu = ops["w_gate_up"][e].float() @ x[t].float()
            if ops["b_gate_up"] is not None:
                gu = gu + ops["b_gate_up"][e].float()
            gate, up = r(gu[:INTER]), r(gu[INTER:])
            if activation == "silu":
                h = r(r(gate * torch.sigmoid(gate)) * up)
            else:
                gate, up = torch.minimum(gate, torch.tensor(limit)), up.clamp(-limit, limit)
                h = r(r(up + 1) * r(gate * r(torch.sigmoid(r(alpha * gate)))))
            y = ops["w_down"][e].float() @ h
            if ops["b_down"] is not None:
                y = y + ops["b_down"][e].float()
            total = total + float(ops["weights"][t, j]) * r(y)
        rows.append(total)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_reference_matches_a_per_token_loop(dtype: torch.dtype, activation: str) -> None:
    ops = {n: v.cpu() if v is not None else None for n, v in operands(9, 3, dtype, bias=True).items()}
    want = per_token_loop(ops, activation)
    assert_kernel_matches(reference.fused_moe(**ops, activation=activation), want)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_swiglu_oai_clamps_gate_above_and_up_on_both_sides(impl: str) -> None:
    """gate = up = x through identity weights, k = 1, weight 1: the output is the activation itself."""
    n, limit, alpha = 64, 7.0, 1.702
    eye = torch.eye(n)
    x = torch.linspace(-20, 20, 2 * n).reshape(2, n)
    w_gate_up, w_down = torch.cat([eye, eye])[None], eye[None]
    weights, ids = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (x, w_gate_up, w_down, weights, ids)]
    moe = reference.fused_moe if impl == "reference" else fused_moe
    got = moe(*args, activation="swiglu_oai", alpha=alpha, limit=limit).cpu().flatten()
    xs = x.flatten()

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return (up + 1) * gate * torch.sigmoid(alpha * gate)

    above, below, inside = xs > limit, xs < -limit, xs.abs() <= limit
    at_limit = act(torch.tensor(limit), torch.tensor(limit))
    torch.testing.assert_close(got[above], at_limit.expand(int(above.sum())))
    torch.testing.assert_close(got[below], act(xs[below], torch.tensor(-limit)))  # gate has no floor
    torch.testing.assert_close(got[inside], act(xs[inside], xs[inside]))


def test_fused_moe_for_picks_by_device_and_backend() -> None:
    cpu = torch.device("cpu")
    assert fused_moe_for(cpu) is reference.fused_moe
    assert fused_moe_for(torch.device("cuda")) is fused_moe
    assert fused_moe_for(cpu, "triton") is fused_moe
    assert fused_moe_for(torch.device("cuda"), "torch") is reference.fused_moe
    with pytest.raises(ValueError, match="backend"):
        fused_moe_for(cpu, "cutlass")  # type: ignore[arg-type]


def test_no_tokens_give_an_empty_output() -> None:
    ops = operands(0, 2, torch.bfloat16, bias=False)
    assert fused_moe(**ops).shape == (0, H)
    assert reference.fused_moe(**ops).shape == (0, H)


def test_align_pads_each_experts_run_to_whole_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 7]], dtype=torch.int32, device=DEVICE)
    pairs, block_expert = align(ids, 8, 4)
    n = ids.numel()
    assert pairs.shape[0] % 4 == 0 and pairs.shape[0] >= n + min(8, n) * 3
    runs = pairs.view(-1, 4).cpu().tolist()
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 3: pairs 0, 2, 5, 6; expert 7: pair 7
    assert runs[:5] == [[1, 4, n, n], [3, n, n, n], [0, 2, 5, 6], [7, n, n, n], [n] * 4]
    assert block_expert.cpu().tolist()[:5] == [0, 1, 3, 7, 8]
    assert all(e == 8 for e in block_expert.cpu().tolist()[4:]), "blocks past the runs name no expert"
    assert sorted(p for p in pairs.cpu().tolist() if p < n) == list(range(n)), "every pair once"


def good_args() -> dict:
    return operands(3, 2, torch.float32, bias=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": torch.zeros(3, 1, H)}, "x must be"),
        ({"x": torch.zeros(3, H, dtype=torch.int32)}, "x must have dtype"),
        ({"w_gate_up": torch.zeros(E, 2 * INTER + 1, H)}, "w_gate_up"),
        ({"w_gate_up": torch.zeros(E, 2 * INTER, H, dtype=torch.bfloat16)}, "w_gate_up dtype"),
        ({"w_down": torch.zeros(E, H, INTER + 1)}, "w_down"),
        ({"w_down": torch.zeros(E + 1, H, INTER)}, "w_down"),
        ({"weights": torch.zeros(3, 2, dtype=torch.bfloat16)}, "weights"),
        ({"weights": torch.zeros(3, 3)}, "weights"),
        ({"ids": torch.zeros(3, 2, dtype=torch.int64)}, "ids"),
        ({"ids": torch.zeros(4, 2, dtype=torch.int32)}, "ids"),
        ({"b_gate_up": torch.zeros(E, INTER)}, "b_gate_up"),
        ({"b_down": torch.zeros(E, H, dtype=torch.bfloat16)}, "b_down"),
        ({"activation": "gelu"}, "activation"),
        ({"alpha": None}, "alpha"),
        ({"ids": torch.zeros(3, 2, dtype=torch.int32, device="meta")}, "one device"),
    ],
)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_fused_moe_rejects_bad_arguments(change: dict, match: str, impl: str) -> None:
    args = good_args() | {n: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                          for n, v in change.items()}  # fmt: skip
    moe = reference.fused_moe if impl == "reference" else fused_moe
    with pytest.raises(ValueError, match=match):
        moe(**args)


def test_triton_wants_rows_contiguous_along_the_last_dim() -> None:
    args = good_args()
    args["w_down"] = args["w_down"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w_down must have a contiguous last dimension"):
        fused_moe(**args)
    torch.testing.assert_close(reference.fused_moe(**args), reference.fused_moe(**good_args()))
