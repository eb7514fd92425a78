"""The decode service's process: Generation + health + reflection, and the shared lifecycle
(shared/serving/runtime.py: listen, load on a thread, ready, SIGTERM drain).

With --prefill-target, start-up handshakes with the prefill service before turning ready: a KV layout
mismatch (dtype, page size, layer layout, window, ...) logs an error naming every mismatching field and
the process exits 1, so an orchestrator sees a crash rather than a decode that is never ready. Later
mismatches (a prefill restarted with another configuration, another pod behind the same name) are
caught per request: every Prefill carries decode's layout (decode_service/routing.py).
"""

from __future__ import annotations

import logging

import grpc

from decode_service.config import ServiceConfig
from decode_service.prefill_client import PrefillClient, handshake
from decode_service.routing import PrefillRouter
from decode_service.scheduler import DecodeScheduler, Scheduler, SchedulerConfig
from decode_service.servicer import SERVICE_NAME, GenerationServicer, Serving
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from shared.serving.api.validation import Limits
from shared.serving.runtime import (
    StartupError,
    add_health,
    build_engine,
    new_server,
    run_service,
    service_telemetry,
)
from shared.serving.security.tls import ClientTLS, TLSError
from shared.serving.security.tokens import TokenError, Tokens
from shared.serving.telemetry import Telemetry
from shared.transfer.base import KVLayout
from shared.transfer.cuda_ipc import IpcReceiver, IpcUnavailable
from shared.transfer.nixl import NixlReceiver, NixlUnavailable

__all__ = ["add_services", "build_serving", "serve"]


def build_serving(cfg: ServiceConfig) -> Serving:
    """Load the model, build the Engine, handshake with prefill, start the scheduler (blocking)."""
    loaded, engine = build_engine(cfg, "decode", mixed=cfg.mixed_steps)
    prefill = ipc = nixl = None
    if cfg.prefill_target:
        layout = KVLayout.of(engine.cache, loaded.name, loaded.fingerprint)
        try:
            if cfg.kv_transfer == "cuda_ipc":
                ipc = IpcReceiver(engine.cache)  # the pool's IPC handles, made once
            elif cfg.kv_transfer == "nixl":
                nixl = NixlReceiver(engine.cache)  # the pool registered with this process's agent, once
        except (IpcUnavailable, NixlUnavailable) as e:
            raise StartupError(f"--kv-transfer {cfg.kv_transfer}: {e}") from e
        pool = ipc.export if ipc is not None else nixl.export if nixl is not None else None
        tls = _prefill_tls(cfg)
        handshake(cfg.prefill_target, layout, pool=pool, tls=tls)
        pin = engine.cache.device.type == "cuda"  # inline batches upload to it without a host wait
        prefill = PrefillClient(cfg.prefill_target, cfg.prefill_timeout, layout, pool, pin=pin, tls=tls)
    router = PrefillRouter(prefill, cfg.local_prefill_max_tokens, cfg.queue_limit)
    scheduler = DecodeScheduler(engine, SchedulerConfig(max_queue=cfg.max_queue), ipc, nixl)
    scheduler.start()
    limits = Limits(vocab_size=loaded.config.vocab_size, max_context=engine.max_context())
    kv_dtype = str(engine.cache.k_pages.dtype).removeprefix("torch.")
    return Serving(
        loaded, scheduler, limits, cfg.page_size, kv_dtype,
        router=router, window_history=cfg.window_history,
    )  # fmt: skip


def _prefill_tls(cfg: ServiceConfig) -> ClientTLS | None:
    if not cfg.prefill_tls_ca:
        return None
    try:
        tls = ClientTLS(cfg.prefill_tls_ca, cfg.prefill_tls_cert, cfg.prefill_tls_key)
        tls.watch()  # the files exist and hold what their flags say, before any call
    except TLSError as e:
        raise StartupError(str(e)) from e
    return tls


def add_services(  # type: ignore[no-untyped-def]
    server: grpc.aio.Server, telemetry: Telemetry | None = None, *, with_reflection: bool = False
):
    """Generation, grpc.health.v1 and (asked) reflection on `server` (also how tests build in-process
    servers)."""
    servicer = GenerationServicer(telemetry)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    return servicer, add_health(server, SERVICE_NAME, with_reflection=with_reflection)


async def serve(cfg: ServiceConfig) -> int:
    try:
        tokens = Tokens.configured(cfg.auth_tokens_file)
    except TokenError as e:
        logging.getLogger("decode_service").error("%s", e)
        return 1
    server = new_server(cfg, tokens)
    telemetry = service_telemetry("decode", cfg)
    servicer, health_servicer = add_services(server, telemetry, with_reflection=cfg.reflection)

    def attach(serving: Serving) -> Scheduler:
        if telemetry.metrics is not None:
            telemetry.metrics.bind_model(serving.loaded.name)  # before the first request is recorded
            router = serving.router
            telemetry.metrics.watch_prefill(lambda: router.usable, router.queue.value, router.queue_limit)
        servicer.serving = serving
        return serving.scheduler

    return await run_service(
        "decode", cfg, server, health_servicer, SERVICE_NAME, lambda: build_serving(cfg), attach, telemetry
    )
