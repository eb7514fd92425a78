"""The prefill service's process: Prefill + health + reflection on the shared lifecycle
(shared/serving/runtime.py: listen, load on a thread, ready, SIGTERM drain)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

from prefill_service.config import PrefillConfig
from prefill_service.scheduler import PrefillScheduler
from prefill_service.servicer import SERVICE_NAME, PrefillServicer, PrefillServing
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.serving.api.validation import Limits
from shared.serving.runtime import (
    add_health,
    build_engine,
    new_server,
    run_service,
    service_telemetry,
)
from shared.serving.scheduler_base import Scheduler, SchedulerConfig
from shared.serving.telemetry import Telemetry
from shared.transfer.ranks import wire_layout

__all__ = ["add_services", "build_serving", "serve"]


def build_serving(cfg: PrefillConfig, on_rank_death: Callable[[str], None] | None = None) -> PrefillServing:
    """Load the model, build the Engine and start its scheduler thread (blocking: run off the loop).
    `on_rank_death`: see `build_engine`."""
    loaded, engine = build_engine(cfg, "prefill", on_rank_death=on_rank_death)
    scheduler = PrefillScheduler(engine, SchedulerConfig(max_queue=cfg.max_queue))
    scheduler.start()
    limits = Limits(vocab_size=loaded.config.vocab_size, max_context=engine.max_context())
    return PrefillServing(
        loaded,
        scheduler,
        limits,
        wire_layout(engine, loaded.name, loaded.fingerprint),
    )


def add_services(
    server: grpc.aio.Server, telemetry: Telemetry | None = None, *, with_reflection: bool = False
) -> tuple[PrefillServicer, health.aio.HealthServicer]:
    servicer = PrefillServicer(telemetry)
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
    return servicer, add_health(server, SERVICE_NAME, with_reflection=with_reflection)


async def serve(cfg: PrefillConfig) -> int:
    server = new_server(cfg)
    telemetry = service_telemetry("prefill", cfg)
    servicer, health_servicer = add_services(server, telemetry, with_reflection=cfg.reflection)

    def attach(serving: PrefillServing) -> Scheduler:
        if telemetry.metrics is not None:
            telemetry.metrics.bind_model(serving.loaded.name)  # before the first request is recorded
        servicer.serving = serving
        return serving.scheduler

    build = functools.partial(build_serving, cfg)  # build(on_rank_death)
    return await run_service("prefill", cfg, server, health_servicer, SERVICE_NAME, build, attach, telemetry)
