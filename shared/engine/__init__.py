"""The engine: continuous batching with overlap scheduling over a paged KV cache and sliding-window
rings, CUDA-graph decode steps and sync-free sampling. No server in here: it runs in a notebook and
under a benchmark as it runs in the services."""

from __future__ import annotations

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
