"""The prefill service's configuration: the flags both services share (shared/serving/config.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.serving.config import COMMON_HELP, CommonConfig, parse_config

__all__ = ["PrefillConfig", "parse_args"]


@dataclass(frozen=True)
class PrefillConfig(CommonConfig):
    port: int = 50052
    metrics_port: int = 9091


def parse_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> PrefillConfig:
    return parse_config(
        PrefillConfig,
        "python -m prefill_service",
        "pdserve prefill service: the internal pdserve.v1.Prefill gRPC API decode services call.",
        COMMON_HELP,
        argv,
        env,
    )
