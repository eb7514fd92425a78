"""Configuration both services share: flags, each defaulting to a PDSERVE_* environment variable.

A value the services refuse stops them at parse time: on the command line (`python -m decode_service
--dtype fp8`) argparse's usage line and an error naming the flag, exit 2, before any port is bound or
any model loaded; called with an explicit argv (tests, the Kubernetes manifests' checks) the same
reason raises ValueError.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

__all__ = [
    "COMMON_HELP", "DTYPES", "KV_CACHE_DTYPES", "QUANTIZATIONS", "CommonConfig", "normalize_dtype",
    "parse_config",
]  # fmt: skip

# What users write -> the torch name; "auto" is resolved where the model loads
# (shared/serving/api/model_source.py): the checkpoint's dtype on CUDA, float32 or bfloat16 on CPU.
DTYPES = {
    "auto": "auto",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}  # fmt: skip


# --quantization: the projections' weights (shared/model/quant/fp8.py). A copy, not an import: the
# flags parse without loading torch.
QUANTIZATIONS = ("auto", "none", "fp8", "fp8-block")


# What the KV cache holds: "auto" follows --dtype (the model's); "fp8_e4m3" is float8 e4m3 with a
# static per-tensor scale per layer for K and one for V (shared/kernels/kv_quant.py). "fp8" is vLLM's
# alias of it.
KV_CACHE_DTYPES = {"auto": "auto", "fp8_e4m3": "fp8_e4m3", "fp8": "fp8_e4m3"}


# --tp: ranks of one host (one process each); NVLink joins at most 8 GPUs of an H100/H200 host.
MAX_TP = 8


def normalize_dtype(name: str) -> str:
    """`bf16`, `BFloat16`, `torch.bfloat16` -> `bfloat16`; ValueError for a dtype we do not serve."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[key]


