"""The decode service's configuration: the common flags plus where (and when) to prefill remotely."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decode_service.prefill_targets import parse_targets
from shared.serving.config import COMMON_HELP, CommonConfig, parse_config

__all__ = ["KV_TRANSFERS", "ServiceConfig", "parse_args"]

KV_TRANSFERS = ("inline", "cuda_ipc", "nixl")


@dataclass(frozen=True)
class ServiceConfig(CommonConfig):
    # Prefill replicas: HOST:PORT and dns:///NAME:PORT entries, comma-separated; "" = every prompt here.
    prefill_target: str = ""
    local_prefill_max_tokens: int = 0  # prompts of at most this many tokens prefill locally; 0 = none
    # A prefill replica takes no prompt while its queue (estimated) plus the prompt exceeds this many
    # tokens: a number, 0 = no limit, or auto = what it drains in half the prefill timeout (routing.py).
    remote_prefill_max_queued_tokens: str = "auto"
    # Seconds a remote prefill may take past the time its queue (its own prompt included) is expected to take.
    prefill_timeout: float = 30.0
    window_history: bool = True  # ask prefill for the SWA rings; False: rebuild them by bounded replay
    # inline | cuda_ipc (same node, CUDA: prefill writes into this pool) | nixl (cross node, NIXL/UCX)
    kv_transfer: str = "inline"
    mixed_steps: bool = False  # decode in every step beside local prompt chunks (bounded inter-token gaps)
    auth_tokens_file: str = ""  # bearer tokens of the public API (shared/serving/security/tokens.py)
    prefill_tls_ca: str = ""  # the channel to prefill speaks TLS, verified against this CA
    prefill_tls_cert: str = ""  # the certificate decode presents to prefill (mutual TLS)
    prefill_tls_key: str = ""

    @property
    def queue_limit(self) -> int | None:
        """--remote-prefill-max-queued-tokens as a number; None = auto."""
        limit = self.remote_prefill_max_queued_tokens
        return None if limit == "auto" else int(limit)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_target:
            parse_targets(self.prefill_target)  # a malformed entry: ValueError, before any model loads
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        limit = self.remote_prefill_max_queued_tokens
        if limit != "auto" and not limit.isdigit():
            raise ValueError(f"remote_prefill_max_queued_tokens must be auto or a number >= 0, got {limit!r}")
        if self.prefill_timeout <= 0:
            raise ValueError("prefill_timeout must be > 0")
        if self.kv_transfer not in KV_TRANSFERS:
            choices = ", ".join(KV_TRANSFERS)
            raise ValueError(f"kv_transfer must be one of {choices}, got {self.kv_transfer!r}")
        if (self.prefill_tls_cert or self.prefill_tls_key) and not self.prefill_tls_ca:
            raise ValueError("prefill_tls_cert and prefill_tls_key need prefill_tls_ca (TLS to prefill)")
        if bool(self.prefill_tls_cert) != bool(self.prefill_tls_key):
            raise ValueError("prefill_tls_cert and prefill_tls_key go together: give both or neither")
        if self.kv_transfer == "cuda_ipc" and self.device == "cpu":
            raise ValueError("kv_transfer cuda_ipc needs a CUDA device (--device cuda[:N] or auto)")


_HELP = {
    **COMMON_HELP,
    "prefill_target": "the prefill replicas, comma-separated: HOST:PORT (one replica) or dns:///NAME:PORT "
    "(every address NAME resolves to, looked up again every 10 s: a Kubernetes headless Service). Each "
    "prompt goes to the replica that most likely holds its prefix (its leading pages hashed, bounded by "
    "load), skipping replicas that are down (docs/disaggregation.md). Empty = prefill every prompt locally",
    "local_prefill_max_tokens": "prompts of at most this many tokens prefill locally (conditional "
    "disaggregation); 0 = every prompt goes to the prefill service",
    "remote_prefill_max_queued_tokens": "a prefill replica takes no prompt while its queued prompt "
    "tokens (estimated from its replies and this decode's calls in flight there) plus the prompt exceed "
    "this; when no replica would take it, the prompt prefills locally (conditional disaggregation: a deep "
    "queue would cost more time to first token than computing the prompt here). auto = what the replica "
    "drains in half of --prefill-timeout, at the rate this decode measures there (one prompt at a time "
    "until a remote prefill has completed); 0 = no limit. A prompt is never kept here just for being "
    "long: an empty queue takes it",
    "prefill_timeout": "seconds a remote prefill may take past the time the prefill service is expected "
    "to need for it and the prompts queued ahead of it (at its measured drain rate), after which the "
    "request fails UNAVAILABLE (a prefill that died or hung)",
    "kv_transfer": "how prefill hands over the KV: inline (bytes in the gRPC stream; anywhere) or "
    "cuda_ipc (same node: prefill writes into this service's GPU pool through CUDA IPC; both GPUs must be "
    "visible to the prefill process and the two share an IPC namespace) or nixl (any node: prefill writes "
    "into this service's pool, GPU or CPU, with NIXL over UCX; needs pdserve[nixl] on both services)",
    "mixed_steps": "decode every running request in every step, beside the prompt chunks computed "
    "here (a token waits at most one step); default: prompts first, then decode steps (CUDA graphs)",
    "auth_tokens_file": "file of bearer tokens the public API accepts, one `name:token` (or "
    "`name:token:admin`) per line; re-read when it changes. Tokens may also come from the "
    "PDSERVE_AUTH_TOKENS variable (comma-separated). With either, every call but health checks must send "
    "`authorization: Bearer <token>` (else UNAUTHENTICATED), and Abort stops only the caller's own "
    "requests, or any for an admin (else PERMISSION_DENIED). Empty and no variable: no token needed",
    "prefill_tls_ca": "PEM CA bundle the prefill service's certificate must be signed by: the channel to "
    "prefill (and the KV, pool handles and agent metadata it carries) speaks TLS; empty = plaintext",
    "prefill_tls_cert": "PEM certificate chain decode presents to the prefill service (mutual TLS; "
    "needs --prefill-tls-key); re-read when it changes",
    "prefill_tls_key": "PEM private key of --prefill-tls-cert",
    "window_history": "ask prefill for the sliding-window rings (--no-window-history: rebuild them here "
    "by bounded replay)",
}


def parse_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> ServiceConfig:
    return parse_config(
        ServiceConfig,
        "python -m decode_service",
        "pdserve decode service: the public pdserve.v1.Generation gRPC API.",
        _HELP,
        argv,
        env,
    )
