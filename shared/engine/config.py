"""The Engine's configuration, frozen and built once."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_tokens: int = 256  # token budget per step: the decodes' tokens, then prompt chunks
    max_running: int = 32
    overlap: bool = True  # prepare step N+1 while step N runs
    # Decode in every step beside prompt chunks (bounds the wait between two tokens to one step), or
    # (False) prompt chunks alone while any prompt has work, then decode.
    mixed: bool = False
    # Decode batch sizes captured as CUDA graphs on a CUDA device; () = eager only.
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    # Decode steps apply RoPE and store the K/V inside the attention kernels: one kernel a layer fewer.
    # On a CPU the torch ops do RoPE, the store and attention in turn: the same.
    rope_in_attention: bool = True
    # On CUDA, each layer's RMSNorm weights are multiplied into the GEMM weights after them once
    # (`Transformer.fold_norms`: it changes the model the engine is given): the residual adds go into
    # the o and down projections' GEMMs, the row scales into attention and the SwiGLU kernel, and a
    # layer runs no norm kernel. On a CPU the model is left as it is.
    fold_norms: bool = True
    # On CUDA, before the decode graphs are captured: each decode GEMM that goes to cuBLAS takes the
    # fastest of cuBLASLt's algorithms for its shape, timed on the model's weights, where it clearly
    # beats torch's pick (`shared/model/gemm_tuning.py`; needs nvmath-python, the gpu extra). False
    # forgets earlier engines' choices on the same model: torch's GEMMs.
    tune_gemms: bool = True
    # Requests share the KV pages of prompt prefixes computed before (shared/engine/kv/prefix_index.py):
    # a hit computes only the rest of its prompt; sliding layers restore their window at the hit from a
    # snapshot in the pool, or rebuild it by bounded replay (docs/prefix-caching.md).
    prefix_cache: bool = False
