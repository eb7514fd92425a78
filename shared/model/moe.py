"""The mixture-of-experts MLP (`MoeConfig`): a router picks each token's top k of E experts and
weighs them; each expert is a gated MLP with weights of its own. The experts' GEMMs are one fused
kernel over all of them (`ModelKernels.experts`: shared/kernels/moe), with a torch reference.

The experts' weights live stacked: gate/up [E * 2I, H] (expert e's gate rows, then its up rows, as
the dense MLP's gate_up_proj stacks them) and down [E * H, I], so the loader fills them as it fills
any fused projection, a checkpoint tensor a shard (`Transformer._shards`); gpt-oss's checkpoint keeps
each kind whole and interleaved, in bf16 or MXFP4 (dequantized at load: `shared/model/mxfp4.py`), and
`load_fused` places it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.kernels import ModelKernels
from shared.model.moe_config import MoeConfig
from shared.model.mxfp4 import dequantize_mxfp4

__all__ = ["MoE"]


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, i = len(cfg.held_experts), cfg.intermediate_size  # the experts whose weights live here
        self.hidden = hidden
        self.router = nn.Linear(hidden, cfg.num_experts, bias=cfg.router_bias)
        self.w_gate_up = nn.Parameter(torch.zeros(e * 2 * i, hidden), requires_grad=False)
        self.w_down = nn.Parameter(torch.zeros(e * hidden, i), requires_grad=False)
        if cfg.expert_bias:
            self.b_gate_up = nn.Parameter(torch.zeros(e * 2 * i), requires_grad=False)
            self.b_down = nn.Parameter(torch.zeros(e * hidden), requires_grad=False)
        else:
            self.register_parameter("b_gate_up", None)
            self.register_parameter("b_down", None)
        self._mxfp4: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 tensor's half, until its pair
        # Tensor parallel (shared/model/tensor_parallel.py): the all-reduce of the rank's expert slices
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, kernels: ModelKernels, rms_eps: float | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x: the normed rows [T, H] (an MoE layer's norm is never folded: `rms_eps` must be None).
        With `residual`, residual + the output."""
        if rms_eps is not None:
            raise ValueError("MoE: a norm folded into the experts is not supported")
        c = self.cfg
        logits = kernels.linear(x, self.router)
        weights, ids = kernels.route(logits, c.top_k, scoring=c.scoring, renormalize=c.renormalize,
                                     scaling=c.routed_scaling)  # fmt: skip
        held = c.held_experts
        e, i = len(held), c.intermediate_size
        if c.held is not None:  # expert parallel: ids of this rank's experts, e for another rank's
            local = ids - held.start
            ids = torch.where((local >= 0) & (local < e), local, e).to(ids.dtype)
        out = kernels.experts(
            x, self.w_gate_up.view(e, 2 * i, self.hidden), self.w_down.view(e, self.hidden, i), weights, ids,
            activation=c.activation,
            b_gate_up=None if self.b_gate_up is None else self.b_gate_up.view(e, 2 * i),
            b_down=None if self.b_down is None else self.b_down.view(e, self.hidden), alpha=c.alpha,
            limit=c.limit, partial=c.held is not None,
        )  # fmt: skip
        if self.reduce is not None:
            out = self.reduce(out)
        return out if residual is None else residual + out

    @torch.no_grad()
    def load_fused(self, kind: str, tensor: torch.Tensor) -> str | None:
        """gpt-oss's stacked expert tensors: "gate_up_proj" [E, H, 2I] (gate and up columns
        interleaved), "gate_up_proj_bias" [E, 2I] (likewise), "down_proj" [E, I, H], "down_proj_bias"
        [E, H]; or MXFP4's "gate_up_proj_blocks" / "_scales" ([E, 2I, H / 32, 16] and [E, 2I, H / 32]:
        rows are outputs) and "down_proj_blocks" / "_scales", dequantized once both halves arrived.
        Returns the parameter it filled (None: half of an MXFP4 pair, kept until the other comes)."""
        if kind.endswith(("_blocks", "_scales")):
            base, _, part = kind.rpartition("_")
            self._mxfp4.setdefault(base, {})[part] = tensor
            if len(self._mxfp4[base]) < 2:
                return None
            pair = self._mxfp4.pop(base)
            weight = dequantize_mxfp4(pair["blocks"], pair["scales"])  # [E, out, in]
            return self.load_fused(base, weight.transpose(1, 2))  # as the bf16 checkpoints store it
        e, i, h = self.cfg.num_experts, self.cfg.intermediate_size, self.hidden
        if kind == "gate_up_proj":
            _check(kind, tensor, (e, h, 2 * i))
            t = tensor.transpose(1, 2)  # [E, 2I, H], rows gate0, up0, gate1, ...
            self.w_gate_up.view(e, 2, i, h).copy_(torch.stack([t[:, 0::2], t[:, 1::2]], dim=1))
            return "w_gate_up"
        if kind == "gate_up_proj_bias" and self.b_gate_up is not None:
            _check(kind, tensor, (e, 2 * i))
            self.b_gate_up.view(e, 2, i).copy_(torch.stack([tensor[:, 0::2], tensor[:, 1::2]], dim=1))
            return "b_gate_up"
        if kind == "down_proj":
            _check(kind, tensor, (e, i, h))
            self.w_down.view(e, h, i).copy_(tensor.transpose(1, 2))
            return "w_down"
        if kind == "down_proj_bias" and self.b_down is not None:
            _check(kind, tensor, (e, h))
            self.b_down.view(e, h).copy_(tensor)
            return "b_down"
        raise ValueError(f"MoE experts have no {kind!r}")


def _check(kind: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"experts.{kind}: checkpoint shape {tuple(tensor.shape)} != model {shape}")
