"""Mixture-of-experts in torch: the CPU path, and what the Triton `fused_moe` is tested against; and the
argument checks both share (shapes, dtypes and devices, never values).

Per token t and slot j of its top-k, with e = ids[t, j] and r(v) = v rounded to x's dtype:

    gate_up = r(x_t @ w_gate_up[e].T + b_gate_up[e])            (the expert's fused gate/up Linear)
    gate, up = gate_up[:I], gate_up[I:]
    h = silu:       r(r(silu(gate)) * up)                       (as `F.silu(gate) * up` rounds)
        swiglu_oai: gate = r(min(gate, limit)); up = r(clamp(up, -limit, limit))
                    h = r(r(up + 1) * r(gate * r(sigmoid(r(gate * alpha)))))   (gpt-oss, op by op)
    y_j = r(h @ w_down[e].T + b_down[e])                        (the expert's down Linear)
    out_t = r(sum over j = 0, 1, ..., k-1 in that order of weights[t, j] * y_j)   (float32, rounded once)

Every product and sum is float32; r() rounds where a layer of 16-bit torch ops rounds, except the
combine: Hugging Face's loops round each weighted y_j to the dtype and add the experts in the dtype,
in expert order; here the k weighted rows are added in float32 in slot order and rounded once, which
is closer to the exact sum and does not depend on which expert ids were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.kernels._checks import FLOAT_DTYPES, check_dims, check_dtype, check_same_device, fail
from shared.kernels.moe.route import route

__all__ = ["ACTIVATIONS", "MoeShape", "check_moe", "fused_moe", "route"]

ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class MoeShape:
    tokens: int  # T
    hidden: int  # H
    inter: int  # I, each expert's intermediate size
    experts: int  # E
    top_k: int  # k


def check_moe(
    op: str, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor, activation: str, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
    alpha: float, limit: float,
) -> MoeShape:  # fmt: skip
    """The arguments of `fused_moe` checked, as far as they can be without reading a value: the ids
    must lie in [0, E), which only the device could tell."""
    check_dims(op, "x", x, 2, "[T, H]")
    check_dims(op, "w_gate_up", w_gate_up, 3, "[E, 2I, H]")
    check_dims(op, "w_down", w_down, 3, "[E, H, I]")
    check_dims(op, "weights", weights, 2, "[T, k]")
    check_dims(op, "ids", ids, 2, "[T, k]")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_dtype(op, "weights", weights, (torch.float32,))
    check_dtype(op, "ids", ids, (torch.int32,))
    (tokens, hidden), (experts, two_inter, w_hidden) = x.shape, w_gate_up.shape
    inter = two_inter // 2
    if two_inter % 2 or w_hidden != hidden:
        fail(op, f"w_gate_up must be [E, 2I, H] with H = {hidden}, got {list(w_gate_up.shape)}")
    if tuple(w_down.shape) != (experts, hidden, inter):
        fail(op, f"w_down must be [E, H, I] = {[experts, hidden, inter]}, got {list(w_down.shape)}")
    if ids.shape[0] != tokens or ids.shape[1] < 1:
        fail(op, f"ids must be [T, k] with T = {tokens} and k >= 1, got {list(ids.shape)}")
    if weights.shape != ids.shape:
        fail(op, f"weights must be [T, k] = {list(ids.shape)} like ids, got {list(weights.shape)}")
    if experts < 1:
        fail(op, "w_gate_up holds no experts")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            fail(op, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    biases = {"b_gate_up": (b_gate_up, [experts, two_inter]), "b_down": (b_down, [experts, hidden])}
    for name, (b, want) in biases.items():
        if b is None:
            continue
        check_dims(op, name, b, 2, str(want))
        if list(b.shape) != want or b.dtype != x.dtype:
            fail(op, f"{name} must be {want} in x's dtype {x.dtype}, got {list(b.shape)} {b.dtype}")
    if activation not in ACTIVATIONS:
        fail(op, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, v in (("alpha", alpha), ("limit", limit)):
        if not isinstance(v, float | int) or isinstance(v, bool):
            fail(op, f"{name} must be a Python float, got {v!r}")
    present = {"b_gate_up": b_gate_up, "b_down": b_down}
    check_same_device(op, x=x, w_gate_up=w_gate_up, w_down=w_down, weights=weights, ids=ids,
                      **{n: b for n, b in present.items() if b is not None})  # fmt: skip
    return MoeShape(tokens, hidden, inter, experts, ids.shape[1])


def fused_moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, activation: str = "silu", b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    alpha: float = 1.702, limit: float = 7.0, partial: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The MoE layer's experts (the module docstring's formula) for x [T, H] -> [T, H] in x's dtype.

    w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I], biases [E, 2I] and [E, H] in x's
    dtype; weights [T, k] float32 and ids [T, k] int32 from `route`, every id in [0, E) (not checked),
    or, `partial` (expert parallelism), [0, E]: E names an expert another rank holds, whose slot adds
    nothing here (this loop over the E experts held here never picks it).

    Every expert runs on every token and the rows it was not chosen for are dropped: E / k times the
    routed work, but no host read and no shape that depends on a value (CUDA-graph safe), and each
    row's result independent of which rows an expert got.
    """
    m = check_moe("moe_reference", x, w_gate_up, w_down, weights, ids, activation, b_gate_up, b_down,
                  alpha, limit)  # fmt: skip
    dtype = x.dtype

    def r(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype).float()

    xf = x.float()
    chosen = ids.long()
    parts = torch.zeros((m.tokens, m.top_k, m.hidden), dtype=torch.float32, device=x.device)
    for e in range(m.experts):
        gate_up = xf @ w_gate_up[e].float().T
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[e].float()
        gate, up = r(gate_up).split(m.inter, dim=-1)
        if activation == "silu":
            h = r(r(F.silu(gate)) * up)
        else:
            gate, up = r(gate.clamp(max=limit)), r(up.clamp(-limit, limit))
            glu = r(gate * r(torch.sigmoid(r(gate * alpha))))
            h = r(r(up + 1) * glu)
        y = h @ w_down[e].float().T
        if b_down is not None:
            y = y + b_down[e].float()
        y = r(y)
        parts = torch.where((chosen == e)[..., None], weights[..., None] * y[:, None, :], parts)
    out = parts[:, 0]
    for j in range(1, m.top_k):  # slot order, as the Triton combine adds them
        out = out + parts[:, j]
    return out.to(dtype)
