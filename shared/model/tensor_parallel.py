"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPUs): `shard` turns a loaded model
into one rank's share of it, and the model's forward then reduces where the shares meet.

What a rank of N holds (Megatron's split, as vLLM and SGLang use it):

- attention: q heads [r Hq/N, (r+1) Hq/N) and their KV heads, a block of Hkv/N, or, with fewer KV heads
  than ranks, the one its q heads read (replicated on N/Hkv ranks); the o projection's columns of those
  heads (row-parallel: each rank's output is a partial sum); gpt-oss's sinks of its heads;
- MLP: a slice of I/N of gate and of up (column-parallel) and the same columns of down (row-parallel);
  a mixture of experts slices each expert the same way, the router replicated, or, expert parallel,
  holds E/N experts whole (each token's slots are computed by the ranks holding their experts, and the
  same all-reduce sums them);
- embedding and LM head: a block of ceil(V/N) vocabulary rows each (vocab-parallel): a token's row comes
  from the rank that holds it (the others add zeros), and the logits are gathered;
- norms, RoPE tables: replicated.

Each sublayer's output is all-reduced once (after o and after down), before the residual add; a bias
of a row-parallel projection is added by rank 0 alone. `shard` is given the whole model (every rank
loads the checkpoint, then keeps its share): simple, and what a model that fits one host's memory
allows.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import SwiGLU
from shared.model.moe import MoE
from shared.model.transformer import Transformer

__all__ = ["TensorParallel", "check_split", "kv_heads_of", "shard"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world` in `group` (None: the default process group)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `t`, in place."""
        dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank, in place (the tokens rank 0 sampled)."""
        dist.broadcast(t, dist.get_global_rank(self.group, 0) if self.group is not None else 0, self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def kv_heads_of(num_heads: int, num_kv_heads: int, rank: int, world: int) -> range:
    """The KV heads rank `rank` of `world` holds: a block of Hkv/N, or the one its q heads read."""
    if num_heads % world:
        raise ValueError(f"tensor parallel: {num_heads} attention heads do not split over {world} ranks")
    if num_kv_heads % world == 0:
        per = num_kv_heads // world
        return range(rank * per, (rank + 1) * per)
    if world % num_kv_heads:
        raise ValueError(
            f"tensor parallel: {num_kv_heads} KV heads neither split over {world} ranks nor divide them"
        )
    head = rank * num_kv_heads // world
    return range(head, head + 1)


def check_split(cfg: ModelConfig, world: int, expert_parallel: bool = False) -> None:
    """ValueError, naming what, unless a model of `cfg` splits over `world` ranks (its experts whole,
    `expert_parallel`, or each sliced)."""
    kv_heads_of(cfg.num_heads, cfg.num_kv_heads, 0, world)
    _split(cfg.intermediate_size, world, "intermediate_size")
    if cfg.moe is not None and expert_parallel:
        _split(cfg.moe.num_experts, world, "num_experts")
    elif cfg.moe is not None:
        _split(cfg.moe.intermediate_size, world, "expert size")
    elif expert_parallel:
        raise ValueError("expert parallel: the model has no experts")


@torch.no_grad()
def shard(model: Transformer, tp: TensorParallel, expert_parallel: bool = False) -> Transformer:
    """A new model holding rank tp.rank's share of `model` (which is left as it is), its forward
    reducing over tp's group. Its config has the rank's head and MLP sizes (the KV cache built from it
    holds the rank's KV heads); vocab_size stays the model's. `expert_parallel`: a mixture of experts'
    experts are placed whole, E/N a rank (`MoeConfig.held`), rather than each sliced along I."""
    cfg, n, r = model.cfg, tp.world, tp.rank
    if model.norms_folded or model.quantization != "none":
        raise ValueError("tensor parallel: shard the model as loaded (norms unfolded, unquantized)")
    check_split(cfg, n, expert_parallel)
    q_per = cfg.num_heads // n if cfg.num_heads % n == 0 else None
    kv = kv_heads_of(cfg.num_heads, cfg.num_kv_heads, r, n)
    inter = _split(cfg.intermediate_size, n, "intermediate_size")
    moe = None
    if cfg.moe is not None and expert_parallel:
        per = cfg.moe.num_experts // n
        moe = dataclasses.replace(cfg.moe, held=(r * per, (r + 1) * per))
    elif cfg.moe is not None:
        moe = dataclasses.replace(
            cfg.moe, intermediate_size=_split(cfg.moe.intermediate_size, n, "expert size")
        )
    local = dataclasses.replace(cfg, num_heads=q_per, num_kv_heads=len(kv), intermediate_size=inter, moe=moe)
    out = Transformer(local, model.kernel_backend).to(device=model.embed_tokens.weight.device,
                                                       dtype=model.embed_tokens.weight.dtype)  # fmt: skip
    out.gemm_backend = model.gemm_backend
    out.tp = tp
    out.kv_heads, out.whole_kv_heads = kv, cfg.num_kv_heads
    d = cfg.head_dim
    q_rows = slice(r * q_per * d, (r + 1) * q_per * d)  # type: ignore[operator]
    for src, dst in zip(model.layers, out.layers, strict=True):
        dst.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
        dst.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
        for name in ("attn_out_norm", "mlp_out_norm"):
            if getattr(src, name) is not None:
                getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
        _attention(src.self_attn, dst.self_attn, cfg, q_rows, kv, r, tp)
        _mlp(src.mlp, dst.mlp, r, n, tp)
    out.norm.load_state_dict(model.norm.state_dict())
    vocab = math.ceil(cfg.vocab_size / n)
    rows = slice(r * vocab, min((r + 1) * vocab, cfg.vocab_size))
    out.embed_tokens = _vocab_rows(model.embed_tokens.weight, rows, vocab)
    out.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False).to(model.lm_head.weight)
    if cfg.tie_word_embeddings:
        out.tie_weights()
    else:
        out.lm_head.weight.zero_()[: rows.stop - rows.start].copy_(model.lm_head.weight[rows])
    out.vocab_start = rows.start
    out.rotary.reset_buffers(model.embed_tokens.weight.device)
    return out.eval()


def _split(size: int, n: int, what: str) -> int:
    if size % n:
        raise ValueError(f"tensor parallel: {what} {size} does not split over {n} ranks")
    return size // n


def _attention(
    src: nn.Module, dst: nn.Module, cfg, q_rows: slice, kv: range, rank: int, tp: TensorParallel
) -> None:  # type: ignore[no-untyped-def]
    d, qs, kvs = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    k_rows = slice(qs + kv.start * d, qs + kv.stop * d)
    v_rows = slice(qs + kvs + kv.start * d, qs + kvs + kv.stop * d)
    w = src.qkv_proj.weight
    dst.qkv_proj.weight.copy_(torch.cat([w[q_rows], w[k_rows], w[v_rows]]))
    if src.qkv_proj.bias is not None:
        b = src.qkv_proj.bias
        dst.qkv_proj.bias.copy_(torch.cat([b[q_rows], b[k_rows], b[v_rows]]))
    dst.o_proj.weight.copy_(src.o_proj.weight[:, q_rows])
    if src.o_proj.bias is not None:  # added once, by rank 0
        dst.o_proj.bias.copy_(src.o_proj.bias if rank == 0 else torch.zeros_like(src.o_proj.bias))
    for name in ("q_norm", "k_norm"):
        if getattr(src, name) is not None:
            getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
    if src.sinks is not None:
        heads = q_rows.start // d, q_rows.stop // d
        dst.sinks.copy_(src.sinks[heads[0] : heads[1]])
    dst.reduce = tp.all_reduce


def _mlp(src: nn.Module, dst: nn.Module, rank: int, n: int, tp: TensorParallel) -> None:
    if isinstance(src, SwiGLU):
        i = src.intermediate // n
        cols = slice(rank * i, (rank + 1) * i)
        gate, up = src.gate_up_proj.weight.split(src.intermediate)
        dst.gate_up_proj.weight.copy_(torch.cat([gate[cols], up[cols]]))
        dst.down_proj.weight.copy_(src.down_proj.weight[:, cols])
    elif dst.cfg.held is not None:  # expert parallel: this rank's experts, whole; each adds its own biases
        assert isinstance(src, MoE) and isinstance(dst, MoE)
        e, i, h = src.cfg.num_experts, src.cfg.intermediate_size, src.hidden
        mine = slice(*dst.cfg.held)
        dst.router.load_state_dict(src.router.state_dict())
        dst.w_gate_up.copy_(src.w_gate_up.view(e, 2 * i, h)[mine].reshape(-1, h))
        dst.w_down.copy_(src.w_down.view(e, h, i)[mine].reshape(-1, i))
        if src.b_gate_up is not None:
            dst.b_gate_up.copy_(src.b_gate_up.view(e, 2 * i)[mine].reshape(-1))
            dst.b_down.copy_(src.b_down.view(e, h)[mine].reshape(-1))
    else:
        assert isinstance(src, MoE) and isinstance(dst, MoE)
        e, i, h = src.cfg.num_experts, src.cfg.intermediate_size, src.hidden
        li = i // n
        cols = slice(rank * li, (rank + 1) * li)
        dst.router.load_state_dict(src.router.state_dict())
        gate_up = src.w_gate_up.view(e, 2, i, h)[:, :, cols]
        dst.w_gate_up.copy_(gate_up.reshape(e * 2 * li, h))
        dst.w_down.copy_(src.w_down.view(e, h, i)[:, :, cols].reshape(e * h, li))
        if src.b_gate_up is not None:
            dst.b_gate_up.copy_(src.b_gate_up.view(e, 2, i)[:, :, cols].reshape(-1))
            dst.b_down.copy_(src.b_down if rank == 0 else torch.zeros_like(src.b_down))
    dst.reduce = tp.all_reduce


def _vocab_rows(weight: torch.Tensor, rows: slice, vocab: int) -> nn.Embedding:
    """An embedding of `vocab` rows: `weight`'s `rows`, then zeros (the last rank's padding)."""
    emb = nn.Embedding(vocab, weight.shape[1]).to(weight)
    emb.weight.zero_()[: rows.stop - rows.start].copy_(weight[rows])
    return emb
