"""Decoder-only transformer (Llama / Mistral / Ministral / Qwen2 / Qwen3 / Gemma 3) over a flattened
token batch.

The model never does attention itself: each layer hands RoPE'd q, k and v to an `AttentionFn`, which
owns KV storage and masking (paged caches in the engine, a dense mask in `reference.py`). That keeps
this file free of batch structure, and its forward free of host syncs, so it can be graph-captured.

Elementwise work goes through `ModelKernels` (fused Triton kernels on CUDA, torch elsewhere). Each
sublayer's residual add goes inside the GEMM that ends it (o, down), so a layer costs its four GEMMs,
attention and four small kernels (two norms, RoPE, SwiGLU; RoPE goes inside decode attention). With
the norms folded into the GEMMs after them (`Transformer.fold_norms`, what the engine does on CUDA),
a decode layer runs its four GEMMs, attention and the SwiGLU kernel: the row scales go into
attention and SwiGLU.

Gemma 3 (`ModelConfig.sandwich_norms` and the fields after it) also norms each sublayer's output
before its residual add, so that add is a kernel of its own after the norm rather than inside the
GEMM; its norms scale by 1 + w (loaded so, `load_weights`); its MLP is GeGLU; its embeddings are
scaled by sqrt(hidden); its sliding layers rotate with a RoPE base of their own.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from shared.kernels import Backend, Gemm, KVStore, ModelKernels, kernels_for
from shared.model.config import ModelConfig
from shared.model.layers import RMSNorm, RopeArgs, Rotary, SwiGLU
from shared.model.moe import MoE


class TensorGroup(Protocol):
    """A tensor-parallel group as the forward and the runner use it (`tensor_parallel.TensorParallel`)."""

    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, t: torch.Tensor) -> torch.Tensor: ...


class AttentionFn(Protocol):
    """Attention of one layer over the flattened batch.

    q: [T, Hq, D], k and v: [T, Hkv, D], RoPE (and Qwen3's q/k norm) already applied, unless `rope` is
    given (see `takes_rope`). Returns [T, Hq, D]. Scores are scaled by `ModelConfig.attn_scale`
    (1/sqrt(D), or Gemma's query_pre_attn_scalar^-1/2). Which keys each query
    sees (causality, sequence boundaries, the sliding window of `layer`) is the function's business.
    `sinks` (gpt-oss): float32 [Hq], each head's learned logit that joins every softmax with no value.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeArgs | None = None,
        sinks: torch.Tensor | None = None, fp8_out: bool = False,
    ) -> torch.Tensor: ...  # fmt: skip

    def fp8_out_scale(self, layer: int) -> torch.Tensor | None:
        """The layer's V scale as a float32 [1] tensor on the device where its K/V are stored in FP8,
        else None. Where it is given, `__call__(fp8_out=True)` returns e4m3 codes at that scale
        (`shared/kernels/attention/ops.py`): an FP8 o projection's input, with no quantizer before it.
        Called once per layer."""
        ...

    def takes_rope(self, layer: int) -> bool:
        """Whether the layer's q and k go in before RoPE, with `rope=`: the function applies RoPE and
        stores the K/V itself (inside its attention kernels: no RoPE kernel). Called once per layer."""
        ...

    def store_target(self, layer: int) -> KVStore | None:
        """Where the layer's K/V may be stored by the RoPE kernel, or None (the function stores them).

        Called once per layer, before `__call__`: a function that hands out a target must not store
        that layer's K/V itself (one kernel less per layer)."""
        ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # One matmul for q, k and v; the loader stacks the checkpoint's three matrices into it.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias or cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.local_rope = layer in cfg.rope_local_layers  # Rotary.table: the local layers' RoPE base
        # Tensor parallel (`tensor_parallel.shard`): the all-reduce of the rank's partial o projection
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # gpt-oss: a learned logit per head in every softmax (float32 whatever the model's dtype)
        self.sinks = (
            nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, attn: AttentionFn,
        kernels: ModelKernels, residual: torch.Tensor | None = None, rms_eps: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The o projection's output, or with `residual` (which the call consumes) residual + it, the
        add inside the GEMM. With `rms_eps`, x is the layer's input itself, not its norm, and qkv's
        weight holds the norm's weight (`Transformer.fold_norms`): q, k and v are scaled by x's rows'
        rsqrt(mean(x^2) + eps), inside attention where it applies RoPE, else by a kernel of its own."""
        t = x.shape[0]
        rope_inside = attn.takes_rope(self.layer)
        qkv = kernels.linear(x, self.qkv_proj)
        if rms_eps is not None and not rope_inside:
            qkv = kernels.rms_scale(qkv, x, rms_eps)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        extra: dict = {} if self.sinks is None else {"sinks": self.sinks.float()}
        # An FP8 cache feeding an FP8 o projection: attention writes its output as e4m3 codes at V's
        # scale, which bounds them, so no kernel has to find a scale for them.
        out_scale = attn.fp8_out_scale(self.layer) if kernels.takes_fp8(self.o_proj) else None
        if out_scale is not None:
            extra["fp8_out"] = True
        if rope_inside:
            rms = (x, rms_eps) if rms_eps is not None else None
            out = attn(
                self.layer, q, k, v, rope=rotary.args(positions, qk_norm, rms, self.local_rope), **extra
            )
        else:
            store = attn.store_target(self.layer)
            q, k = rotary(positions, q, k, kernels, qk_norm, store=store, v=v, local=self.local_rope)
            out = attn(self.layer, q, k, v, **extra)
        o = out.reshape(t, self.q_size)
        if out_scale is not None:
            o = kernels.fp8_codes(o, out_scale, q.dtype, self.o_proj)
        if self.reduce is not None:  # tensor parallel: this rank's heads' share, summed over the ranks
            out = self.reduce(kernels.linear(o, self.o_proj))
            return out if residual is None else residual + out
        if residual is not None:
            return kernels.linear_add(o, self.o_proj, residual)
        return kernels.linear(o, self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # before the MLP
        self.mlp: SwiGLU | MoE = (
            MoE(cfg.hidden_size, cfg.moe)  # type: ignore[arg-type]
            if cfg.is_moe(layer)
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
        # Gemma's norms of the attention's and the MLP's outputs (its post_attention_layernorm and
        # post_feedforward_layernorm; its pre_feedforward_layernorm is our post_attention_layernorm)
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        # Transformer.fold_norms: post_attention_layernorm's weight lives in mlp.gate_up_proj's, and
        # (attn_norm_folded) input_layernorm's in self_attn.qkv_proj's
        self.mlp_norm_folded = False
        self.attn_norm_folded = False

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, attn: AttentionFn,
        kernels: ModelKernels,
    ) -> torch.Tensor:  # fmt: skip
        """x is the residual stream (the embedding, for the first layer); returns the stream after the
        layer: `x = x + attn(norm(x))`, then `x = x + mlp(norm(x))`, each add inside the GEMM that ends
        its sublayer (rounded once, into x's storage on CUDA).

        A norm folded into the GEMM after it (`Transformer.fold_norms`) runs no kernel: that GEMM reads
        the stream itself and the norm's row scale is applied after it (in attention, or a kernel of its
        own; in the SwiGLU activation).

        With sandwich norms (Gemma) each sublayer's output is normed first: `x = x + norm(attn(...))`,
        the add after the norm's kernel."""
        attn_eps = self.input_layernorm.eps if self.attn_norm_folded else None
        h = x if self.attn_norm_folded else self.input_layernorm(x, kernels)
        if self.attn_out_norm is None:
            x = self.self_attn(h, positions, rotary, attn, kernels, residual=x, rms_eps=attn_eps)
        else:
            out = self.self_attn(h, positions, rotary, attn, kernels, rms_eps=attn_eps)
            x = x + self.attn_out_norm(out, kernels)
        mlp_eps = self.post_attention_layernorm.eps if self.mlp_norm_folded else None
        h = x if self.mlp_norm_folded else self.post_attention_layernorm(x, kernels)
        if self.mlp_out_norm is None:
            return self.mlp(h, kernels, mlp_eps, residual=x)
        return x + self.mlp_out_norm(self.mlp(h, kernels, mlp_eps), kernels)


# Checkpoint (Hugging Face) names -> (our parameter, shard index in a fused parameter or None).
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
# An FP8 KV cache's per-layer scales as checkpoints name them (llm-compressor's k_scale / v_scale,
# AutoFP8's k_proj / v_proj output_scale): no weight of the model; `shared/serving/kv_scales.py`
# reads them for the cache.
KV_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$"
)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Mixture-of-experts checkpoints: Qwen3-MoE's mlp.experts.E.{gate,up,down}_proj and mlp.gate,
# Mixtral's block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down) and block_sparse_moe.gate,
# gpt-oss's mlp.router and its experts' stacked tensors.
_EXPERT_RE = re.compile(
    r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_PARTS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_ROUTERS = ("mlp.gate", "block_sparse_moe.gate", "mlp.router")
_EXPERTS_WHOLE = tuple(
    f"{w}{suffix}" for w in ("gate_up_proj", "down_proj") for suffix in ("", "_bias", "_blocks", "_scales")
)
# Gemma's sandwich norms -> ours (DecoderLayer): its norm before the MLP is our post_attention_layernorm.
_SANDWICH = {
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


@functools.cache
def _embed_scale(hidden: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) as Hugging Face's Gemma multiplies by it: a float32 tensor cast to the embedding's
    dtype first (sqrt(3072) = 55.4256 is 55.5 in bfloat16)."""
    return float(torch.tensor(hidden**0.5).to(dtype))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Backend = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        # "auto": fused Triton kernels when the input is on CUDA, torch otherwise (see kernels_for).
        self.kernel_backend: Backend = kernels
        self.gemm_backend: Gemm = "auto"  # the Triton path's layer GEMMs (kernels_for)
        # "none", or how `shared/model/quant` quantized the projections ("fp8", "fp8-block"), which
        # then also sets the kernels that run them (fp8_kernels_for): chosen once, not per step.
        self.quantization = "none"
        self.kernel_factory: Callable[[torch.device, Backend, Gemm], ModelKernels] = kernels_for
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Tensor parallel (`tensor_parallel.shard`): the group, and the first vocabulary row this rank's
        # embedding and LM head hold.
        self.tp: TensorGroup | None = None
        self.vocab_start = 0
        # Tensor parallel: the model's KV heads, and which of them this rank's attention holds.
        self.kv_heads = range(cfg.num_kv_heads)
        self.whole_kv_heads = cfg.num_kv_heads

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: the rows this rank holds, zeros for the others, summed over the ranks."""
        assert self.tp is not None
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(held, local, 0)) * held[:, None].to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (again after `to_empty`, which
        materializes each module's parameters separately)."""
        if self.cfg.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # an FP8 head has its own
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: [T] (the batch's sequences, concatenated). Returns normed hidden [T, H]."""
        kernels = self.kernel_factory(input_ids.device, self.kernel_backend, self.gemm_backend)
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        if self.cfg.scale_embeddings:
            x = x * _embed_scale(self.cfg.hidden_size, x.dtype)
        for layer in self.layers:
            x = layer(x, positions, self.rotary, attn, kernels)
        return self.norm(x, kernels)

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden: [N, H] (rows the caller picked, e.g. each sequence's last). Returns [N, V] logits,
        float32 unless `float32=False` (then the model's dtype: a greedy argmax needs no upcast, which
        at batch 64 and a 128k vocabulary is a 48 MB pass of its own)."""
        kernels = self.kernel_factory(hidden.device, self.kernel_backend, self.gemm_backend)
        logits = kernels.head(hidden, self.lm_head)
        if self.tp is not None:  # each rank's vocabulary block, gathered (the last one padded)
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        logits = logits.float() if float32 else logits
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- weights -------------------------------------------------------------------------------------------

    @property
    def norms_folded(self) -> bool:
        return any(layer.mlp_norm_folded for layer in self.layers)

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Multiply each layer's RMSNorm weights into the columns of the GEMM weights after them, once:
        norm(h) @ W^T == (h @ (W * g)^T) * rsqrt(mean(h^2) + eps) row by row. The post-attention norm
        goes into gate/up, the input norm into q/k/v (unless they have a bias, which the row scale
        must not touch). The layers then run no norm kernel: the GEMMs read the residual stream and
        the row scales are applied after them, in the SwiGLU activation and in attention; each residual
        add goes inside the GEMM before it. Results agree with the unfolded model to the dtype's
        rounding (each weight product is rounded once, from float32). Idempotent; weights cannot be
        loaded into a folded model. A norm before an FP8 projection stays (its kernel quantizes the
        GEMM's input: `shared/model/quant/fp8.py` says why), as do Gemma's norms of the sublayers'
        outputs (no GEMM follows them before the residual add)."""
        attention_too = all(layer.self_attn.qkv_proj.bias is None for layer in self.layers)
        for layer in self.layers:
            pairs = []
            if isinstance(layer.mlp, SwiGLU):  # the experts' norm stays: one fold per expert
                pairs.append(("mlp_norm_folded", layer.mlp.gate_up_proj, layer.post_attention_layernorm))
            if attention_too:
                pairs.append(("attn_norm_folded", layer.self_attn.qkv_proj, layer.input_layernorm))
            for flag, linear, norm in pairs:
                if isinstance(linear, nn.Linear) and not getattr(layer, flag):
                    w = linear.weight
                    w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
                    setattr(layer, flag, True)

    @torch.no_grad()
    def sinks_to_float32(self) -> None:
        """gpt-oss's sinks held in float32, the attention kernels' dtype: the forward's cast is then no
        copy (a runner calls this once, rather than paying a cast kernel a layer and step)."""
        for layer in self.layers:
            sinks = layer.self_attn.sinks
            if sinks is not None and sinks.dtype != torch.float32:
                sinks.data = sinks.data.float()

    def _shards(self, name: str) -> list[int] | None:
        """Row sizes of the checkpoint tensors stacked into parameter `name`, None if it is not fused."""
        c = self.cfg
        if ".self_attn.qkv_proj." in name:
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if ".mlp.gate_up_proj." in name:
            return [c.intermediate_size, c.intermediate_size]
        if c.moe is not None and not c.moe.expert_bias:  # gpt-oss's experts load whole (MoE.load_fused)
            if name.endswith(".mlp.w_gate_up"):  # each expert's gate, then its up
                return [c.moe.intermediate_size] * (2 * c.moe.num_experts)
            if name.endswith(".mlp.w_down"):
                return [c.hidden_size] * c.moe.num_experts
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model; every parameter must be covered. Gemma's norm
        weights w arrive as its checkpoints store them and are kept as 1 + w (`unit_offset_norms`)."""
        if self.norms_folded:
            raise ValueError("load_weights: the model's norms are folded into its weights; use a fresh model")
        params = dict(self.named_parameters())
        # Layers that take their checkpoint tensors themselves (FP8: quantized, or e4m3 as they are).
        loaders = {n: m for n, m in self.named_modules() if hasattr(m, "load_tensor")}
        expected = set()
        for name in params:
            shards = self._shards(name)
            expected.update([name] if shards is None else [f"{name}#{i}" for i in range(len(shards))])
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, shard = target
            owner, _, kind = name.rpartition(".")
            if kind in _EXPERTS_WHOLE and isinstance(moe := self.get_submodule(owner), MoE):
                filled = moe.load_fused(kind, tensor)
                loaded.update([] if filled is None else [f"{owner}.{filled}"])
                continue
            if owner in loaders:
                rows = self._shards(name) or [params[f"{owner}.weight"].shape[0]]
                start = sum(rows[:shard]) if shard is not None else 0
                filled = loaders[owner].load_tensor(kind, tensor, start, rows[shard or 0])
                loaded.update(f"{owner}.{k}" + ("" if shard is None else f"#{shard}") for k in filled)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.cfg.architecture}")
            dst = params[name].data
            shards = self._shards(name)
            if shard is not None and shards is not None:
                dst = dst.narrow(0, sum(shards[:shard]), shards[shard])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}"
                )
            if self.cfg.unit_offset_norms and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0  # Gemma's x * (1 + w): the norm holds the multiplier
            dst.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.endswith("rotary_emb.inv_freq") or KV_SCALE_NAME.match(hf_name):
            return None
        if hf_name == "lm_head.weight":
            # A tied checkpoint may still carry a copy of the embedding as lm_head: the embedding wins.
            return None if self.cfg.tie_word_embeddings else ("lm_head.weight", None)
        m = _LAYER_RE.match(hf_name)
        if m is None:
            return (hf_name.removeprefix("model."), None)
        layer, rest = m.groups()
        module, _, kind = rest.rpartition(".")
        if self.cfg.sandwich_norms and module in _SANDWICH:
            return (f"layers.{layer}.{_SANDWICH[module]}.{kind}", None)
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return (f"layers.{layer}.{fused}.{kind}", shard)
        expert = _EXPERT_RE.match(rest)
        if expert is not None:  # Mixtral's and Qwen3-MoE's experts, a tensor each
            e, part = int(expert.group(1)), _EXPERT_PARTS[expert.group(2)]
            if part == "down":
                return (f"layers.{layer}.mlp.w_down", e)
            return (f"layers.{layer}.mlp.w_gate_up", 2 * e + (part == "up"))
        if module in _ROUTERS:
            return (f"layers.{layer}.mlp.router.{kind}", None)
        if module == "mlp.experts" and kind in _EXPERTS_WHOLE:  # gpt-oss
            return (f"layers.{layer}.mlp.{kind}", None)
        return (f"layers.{layer}.{rest}", None)
