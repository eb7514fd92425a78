"""ModelRunner: one forward of a ForwardBatch through the model, the KV cache and the sampler.

`forward` only enqueues device work: no host sync inside. It returns the sampled tokens on device,
their copy on its way to pinned host memory, and the one event the scheduler waits on (the one wait
per step) before reading that copy. The checks of the inputs and of every sliding layer's history
run inside `invariants.concurrent_checks`: on CUDA beside the layers, on a side stream, instead of
one small kernel each in series with them.

Input tokens take one path: the token table. Every step that samples writes each row's token into
`token_table[slot]` (the greedy argmax kernel itself; else one index copy after the sampler), and
every forward reads an input id of -1 from `token_table[token_slot]` (`take_tokens`, the forward's
first kernel). So the host launches step N+1 before it has read step N's tokens, naming them -1,
and builds nothing on the host to route them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from invariants import Invariant, Severity, concurrent_checks, expect, predicates
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.cuda_graph import DecodeGraphs
from shared.engine.kv.cache import KVCache
from shared.engine.kv.window import check_windows
from shared.engine.sampling import SamplingBatch, sample
from shared.kernels import KVStore, kernels_for
from shared.kernels.argmax import argmax_rows
from shared.kernels.attention import AttentionOps, ops_for
from shared.kernels.attention.fused_rope import RopeInKernel
from shared.kernels.decode_advance import DecodeRows, advance_rows
from shared.kernels.kv_quant import FP8_KV_DTYPE
from shared.kernels.token_table import take_tokens
from shared.model import gemm_tuning
from shared.model.layers import RopeArgs
from shared.model.transformer import Transformer

__all__ = ["BatchAttention", "ForwardOutput", "ModelRunner"]

TOKENS_IN_VOCAB = Invariant(
    "engine.token_ids_in_vocab", Severity.FATAL_CONTAINABLE, "input token ids are within the vocabulary"
)
PAGE_IDS_IN_RANGE = Invariant(
    "kv.page_ids_in_range", Severity.FATAL_UNCONTAINABLE, "block tables name pages of the pool"
)
LOGITS_FINITE = Invariant("engine.logits_finite", Severity.FATAL_CONTAINABLE, "sampled logits are finite")
POSITIONS_CONSECUTIVE = Invariant(
    "engine.positions_consecutive", Severity.GUARD,
    "each sequence's tokens carry consecutive positions from where its cache ends",
)  # fmt: skip


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` current for the block: Triton kernels, graph replays and events go to the thread's
    current device, and an engine may live on another (cuda:1 of a process that sees two GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def expected_positions(batch: ForwardBatch) -> torch.Tensor:
    """q_start[s] + (t - cu_q[s]) for every token t of sequence s, without a host sync (sizes known)."""
    if batch.mode is Mode.DECODE:  # one token a sequence: its start (one kernel, not ten in the graph)
        return batch.q_start.long()
    counts = batch.cu_q[1:] - batch.cu_q[:-1]
    n = batch.num_tokens
    starts = torch.repeat_interleave(batch.q_start.long(), counts, output_size=n)
    firsts = torch.repeat_interleave(batch.cu_q[:-1].long(), counts, output_size=n)
    return starts + torch.arange(n, device=counts.device) - firsts


class BatchAttention:
    """The model's AttentionFn for one ForwardBatch: stores K/V and attends, layer by layer.

    With `rope_inside`, in a decode step (one token per sequence) the attention kernels take q and k before
    RoPE and do RoPE and the K/V store themselves (`takes_rope`; shared/kernels/attention/fused_rope.py): no
    RoPE kernel (`EngineConfig.rope_in_attention`, on by default). Otherwise, where it may, it hands the K/V
    store to the model's RoPE kernel (`store_target`): a full layer's rows always (its attention reads them
    from the pages). A sliding layer's store waits for attention in a chunk longer than one token: its later
    tokens would overwrite history its earlier queries read. (A decode token's ring index holds position L -
    W, which its query does not see, so storing it first changes nothing.)

    An FP8 cache's layer scales (`KVCache.quant`, None for a cache in the model's dtype) go with every
    store and every attention call: whichever kernel stores quantizes, attention dequantizes. For an FP8
    o projection attention gives its output as e4m3 codes at V's scale (`fp8_out_scale`).
    """

    def __init__(
        self, cache: KVCache, batch: ForwardBatch, ops: AttentionOps, scale: float, rope_inside: bool = False
    ) -> None:
        self.cache, self.batch, self.ops, self.scale = cache, batch, ops, scale
        # One token per sequence (a decode step): attention applies RoPE and stores the K/V itself.
        self._rope_inside = rope_inside and batch.max_q == 1 and batch.mode is not Mode.REPLAY
        self._stored: set[int] = set()  # layers whose K/V the RoPE kernel stores
        self._rest_cu: torch.Tensor | None = None  # a mixed step's cu_q past its decode rows

    def takes_rope(self, layer: int) -> bool:
        return self._rope_inside

    def fp8_out_scale(self, layer: int) -> torch.Tensor | None:
        return self.cache.v_scale_l[layer]

    def store_target(self, layer: int) -> KVStore | None:
        target = self._target(layer)
        if target is not None:
            self._stored.add(layer)
        return target

    def _target(self, layer: int) -> KVStore | None:
        """Where a layer's K/V go when RoPE stores them (a chunk longer than one token on a sliding
        layer: none, it is stored after attention)."""
        c, b, i = self.cache, self.batch, self.cache.kind_index[layer]
        if not c.is_sliding(layer):
            if b.mode is Mode.REPLAY:  # replay reads the pages the prompt already filled
                return None
            return KVStore(c.k_pages_flat[i], c.v_pages_flat[i], b.full_store, c.quant[layer])
        if b.max_q == 1:
            return KVStore(c.k_ring_flat[i], c.v_ring_flat[i], b.ring_store, c.quant[layer])
        return None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeArgs | None = None,
        sinks: torch.Tensor | None = None, fp8_out: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        c, b, i = self.cache, self.batch, self.cache.kind_index[layer]
        quant = c.quant[layer]  # an FP8 cache's scales (None: the model's dtype)
        extra: dict = {} if sinks is None else {"sinks": sinks}  # gpt-oss's per-head sink logits
        if fp8_out:  # e4m3 codes at V's scale, for an FP8 o projection
            extra["fp8_out"] = True
        inside = None
        if rope is not None:  # takes_rope: RoPE, the K/V store and attention in one call
            target = self._target(layer)
            assert target is not None, "takes_rope holds for decode batches only"
            inside = RopeInKernel(
                rope.positions, rope.cos_sin, target.k_dst, target.v_dst, target.index,
                rope.q_weight, rope.k_weight, rope.eps, rope.rms_x, rope.rms_eps,
            )  # fmt: skip
        stored = layer in self._stored or inside is not None
        if not c.is_sliding(layer):
            if b.mode is not Mode.REPLAY and not stored:  # replay reads the pages the prompt already filled
                self.ops.store_kv(k, v, c.k_pages_flat[i], c.v_pages_flat[i], b.full_store, quant)
            kp, vp = c.k_pages_l[i], c.v_pages_l[i]
            chunk = {} if inside is None else {"k_new": k, "v_new": v, "rope": inside}
            return self._by_part(lambda r, t, cu, max_q: self.ops.paged_attention(
                q[t], kp, vp, b.block_table[r], cu, b.q_start[r], max_q=max_q, scale=self.scale, window=None,
                quant=quant, **chunk, **extra,
            ))  # fmt: skip
        k_ring, v_ring = c.k_ring_l[i], c.v_ring_l[i]  # their history checked at the block's start
        out = self._by_part(lambda r, t, cu, max_q: self.ops.ring_attention(
            q[t], k[t], v[t], k_ring, v_ring, b.slots[r], cu, b.ring_context[r],
            max_q=max_q, scale=self.scale, window=c.window, rope=inside, quant=quant, **extra,
        ))  # fmt: skip
        # Only after attention: the chunk's tokens overwrite history its earlier queries still read.
        # Their positions are stored by `store_ring_positions`, after the history checks.
        if not stored:
            self.ops.store_kv(k, v, c.k_ring_flat[i], c.v_ring_flat[i], b.ring_store, quant)
        return out

    def _by_part(self, attend: Callable[[slice, slice, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """`attend(rows, tokens, cu_q, max_q)` over the whole batch, or, in a mixed step, over its
        decode rows (one token each, as a decode) and its prompt chunks apart, joined in token order."""
        b, nd = self.batch, self.batch.decode_rows
        everything = slice(None)
        if not 0 < nd < b.num_seqs:
            return attend(everything, everything, b.cu_q, b.max_q)
        if self._rest_cu is None:  # once per forward: the chunks' offsets past the decode rows
            self._rest_cu = b.cu_q[nd:] - nd
        decodes = attend(slice(0, nd), slice(0, nd), b.cu_q[: nd + 1], 1)
        chunks = attend(slice(nd, None), slice(nd, None), self._rest_cu, b.max_q)
        if decodes.dtype == FP8_KV_DTYPE:  # e4m3 codes (`fp8_out`), joined as bytes
            return torch.cat([decodes.view(torch.uint8), chunks.view(torch.uint8)]).view(FP8_KV_DTYPE)
        return torch.cat([decodes, chunks])

    def store_ring_positions(self) -> None:
        """Every sliding layer's ring now holds the chunk's positions, in one kernel for all layers
        (each layer stores the same ring indices). Nothing in the forward reads them: attention
        derives positions from the context lengths; only the history checks read `ring_pos`, and a
        concurrent check may read it until its block ends, so this runs after the block."""
        c, b = self.cache, self.batch
        n = len(c.sliding_layers)
        if n:
            c.ring_pos.view(n, -1).index_copy_(1, b.ring_dst, b.ring_pos.expand(n, -1))


HOST_RING = 4  # pinned buffers for greedy steps' tokens (`ModelRunner._host_tokens`)


@dataclass
class ForwardOutput:
    tokens: torch.Tensor  # [B] int64 on device
    logits: torch.Tensor | None  # [B, V] float32, when asked for
    ready: torch.cuda.Event | None  # recorded after sampling and host_tokens' copy (None on CPU: done)
    # `tokens` in pinned host memory, readable once `ready` (a greedy step's: until HOST_RING forwards
    # later, when the runner's ring hands its buffer out again)
    host_tokens: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self, model: Transformer, cache: KVCache, ops: AttentionOps | None = None, *,
        rope_in_attention: bool = True, fold_norms: bool = True,
    ) -> None:  # fmt: skip
        self.model = model
        self.rope_in_attention = rope_in_attention  # decode steps: RoPE + K/V store inside attention
        if fold_norms and cache.device.type == "cuda":
            model.fold_norms()  # no norm kernel in a layer (`EngineConfig.fold_norms`)
        elif not fold_norms and model.norms_folded:
            raise ValueError("ModelRunner: fold_norms=False, but the model's norms are folded already")
        model.sinks_to_float32()
        self.cache = cache
        self.ops = ops or ops_for(cache.device)
        self.scale = model.cfg.attn_scale  # 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar^-1/2
        self.vocab_size = model.cfg.vocab_size
        self.num_pages = cache.cfg.num_pages

        # Each window slot's latest sampled token (the scratch slot's too: padding rows sample into it).
        self.token_table = torch.zeros(cache.scratch_slot + 1, dtype=torch.int64, device=cache.device)
        self.graphs: DecodeGraphs | None = None
        # Greedy steps' tokens, written to pinned memory by the argmax kernel itself: a ring of
        # buffers, each reused only HOST_RING forwards later. The engine reads a step's tokens before
        # it launches the step after next (one step in flight), so a ring of 2 would do.
        self._host_ring: list[torch.Tensor] = []
        self._host_next = 0
        self._host_retired: list[torch.Tensor] = []

    def tune_gemms(self, batch_sizes: list[int]) -> list[gemm_tuning.Tuned]:
        """Time cuBLASLt's algorithms for the decode GEMMs at these batch sizes and set the fastest
        where it beats torch's (`shared/model/gemm_tuning.py`)."""
        kernels = kernels_for(self.cache.device, self.model.kernel_backend, self.model.gemm_backend)
        return gemm_tuning.tune(self.model, batch_sizes, kernels)

    def capture_decode_graphs(self, batch_sizes: list[int], max_pages: int) -> None:
        """Capture the decode forward for these batch sizes (CUDA only; levels frozen at capture)."""
        self.graphs = DecodeGraphs(self.decode_body, self.cache, batch_sizes, max_pages)

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Model + KV + checks up to each sequence's last-token logits (what a CUDA graph holds)."""
        # In series, before the block: this assert must stop the process before attention reads
        # through a bad page id (a concurrent check guarantees only "by the end of the block").
        # Flat: the table's width changes with the batch, and the check kernel specializes on its row
        # width (a new compile, mid-traffic, for each new kind of width); a flat view has one.
        table = batch.block_table
        expect(PAGE_IDS_IN_RANGE, lambda: predicates.in_range(table.reshape(-1), 0, self.num_pages))
        ids = take_tokens(batch.input_ids, batch.token_slots, self.token_table)
        attn = BatchAttention(self.cache, batch, self.ops, self.scale, self.rope_in_attention)
        # Every check in the block reads what the block never writes after it: the batch's inputs,
        # and each sliding layer's `ring_pos`, whose only write in the step follows the block.
        with concurrent_checks(self.cache.device):
            expect(TOKENS_IN_VOCAB, lambda: predicates.in_range(ids, 0, self.vocab_size),
                   rows=batch.token_slots)  # fmt: skip
            expect(POSITIONS_CONSECUTIVE,
                   lambda: predicates.equal(batch.positions, expected_positions(batch)),
                   rows=batch.token_slots)  # fmt: skip
            check_windows(self.cache, batch.slots, batch.ring_context)  # every sliding layer's, at once
            hidden = self.model(ids, batch.positions, attn)
        attn.store_ring_positions()
        if batch.mode is Mode.REPLAY:
            return None
        # In the model's dtype: sampling upcasts where it needs to, a greedy argmax does not (the upcast
        # is exact, so either argmax picks the same token).
        # A decode batch's rows are its last tokens already: no gather (a kernel of the graph less).
        last = hidden if batch.mode is Mode.DECODE else hidden.index_select(0, batch.last_index)
        logits = self.model.compute_logits(last, float32=False)
        expect(LOGITS_FINITE, lambda: predicates.finite(logits), rows=batch.slots)
        return logits

    def decode_body(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step on a graph's static buffers, what the graph captures: the logits, the positions
        the rows sample at, and the rows moved on to the next step's positions with their inputs
        marked -1 (from the token table), so that the next step on the same rows uploads nothing."""
        logits = self.forward_logits(batch)
        assert logits is not None, "a decode batch has logits"
        rows = DecodeRows(**{f.name: getattr(batch, f.name) for f in fields(DecodeRows)})
        c = self.cache
        return logits, advance_rows(rows, page_size=c.page_size, window=c.ring_len, skip_slot=c.scratch_slot)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, sampling: SamplingBatch | None, *, return_logits: bool = False
    ) -> ForwardOutput:
        with on_device(self.cache.device):
            return self._forward(batch, sampling, return_logits)

    def _forward(self, batch: ForwardBatch, sampling: SamplingBatch | None, keep: bool) -> ForwardOutput:
        ran = self.graphs.run(batch) if self.graphs is not None else None
        if ran is not None:
            logits, sampled_at = ran
        else:
            logits, sampled_at = self.forward_logits(batch), batch.sample_positions
        if logits is None:  # replay: the rings were the point
            return ForwardOutput(torch.empty(0, dtype=torch.int64, device=self.cache.device), None, None)
        rows = batch.num_real
        logits = logits[:rows]  # rows past num_real pad a CUDA graph
        slots = batch.slots[:rows]
        # A greedy step (the sampler's all-greedy case, without its generality): the argmax kernel also
        # writes the tokens to the host's pinned ring and into the token table: no copy op follows it.
        greedy = sampling is None or sampling.all_greedy
        tp = self.model.tp
        if tp is not None and tp.rank > 0:  # tensor parallel: the tokens rank 0 sampled, on the device
            host = None
            tokens = tp.broadcast(torch.empty(rows, dtype=torch.int64, device=logits.device))
            self.token_table.index_copy_(0, slots.long(), tokens)
        elif greedy:  # split over the vocabulary on CUDA; torch.argmax on CPU
            host = self._host_tokens(rows) if logits.is_cuda else None
            tokens = argmax_rows(logits, host_out=host, scatter_out=(self.token_table, slots))
        else:
            host = None
            tokens = sample(logits, sampling, sampled_at[:rows])
            self.token_table.index_copy_(0, slots.long(), tokens)
        if tp is not None and tp.rank == 0:
            tp.broadcast(tokens)
        ready = None
        if tokens.is_cuda:  # the tokens' way to the host starts here, so one event covers both
            if host is None:
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        return ForwardOutput(tokens, logits.float() if keep else None, ready, host[:rows])

    def _host_tokens(self, rows: int) -> torch.Tensor:
        """The next pinned buffer of the ring, for a greedy step's tokens (grown to `rows` as needed)."""
        if len(self._host_ring) < HOST_RING or self._host_ring[0].numel() < rows:
            size = max(rows, 64, self._host_ring[0].numel() if self._host_ring else 0)
            ring = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(HOST_RING)]
            # Kept alive: a launch in flight may still write the smaller ones (freed, torch's pinned
            # cache could hand them to another copy meanwhile). A few KB, once per growth.
            self._host_retired += self._host_ring
            self._host_ring = ring
        self._host_next = (self._host_next + 1) % HOST_RING
        return self._host_ring[self._host_next]
