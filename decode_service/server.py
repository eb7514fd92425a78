"""The decode service's process: gRPC server, health, reflection, model loading and SIGTERM drain.

Lifecycle: listen at once (liveness SERVING, readiness NOT_SERVING) -> load the model on a thread ->
readiness SERVING -> on SIGTERM/SIGINT: readiness NOT_SERVING, new Generate calls UNAVAILABLE, running
requests drain for up to --drain-timeout, the rest are aborted (their streams complete with "abort"),
then the server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from decode_service.config import ServiceConfig
from decode_service.scheduler import Scheduler, SchedulerConfig
from decode_service.servicer import SERVICE_NAME, GenerationServicer, Serving
from shared.api.model_source import load_served_model
from shared.api.validation import Limits
from shared.engine import Engine, EngineConfig
from shared.kv.cache import KVConfig
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["add_services", "build_serving", "serve"]

log = logging.getLogger("decode_service")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
_STOP_GRACE_S = 5.0  # after drain: time for the last Complete messages to reach their clients


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def build_serving(cfg: ServiceConfig) -> Serving:
    """Load the model, build the Engine and start its scheduler thread (blocking: run off the loop)."""
    device, dtype = _device(cfg.device), getattr(torch, cfg.dtype)
    loaded = load_served_model(cfg.model, device=device, dtype=dtype)
    kv_dtype = next(loaded.model.parameters()).dtype
    kv = KVConfig(
        page_size=cfg.page_size,
        num_pages=cfg.num_pages,
        max_requests=cfg.max_running,
        dtype=kv_dtype,
        device=device,
    )
    engine_cfg = EngineConfig(max_batch_tokens=cfg.max_batch_tokens, max_running=cfg.max_running)
    engine = Engine(loaded.model, kv, engine_cfg)
    scheduler = Scheduler(engine, SchedulerConfig(max_queue=cfg.max_queue))
    scheduler.start()
    limits = Limits(vocab_size=loaded.config.vocab_size, max_context=engine.max_context())
    return Serving(loaded, scheduler, limits, cfg.page_size, str(kv_dtype).removeprefix("torch."))


async def _load(cfg: ServiceConfig) -> Serving:
    # A daemon thread, not the default executor: a SIGTERM during a long load must not wait for it.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Serving] = loop.create_future()

    def work() -> None:
        result: Serving | None = None
        error: BaseException | None = None
        try:
            result = build_serving(cfg)
        except BaseException as exc:  # handed to the loop, which re-raises it
            error = exc

        def settle() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                assert result is not None
                fut.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop is gone: SIGTERM came during the load
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=work, name="model-load", daemon=True).start()
    return await fut


async def _drain(serving: Serving, timeout: float) -> None:
    sched = serving.scheduler
    sched.stop_accepting()
    if not await asyncio.to_thread(sched.wait_idle, timeout):
        n = sched.abort_all()
        log.warning("drain timeout (%.1fs): aborting %d request(s)", timeout, n)
        await asyncio.to_thread(sched.wait_idle, _STOP_GRACE_S)


def add_services(server: grpc.aio.Server) -> tuple[GenerationServicer, health.aio.HealthServicer]:
    """Generation, grpc.health.v1 and reflection on `server` (also how tests build in-process servers)."""
    servicer = GenerationServicer()
    health_servicer = health.aio.HealthServicer()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    return servicer, health_servicer


async def serve(cfg: ServiceConfig) -> int:
    server = grpc.aio.server()
    servicer, health_servicer = add_services(server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await health_servicer.set("", SERVING)  # liveness: the process answers
    await health_servicer.set(SERVICE_NAME, NOT_SERVING)  # readiness: not until the model is loaded
    await server.start()
    print(f"pdserve decode listening on {cfg.host}:{port}", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(_load(cfg))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done():
        if load.exception() is not None:
            log.error("model load failed", exc_info=load.exception())
            code = 1
        else:
            serving = load.result()

            background: set[asyncio.Task] = set()  # a reference, so the task is not collected mid-flight

            async def unhealthy() -> None:
                # The engine's state is unknown: not ready, and not live either, so the process is replaced.
                await health_servicer.set(SERVICE_NAME, NOT_SERVING)
                await health_servicer.set("", NOT_SERVING)

            def on_failure(exc: BaseException) -> None:  # the scheduler thread: hop to the loop
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lambda: background.add(loop.create_task(unhealthy())))

            serving.scheduler.on_failure = on_failure
            servicer.serving = serving
            await health_servicer.set(SERVICE_NAME, SERVING)
            log.info("ready: %s (%s)", serving.loaded.name, cfg.model or "embedded default")
            print("pdserve decode ready", flush=True)
            await stopping
            log.info("draining (timeout %.1fs)", cfg.drain_timeout)
            await health_servicer.set(SERVICE_NAME, NOT_SERVING)
            await _drain(serving, cfg.drain_timeout)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(_STOP_GRACE_S)
    if servicer.serving is not None:
        servicer.serving.scheduler.shutdown()
    stopping.cancel()
    print("pdserve decode stopped", flush=True)
    return code
