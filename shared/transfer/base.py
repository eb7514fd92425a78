"""What a KV transfer needs both sides to agree on, and the chunk every backend moves.

A backend is two halves: a sender that turns a held request's KV into chunks (prefill side) and a
receiver that writes chunks into reserved pages and a window slot (decode side). `inline` ships the
chunks' bytes in the gRPC stream; a zero-copy backend (cuda_ipc, nixl) would ship descriptors and need
a lease on the prefill pages instead of releasing them right after extraction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from shared.engine.kv.cache import KVCache
from shared.pb.pdserve.v1 import prefill_pb2 as pb

__all__ = ["INFORMATIVE", "Chunk", "KVLayout", "mismatches"]


@dataclass(frozen=True)
class KVLayout:
    model_name: str
    dtype: str
    page_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # The weights and tokenizer (`shared/model/fingerprint.py`): the same layout with other weights
    # hands over KV that decodes as garbage.
    weights: str
    # An FP8 cache's scales (shared/kernels/kv_quant.py): their kind ("" without scales, "per_tensor":
    # one K and one V scale per layer) and values (each layer's K then V). The same bytes under other
    # scales mean other K/V. Defaults: what a peer that predates them sends.
    kv_scale_kind: str = ""
    kv_scales: tuple[float, ...] = ()
    # The side's tensor-parallel degree, for the record: the wire carries every KV head (`num_kv_heads`
    # is the model's) whatever either side's degree, so the two may differ (`INFORMATIVE`).
    tensor_parallel: int = 1

    @classmethod
    def of(
        cls, cache: KVCache, model_name: str, weights: str, *, num_kv_heads: int = 0, tensor_parallel: int = 1
    ) -> KVLayout:
        """The layout of `cache`; `num_kv_heads`: the model's KV heads where the cache holds a rank's share
        of them (0: the cache's own)."""
        m = cache.model
        return cls(
            model_name=model_name,
            weights=weights,
            dtype=str(cache.k_pages.dtype).removeprefix("torch."),
            page_size=cache.page_size,
            num_layers=m.num_layers,
            layer_types=tuple(m.layer_types),
            sliding_window=cache.window,
            num_kv_heads=num_kv_heads or m.num_kv_heads,
            head_dim=m.head_dim,
            vocab_size=m.vocab_size,
            kv_scale_kind="per_tensor" if cache.cfg.fp8 else "",
            kv_scales=cache.scale_values,
            tensor_parallel=tensor_parallel,
        )

    def to_pb(self) -> pb.KVLayout:
        values = asdict(self)
        return pb.KVLayout(
            **{**values, "layer_types": list(self.layer_types), "kv_scales": list(self.kv_scales)}
        )

    @classmethod
    def from_pb(cls, msg: pb.KVLayout) -> KVLayout:
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        return cls(**{
            **values, "layer_types": tuple(msg.layer_types), "kv_scales": tuple(msg.kv_scales),
            "tensor_parallel": max(1, msg.tensor_parallel),
        })  # fmt: skip


INFORMATIVE = frozenset({"tensor_parallel"})  # fields two sides may differ on
_SHOWN = 80  # characters of a value a mismatch message shows: a peer's field may be any size


def mismatches(a: KVLayout, b: KVLayout) -> list[str]:
    """Every field on which `a` and `b` differ, as "name: a != b" (empty when they agree); values are
    cut to a few dozen characters, since one side is whatever a caller sent. Two sequences of one
    length (layer types, scales) also name their first difference, which the cut may hide."""
    out = []
    for f in fields(KVLayout):
        if f.name in INFORMATIVE:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y:
            line = f"{f.name}: {_short(x)} != {_short(y)}"
            if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
                i = next(i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v)
                line += f" (first at [{i}]: {_short(x[i])} != {_short(y[i])})"
            out.append(line)
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


@dataclass(frozen=True)
class Chunk:
    """K and V of positions [token_start, token_start + token_count) of one layer, as raw bytes."""

    layer: int
    window: bool  # a sliding layer's ring (position p lives at ring index p % W)
    token_start: int
    token_count: int
    k: bytes
    v: bytes

    @property
    def nbytes(self) -> int:
        return len(self.k) + len(self.v)

    def to_pb(self) -> pb.KVChunk:
        return pb.KVChunk(
            layer=self.layer, window=self.window, token_start=self.token_start,
            token_count=self.token_count, k=self.k, v=self.v,
        )  # fmt: skip

    def response(self) -> pb.PrefillResponse:
        """The stream message carrying this chunk, its fields set in place: `PrefillResponse(chunk=...)`
        would copy a whole KVChunk into it (a serialization round trip per MB)."""
        msg = pb.PrefillResponse()
        c = msg.chunk
        c.layer, c.window, c.token_start, c.token_count, c.k, c.v = (
            self.layer,
            self.window,
            self.token_start,
            self.token_count,
            self.k,
            self.v,
        )
        return msg

    @classmethod
    def from_pb(cls, msg: pb.KVChunk) -> Chunk:
        return cls(msg.layer, msg.window, msg.token_start, msg.token_count, msg.k, msg.v)