@dataclass(frozen=True)
class CommonConfig:
    host: str = "localhost"  # loopback unless asked: [::] = every address (Kubernetes sets it)
    port: int = 50051  # 0: any free port (the bound one is printed on the "listening" line)
    model: str = ""  # checkpoint path; "" = the embedded default; random:<json> = a tiny test model
    device: str = "auto"  # auto = cuda when available, else cpu
    tp: int = 1  # tensor-parallel ranks, a process each (shared/serving/tensor_parallel.py)
    expert_parallel: bool = False  # --tp > 1: a mixture of experts' experts whole, E/N a rank
    dtype: str = "auto"  # normalized at parse (bf16 -> bfloat16); auto: see DTYPES
    kv_cache_dtype: str = "auto"  # auto: --dtype's; fp8_e4m3 (fp8): an FP8 cache (KV_CACHE_DTYPES)
    quantization: str = "auto"  # weights: auto | none | fp8 | fp8-block (shared/model/quant)
    quantize_lm_head: bool = False  # the LM head FP8 too, with FP8 projections
    gemm: str = "auto"  # the layers' GEMMs on CUDA at few rows (Transformer.gemm_backend)
    tune_gemms: bool = True  # EngineConfig.tune_gemms
    page_size: int = 16
    num_pages: int = 0  # 0 = sized from kv_memory_fraction
    kv_memory_fraction: float = 0.9
    max_running: int = 32
    max_batch_tokens: int = 256
    max_queue: int = 128
    prefix_cache: bool = True  # share the KV pages of prompt prefixes computed before (EngineConfig)
    max_calls: int = 1024  # concurrent RPCs of any kind; grpc answers RESOURCE_EXHAUSTED beyond it
    drain_timeout: float = 30.0  # seconds SIGTERM waits for running requests before aborting them
    metrics_port: int = 9090  # Prometheus /metrics; 0: any free port (printed); the prefill role: 9091
    metrics_host: str = ""  # "" = --host; "::" / "[::]" = every IPv4 and IPv6 address (IPv4 without IPv6)
    metrics: bool = True  # --no-metrics: no /metrics endpoint
    reflection: bool = False  # gRPC server reflection: off unless asked (it lists every method)
    tls_cert: str = ""  # PEM certificate chain: the gRPC port serves TLS (with tls_key)
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA bundle: callers must present a certificate it signed (mutual TLS)
    tls_client_names: str = ""  # comma-separated: a caller's certificate must carry one of these names
    first_message_timeout: float = 10.0  # seconds a call may stay open before its request arrives
    max_request_bytes: int = 4 << 20  # a request message's size limit

    @property
    def client_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.tls_client_names.split(",") if n.strip())

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))  # frozen: normalized once, here
        kv = self.kv_cache_dtype.strip().lower()
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto or fp8_e4m3 (fp8), got {self.kv_cache_dtype!r}"
                + (" (e5m2 is not served: e4m3 keeps a mantissa bit more)" if "e5m2" in kv else "")
            )
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPES[kv])
        for name in ("page_size", "max_running", "max_batch_tokens", "max_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0 (0: sized from memory), got {self.num_pages}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 1 <= self.tp <= MAX_TP:
            raise ValueError(f"tp must be in [1, {MAX_TP}], got {self.tp}")
        if self.expert_parallel and self.tp < 2:
            raise ValueError("expert_parallel places experts over --tp ranks: it needs --tp 2 or more")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.quantize_lm_head and self.quantization == "none":
            raise ValueError("quantize_lm_head quantizes the LM head with FP8 projections: it needs "
                             "--quantization fp8, fp8-block or auto (an FP8 checkpoint)")  # fmt: skip
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.gemm not in ("auto", "cublas", "skinny"):
            raise ValueError(f"gemm must be auto, cublas or skinny, got {self.gemm!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key: mutual TLS is TLS first")
        if self.client_names and not self.tls_client_ca:
            raise ValueError("tls_client_names needs tls_client_ca (names come from verified certificates)")
        if self.first_message_timeout <= 0:
            raise ValueError(f"first_message_timeout must be > 0, got {self.first_message_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")


COMMON_HELP = {
    "host": "address the gRPC port binds: localhost (the default) serves this machine only; [::] = every "
    "IPv4 and IPv6 address (what a container or a pod needs)",
    "port": "port to bind; 0 picks a free one",
    "model": "HF directory or .gguf file; empty = the embedded SmolLM2-135M-Instruct. "
    "Testing aid: random:<json> serves a tiny random model (see shared/serving/api/model_source.py)",
    "device": "auto, cpu, cuda or cuda:N",
    "tp": "tensor-parallel degree: the model's heads, MLP and vocabulary split over this many ranks, one "
    "process each (rank 0 is the service's own process and runs the scheduler; the service starts and "
    "watches the others, and exits with code 4 if one dies). On CUDA rank r uses --device's GPU + r and "
    "NCCL; on CPU every rank runs on the CPU over gloo. The heads and the MLP must split evenly; KV heads "
    "are replicated where there are fewer than ranks. Prefill and decode may differ in degree, with "
    "any --kv-transfer: over nixl or cuda_ipc each prefill rank writes its own KV heads into the "
    "decode ranks that hold them. "
    "docs/tensor-parallel.md",
    "expert_parallel": "with --tp N > 1, a mixture of experts' experts placed whole, E/N on each rank "
    "(each reads only its experts' weights; a token's experts are computed where they live), instead of "
    "every expert sliced over the ranks; attention stays split by heads. The experts must divide by N. "
    "docs/tensor-parallel.md",
    "dtype": "model dtype (the KV cache's too, unless --kv-cache-dtype): auto, bfloat16 (bf16), float16 "
    "(fp16, half) or float32 (fp32, float). "
    "auto: the checkpoint's dtype on CUDA (bfloat16 for a float32 or quantized checkpoint; float16 where "
    "the GPU has no bfloat16), float32 on a CPU",
    "kv_cache_dtype": "what the KV cache holds: auto (the model's --dtype) or fp8_e4m3 (alias fp8): "
    "float8 e4m3 pages and sliding-window rings, half the memory and transfer bytes of bfloat16, with one "
    "K and one V scale per layer (the checkpoint's k_scale / v_scale, else 1.0); attention dequantizes "
    "and accumulates in float32. Prefill and decode must agree (the KV handshake refuses otherwise). "
    "docs/quantization.md",
    "quantization": "the weights of the layers' projections: auto (an FP8 checkpoint's FP8 weights, any "
    "other checkpoint as it is), none (FP8 checkpoints dequantized to --dtype at load), fp8 (quantized to "
    "float8 e4m3 at load, one scale per output channel; an FP8 checkpoint keeps its own scales) or "
    "fp8-block (128x128 block scales, as FP8 checkpoints ship them). Activations are quantized per token "
    "as they come; embeddings, norms and the LM head stay in --dtype. FP8 GEMMs need a GPU of compute "
    "capability 8.9+ (Ada, Hopper); on CPU the reference kernels run. docs/quantization.md",
    "quantize_lm_head": "with FP8 projections (--quantization fp8 or fp8-block, or an FP8 checkpoint): the "
    "LM head FP8 too (scales per output channel, or per row and 128 columns with fp8-block), its input "
    "quantized per token; at decode it is a step's biggest GEMM. A tied embedding keeps its own copy in "
    "--dtype. It costs accuracy: the embedded SmolLM2's perplexity +3.5% with FP8 weights and head "
    "(bf16 on a GPU), under 2% with the weights alone. Prefill and decode must agree (the weights "
    "fingerprint differs). docs/quantization.md",
    "gemm": "the layers' GEMMs on CUDA: auto (the Triton skinny kernel up to 16 rows, and up to 64 for "
    "deep weights such as the down projection; cuBLAS above), cublas, or skinny (up to 64 rows)",
    "tune_gemms": "on CUDA, time cuBLASLt's algorithms for the decode GEMMs at start and keep the fastest "
    "where it beats torch's (needs nvmath-python, the gpu extra); --no-tune-gemms: torch's",
    "page_size": "tokens per KV page",
    "num_pages": "KV pages in the pool; 0 = as many as --kv-memory-fraction leaves room for, at most what "
    "--max-running requests at the model's max context can use (the start-up log says how it was sized)",
    "kv_memory_fraction": "share of the device's memory the service may use: weights, activations and the "
    "KV pool, which gets what is left (GPU: of its total memory, as vLLM's gpu_memory_utilization; "
    "CPU: of the RAM available at start, the pool at most 2 GiB). Used when --num-pages is 0",
    "max_running": "requests running at once (also the number of sliding-window slots)",
    "max_batch_tokens": "prefill token budget per step",
    "max_queue": "requests waiting to run beyond which new calls answer RESOURCE_EXHAUSTED",
    "prefix_cache": "keep the KV pages of computed prompts and let later prompts that start the same "
    "way read them, computing only the rest; sliding-window layers get their window at the boundary "
    "from a snapshot kept in the pool or by bounded replay (docs/prefix-caching.md). The pool evicts "
    "unused cached pages and snapshots, least recently used, when it is short. On both services; decode "
    "asks prefill only for the KV it does not hold. --no-prefix-cache: off",
    "max_calls": "calls in progress at once, of any method (streams that never send their request "
    "included), beyond which new calls answer RESOURCE_EXHAUSTED",
    "drain_timeout": "seconds SIGTERM waits for running requests before aborting them",
    "metrics_port": "port of the Prometheus /metrics endpoint; 0 picks a free one (printed)",
    "metrics_host": "address /metrics binds; empty = the --host address. [::] (or ::) = every IPv4 and "
    "IPv6 address (every IPv4 address where the host has no IPv6)",
    "metrics": "serve Prometheus /metrics (--no-metrics: off)",
    "reflection": "serve gRPC server reflection (grpcurl and the like can list and call every method "
    "without the protos); off unless asked",
    "tls_cert": "PEM certificate chain the gRPC port serves TLS with (needs --tls-key); re-read at the next "
    "TLS handshake after the file changes (Secret rotation); empty = plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: every caller must present a certificate it signed (mutual TLS); "
    "health checks too",
    "tls_client_names": "comma-separated names; a caller's certificate must carry one of them (a SAN or "
    "the CN), else PERMISSION_DENIED; health checks are exempt. The prefill service sets decode's "
    "certificate name here, so that only decode can call it. Needs --tls-client-ca",
    "first_message_timeout": "seconds a call may stay open before its request message arrives; then "
    "DEADLINE_EXCEEDED (a client that opens streams and sends nothing holds no call slot for long)",
    "max_request_bytes": "size limit of a request message: INVALID_ARGUMENT naming this flag above it "
    "(gRPC itself refuses, RESOURCE_EXHAUSTED, what is more than twice over)",
}

C = TypeVar("C", bound=CommonConfig)


def _bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"not a boolean: {text!r}")
    return text.lower() in ("1", "true", "yes")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _var(name: str) -> str:
    return f"PDSERVE_{name.upper()}"


