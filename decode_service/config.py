"""The decode service's configuration: flags, each defaulting to a PDSERVE_* environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

__all__ = ["ServiceConfig", "parse_args"]


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "[::]"
    port: int = 50051  # 0: any free port (the bound one is printed on the "listening" line)
    model: str = ""  # checkpoint path; "" = the embedded default; random:<json> = a tiny test model
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 512
    max_running: int = 32
    max_batch_tokens: int = 256
    max_queue: int = 128
    drain_timeout: float = 30.0  # seconds SIGTERM waits for running requests before aborting them

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_running", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.drain_timeout < 0 or not 0 <= self.port < 65536:
            raise ValueError("max_queue and drain_timeout must be >= 0, port in [0, 65535]")


_HELP = {
    "host": "address to bind",
    "port": "port to bind; 0 picks a free one",
    "model": "HF directory or .gguf file; empty = the embedded SmolLM2-135M-Instruct. "
    "Testing aid: random:<json> serves a tiny random model (see shared/api/model_source.py)",
    "device": "auto, cpu, cuda or cuda:N",
    "dtype": "model and KV dtype: float32, bfloat16 or float16",
    "page_size": "tokens per KV page",
    "num_pages": "KV pages in the pool",
    "max_running": "requests decoding at once (also the number of sliding-window slots)",
    "max_batch_tokens": "prefill token budget per step",
    "max_queue": "requests waiting to run beyond which Generate answers RESOURCE_EXHAUSTED",
    "drain_timeout": "seconds SIGTERM waits for running requests before aborting them",
}


def parse_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> ServiceConfig:
    env = dict(os.environ if env is None else env)
    parser = argparse.ArgumentParser(
        prog="python -m decode_service",
        description="pdserve decode service: the public pdserve.v1.Generation gRPC API.",
    )
    for f in fields(ServiceConfig):
        var = f"PDSERVE_{f.name.upper()}"
        kind = type(f.default)
        default = kind(env[var]) if var in env else f.default
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=default,
            help=f"{_HELP[f.name]} (env {var}; default: {default!r})",
        )
    return ServiceConfig(**vars(parser.parse_args(argv)))
