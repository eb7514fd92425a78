"""Configuration both services share: flags, each defaulting to a PDSERVE_* environment variable."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

__all__ = ["COMMON_HELP", "CommonConfig", "parse_config"]


@dataclass(frozen=True)
class CommonConfig:
    host: str = "[::]"
    port: int = 50051  # 0: any free port (the bound one is printed on the "listening" line)
    model: str = ""  # checkpoint path; "" = the embedded default; random:<json> = a tiny test model
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "float32"
    gemm: str = "auto"  # the layers' GEMMs on CUDA at few rows (Transformer.gemm_backend)
    tune_gemms: bool = True  # EngineConfig.tune_gemms
    page_size: int = 16
    num_pages: int = 512
    max_running: int = 32
    max_batch_tokens: int = 256
    max_queue: int = 128
    drain_timeout: float = 30.0  # seconds SIGTERM waits for running requests before aborting them
    metrics_port: int = 9090  # Prometheus /metrics; 0: any free port (printed); the prefill role: 9091
    metrics_host: str = ""  # "" = --host; "::" / "[::]" = every IPv4 and IPv6 address (IPv4 without IPv6)
    metrics: bool = True  # --no-metrics: no /metrics endpoint

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_running", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.drain_timeout < 0 or not 0 <= self.port < 65536:
            raise ValueError("max_queue and drain_timeout must be >= 0, port in [0, 65535]")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.gemm not in ("auto", "cublas", "skinny"):
            raise ValueError(f"gemm must be auto, cublas or skinny, got {self.gemm!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


COMMON_HELP = {
    "host": "address to bind",
    "port": "port to bind; 0 picks a free one",
    "model": "HF directory or .gguf file; empty = the embedded SmolLM2-135M-Instruct. "
    "Testing aid: random:<json> serves a tiny random model (see shared/serving/api/model_source.py)",
    "device": "auto, cpu, cuda or cuda:N",
    "dtype": "model and KV dtype: float32, bfloat16 or float16",
    "gemm": "the layers' GEMMs on CUDA: auto (the Triton skinny kernel up to 16 rows, and up to 64 for "
    "deep weights such as the down projection; cuBLAS above), cublas, or skinny (up to 64 rows)",
    "tune_gemms": "on CUDA, time cuBLASLt's algorithms for the decode GEMMs at start and keep the fastest "
    "where it beats torch's (needs nvmath-python, the gpu extra); --no-tune-gemms: torch's",
    "page_size": "tokens per KV page",
    "num_pages": "KV pages in the pool",
    "max_running": "requests running at once (also the number of sliding-window slots)",
    "max_batch_tokens": "prefill token budget per step",
    "max_queue": "requests waiting to run beyond which new calls answer RESOURCE_EXHAUSTED",
    "drain_timeout": "seconds SIGTERM waits for running requests before aborting them",
    "metrics_port": "port of the Prometheus /metrics endpoint; 0 picks a free one (printed)",
    "metrics_host": "address /metrics binds; empty = the --host address. [::] (or ::) = every IPv4 and "
    "IPv6 address (every IPv4 address where the host has no IPv6)",
    "metrics": "serve Prometheus /metrics (--no-metrics: off)",
}

C = TypeVar("C", bound=CommonConfig)


def _bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"not a boolean: {text!r}")
    return text.lower() in ("1", "true", "yes")


def parse_config(
    cls: type[C], prog: str, description: str, help_: dict[str, str],
    argv: Sequence[str] | None = None, env: dict[str, str] | None = None,
) -> C:  # fmt: skip
    """Every field of `cls` as --flag-name, defaulting to $PDSERVE_FLAG_NAME, then the field's default."""
    env = dict(os.environ if env is None else env)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for f in fields(cls):
        var = f"PDSERVE_{f.name.upper()}"
        kind = type(f.default)
        convert = _bool if kind is bool else kind
        default = convert(env[var]) if var in env else f.default
        flag = f"--{f.name.replace('_', '-')}"
        text = f"{help_[f.name]} (env {var}; default: {default!r})"
        if kind is bool:  # --x / --no-x
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)
    return cls(**vars(parser.parse_args(argv)))