class _VariableError(ValueError):
    """A PDSERVE_* variable that does not convert to its field's type."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _blame(names: Sequence[str], err: ValueError, argv: Sequence[str], env: dict[str, str]) -> str:
    """The error prefixed with the flag it is about (the first field name its message mentions), and
    with the variable the value came from when the command line did not set it."""
    message = str(err)
    at = {n: m.start() for n in names if (m := re.search(rf"\b{n}\b", message))}
    if isinstance(err, _VariableError):
        at = {err.name: 0}
    if not at:
        return message
    name = min(at, key=lambda n: (at[n], -len(n)))
    flag, var = _flag(name), _var(name)
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    origin = "" if given or var not in env or var in message else f" (from ${var}={env[var]!r})"
    return f"argument {flag}{origin}: {message}"


def parse_config(
    cls: type[C], prog: str, description: str, help_: dict[str, str],
    argv: Sequence[str] | None = None, env: dict[str, str] | None = None,
) -> C:  # fmt: skip
    """Every field of `cls` as --flag-name, defaulting to $PDSERVE_FLAG_NAME, then the field's default.

    A refused value (an unparsable variable, or one `cls.__post_init__` rejects): with `argv` None (the
    process's command line) argparse's usage and an error naming the flag, exit 2; with an explicit
    `argv`, ValueError. argparse's own errors (an unknown flag, `--port fifty`) exit 2 either way."""
    command_line = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    names = [f.name for f in fields(cls)]
    try:
        for f in fields(cls):
            var = _var(f.name)
            kind = type(f.default)
            convert = _bool if kind is bool else kind
            try:
                default = convert(env[var]) if var in env else f.default
            except ValueError as e:
                raise _VariableError(f.name, f"${var}={env[var]!r}: {e}") from e
            text = f"{help_[f.name]} (env {var}; default: {default!r})"
            if kind is bool:  # --x / --no-x
                parser.add_argument(
                    _flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=text
                )
            else:
                parser.add_argument(_flag(f.name), type=kind, default=default, help=text)
        return cls(**vars(parser.parse_args(args)))
    except ValueError as e:
        if not command_line:
            raise
        parser.error(_blame(names, e, args, env))  # exits 2
        raise  # unreachable: parser.error exits
