"""The decode service's configuration: the common flags plus where (and when) to prefill remotely."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.service_config import COMMON_HELP, CommonConfig, parse_config

__all__ = ["ServiceConfig", "parse_args"]


@dataclass(frozen=True)
class ServiceConfig(CommonConfig):
    prefill_target: str = ""  # HOST:PORT of a prefill service; "" = every prompt prefills locally
    local_prefill_max_tokens: int = 0  # prompts of at most this many tokens prefill locally; 0 = none
    prefill_timeout: float = 30.0  # seconds one remote prefill (compute + transfer) may take
    window_history: bool = True  # ask prefill for the SWA rings; False: rebuild them by bounded replay

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_prefill_max_tokens < 0 or self.prefill_timeout <= 0:
            raise ValueError("local_prefill_max_tokens must be >= 0 and prefill_timeout > 0")


_HELP = {
    **COMMON_HELP,
    "prefill_target": "HOST:PORT of the prefill service; empty = prefill every prompt locally",
    "local_prefill_max_tokens": "prompts of at most this many tokens prefill locally (conditional "
    "disaggregation); 0 = every prompt goes to the prefill service",
    "prefill_timeout": "seconds a remote prefill may take before the request fails UNAVAILABLE",
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
