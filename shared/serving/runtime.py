"""What both services' processes share: engine building, health, reflection, the load-on-a-thread
start-up and the SIGTERM drain.

Lifecycle: listen at once (liveness SERVING, readiness NOT_SERVING) -> load the model on a thread ->
readiness SERVING -> on SIGTERM/SIGINT: readiness NOT_SERVING, new calls UNAVAILABLE, running requests
drain for up to --drain-timeout, the rest are aborted, then the server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from invariants import InvariantViolation, Violation
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.mirror import LeaderEngine
from shared.kernels.kv_quant import FP8_KV_DTYPE
from shared.model import LoadedModel, Transformer
from shared.model.fingerprint import fingerprint
from shared.model.quant import quantize_head
from shared.serving.api.model_source import load_served_model
from shared.serving.binding import bind
from shared.serving.config import CommonConfig
from shared.serving.kv_scales import checkpoint_kv_scales
from shared.serving.kv_sizing import (
    MemoryPlan,
    Sizing,
    SizingError,
    cpu_available_bytes,
    cuda_activation_bytes,
    plan_pages,
)
from shared.serving.metrics import Metrics, serve_metrics
from shared.serving.scheduler_base import Scheduler
from shared.serving.security.guard import Guard, GuardConfig
from shared.serving.security.tls import ServerTLS, TLSError
from shared.serving.security.tokens import Tokens
from shared.serving.telemetry import Telemetry
from shared.serving.tensor_parallel import join_group, load_whole, share_of, start_ranks

__all__ = [
    "NOT_SERVING", "SERVING", "StartupError", "add_health", "build_engine", "new_server", "run_service",
]  # fmt: skip

EXIT_INVARIANT = 3  # STRICT: an invariant failed, the engine's state cannot be trusted
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
_STOP_GRACE_S = 5.0  # after drain: time for the last messages to reach their clients
T = TypeVar("T")


class StartupError(Exception):
    """A start-up failure with a message that says it all (logged without a traceback)."""


def resolve_device(name: str) -> torch.device:
    """The device `--device` names, with an index: set_device, graph capture and IPC need one.

    `auto` is CUDA when a GPU is visible, else the CPU; `cuda` is the process's current GPU (cuda:0 of
    what CUDA_VISIBLE_DEVICES shows).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)  # the form was checked when the config was parsed
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise StartupError(f"--device {name}: no CUDA device is visible to this process (use cpu or auto)")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise StartupError(f"--device {name}: only cuda:0..cuda:{count - 1} are visible to this process")
    return torch.device("cuda", index)


def build_engine(
    cfg: CommonConfig, role: str, *, mixed: bool = False, on_rank_death: Callable[[str], None] | None = None
) -> tuple[LoadedModel, Engine]:
    """Load the model, build its Engine and warm it up (blocking: run off the event loop). `role`
    names the log; `mixed`: decode tokens in every step beside prompt chunks (`EngineConfig.mixed`).
    With --tp > 1 the other ranks' processes start here (shared/serving/tensor_parallel.py); one that
    dies calls `on_rank_death` (the service reports NOT_SERVING) before the process exits."""
    log = logging.getLogger(f"{role}_service")
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this loading thread's kernels and graph captures go there
    # CPU auto sizing: the RAM free before the weights take theirs (they are subtracted as a whole).
    ram = cpu_available_bytes() if device.type == "cpu" and not cfg.num_pages else 0
    ranks = None
    if cfg.tp > 1:  # rank 0 is this process; the others start once the model is known to split
        try:
            whole = load_whole(cfg, device)
            ranks = start_ranks(cfg, role, device)
        except ValueError as e:
            raise StartupError(str(e)) from e
        ranks.on_death = on_rank_death
        loaded = share_of(whole, cfg, join_group(ranks.rendezvous, 0, cfg.tp, device))
        del whole
        log.info("tensor parallel: rank 0 of %d (%s)", cfg.tp, "NCCL" if device.type == "cuda" else "gloo")
    else:
        loaded = load_served_model(cfg.model, device=device, dtype=cfg.dtype, quantization=cfg.quantization)
        if cfg.quantize_lm_head:
            try:
                quantize_head(loaded.model)
            except ValueError as e:
                raise StartupError(f"--quantize-lm-head: {e}") from e
        # Before the engine rewrites any weight (its folded norms): what the KV handshake compares.
        loaded = dataclasses.replace(loaded, fingerprint=fingerprint(loaded.model, loaded.tokenizer))
        loaded.model.gemm_backend = cfg.gemm
    if loaded.model.quantization != "none":
        log.info("weights: %s (the layers' projections; shared/model/quant)", loaded.model.quantization)
    # The activations' dtype (the embedding's: FP8 projections hold float8 weights), or an FP8 cache.
    kv_dtype, scales = loaded.model.embed_tokens.weight.dtype, ()
    if cfg.kv_cache_dtype == "fp8_e4m3":  # the checkpoint's per-layer scales, else 1.0
        kv_dtype = FP8_KV_DTYPE
        try:
            scales = checkpoint_kv_scales(cfg.model, loaded.config.num_layers)
        except ValueError as e:
            raise StartupError(f"--kv-cache-dtype fp8_e4m3: {e}") from e
        log.info("KV cache: %s, %s", FP8_KV_DTYPE, "the checkpoint's scales" if scales else "scales 1.0")
    kv = KVConfig(
        page_size=cfg.page_size,
        num_pages=cfg.num_pages or 1,
        max_requests=cfg.max_running,
        dtype=kv_dtype,
        device=str(device),
        scales=scales,
    )
    engine_cfg = EngineConfig(
        max_batch_tokens=cfg.max_batch_tokens, max_running=cfg.max_running, mixed=mixed,
        tune_gemms=cfg.tune_gemms, prefix_cache=cfg.prefix_cache,
    )  # fmt: skip
    if not cfg.num_pages:
        sizing = _size_pool(loaded.model, kv, engine_cfg, cfg.kv_memory_fraction, ram)
        log.info("KV pool: %d pages, sized from memory (%s)", sizing.num_pages, sizing.why)
        kv = dataclasses.replace(kv, num_pages=sizing.num_pages)
    if ranks is not None:
        ranks.send_engine(kv, engine_cfg)
        engine: Engine = LeaderEngine(loaded.model, kv, engine_cfg, links=ranks.links, on_close=ranks.stop)
    else:
        engine = Engine(loaded.model, kv, engine_cfg)
    took = engine.warm_up()  # before ready: a first request must not wait on kernel compiles
    if took:
        log.info("warmed up in %.1f s", took)
    return loaded, engine


def _size_pool(
    model: Transformer, kv: KVConfig, engine_cfg: EngineConfig, fraction: float, ram: int
) -> Sizing:
    """--num-pages 0: the pages --kv-memory-fraction leaves room for (shared/serving/kv_sizing.py)."""
    mcfg, device = model.cfg, torch.device(kv.device)
    free = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        weights = torch.cuda.memory_allocated(device)  # what loading left allocated
        activations = cuda_activation_bytes(model, mcfg, kv, engine_cfg)
        free, memory = torch.cuda.mem_get_info(device)
    else:
        tensors = itertools.chain(model.parameters(), model.buffers())
        weights, activations, memory = sum(t.numel() * t.element_size() for t in tensors), 0, ram
    plan = MemoryPlan(
        device=device.type, memory=memory, fraction=fraction, weights=weights, activations=activations,
        window_bytes=KVCache.window_pool_bytes(mcfg, kv.max_requests, kv.dtype),
        page_bytes=KVCache.bytes_per_page(mcfg, kv.page_size, kv.dtype), page_size=kv.page_size,
        max_context=mcfg.max_position_embeddings, max_running=min(engine_cfg.max_running, kv.max_requests),
        free=free,
    )  # fmt: skip
    try:
        return plan_pages(plan)
    except SizingError as e:
        raise StartupError(str(e)) from e


def new_server(cfg: CommonConfig, tokens: Tokens | None = None) -> grpc.aio.Server:
    """A service's gRPC server: every call through the guard (shared/serving/security/guard.py), at most
    --max-calls at once, and a port no other process can share (SO_REUSEPORT off)."""
    guard = Guard(
        GuardConfig(
            tokens=tokens, client_names=cfg.client_names,
            first_message_timeout=cfg.first_message_timeout, max_request_bytes=cfg.max_request_bytes,
        )
    )  # fmt: skip
    options = [
        ("grpc.so_reuseport", 0),
        # The guard names --max-request-bytes for what is over it; gRPC drops what is far over unread.
        ("grpc.max_receive_message_length", 2 * cfg.max_request_bytes),
    ]
    return grpc.aio.server(interceptors=[guard], maximum_concurrent_rpcs=cfg.max_calls, options=options)


def server_tls(cfg: CommonConfig) -> ServerTLS | None:
    if not cfg.tls_cert:
        return None
    return ServerTLS(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.client_names)


def service_telemetry(role: str, cfg: CommonConfig) -> Telemetry:
    """Tracing from the OTEL_* environment, metrics unless --no-metrics."""
    return Telemetry.from_env(role, Metrics(role) if cfg.metrics else None)


async def ready(context: grpc.aio.ServicerContext, serving: T | None) -> T:
    """What a servicer serves with once the model has loaded; before that the call ends UNAVAILABLE
    (which clients retry), the process healthy."""
    if serving is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
    assert serving is not None
    return serving


def add_health(
    server: grpc.aio.Server, service_name: str, *, with_reflection: bool = False
) -> health.aio.HealthServicer:
    """grpc.health.v1 and, when asked (`--reflection`), server reflection for `service_name`, health and
    reflection itself: off by default, since it hands any caller the whole API."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((service_name, health_name, reflection.SERVICE_NAME), server)
    return health_servicer


async def _in_thread(fn: Callable[[], T]) -> T:
    # A daemon thread, not the default executor: a SIGTERM during a long load must not wait for it.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def work() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # handed to the loop, which re-raises it
            error = exc

        def settle() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop is gone: SIGTERM came during the load
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=work, name="model-load", daemon=True).start()
    return await fut


async def _drain(sched: Scheduler, timeout: float, log: logging.Logger) -> None:
    sched.stop_accepting()
    if not await asyncio.to_thread(sched.wait_idle, timeout):
        n = sched.abort_all()
        log.warning("drain timeout (%.1fs): aborting %d request(s)", timeout, n)
        await asyncio.to_thread(sched.wait_idle, _STOP_GRACE_S)


async def run_service(
    role: str, cfg: CommonConfig, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
    service_name: str, build: Callable[[Callable[[str], None]], T], attach: Callable[[T], Scheduler],
    telemetry: Telemetry | None = None,
) -> int:  # fmt: skip
    """Serve until SIGTERM/SIGINT. `build(on_rank_death)` runs on a thread (`build_engine`'s
    `on_rank_death`: reports NOT_SERVING, from any thread); `attach` hands its result to the servicer
    and returns its scheduler. Returns the process exit code."""
    log = logging.getLogger(f"{role}_service")
    telemetry = telemetry or Telemetry(role)
    tls = server_tls(cfg)
    try:
        port = bind(server, cfg.host, cfg.port, tls.credentials() if tls is not None else None)
    except TLSError as e:  # a missing or wrong file: before any model loads
        log.error("%s", e)
        return 1
    except OSError as e:  # the port is taken: say so at once, before any model loads
        log.error("%s", e.strerror or e)
        return 1
    await health_servicer.set("", SERVING)  # liveness: the process answers
    await health_servicer.set(service_name, NOT_SERVING)  # readiness: not until the model is loaded
    await server.start()
    print(f"pdserve {role} listening on {cfg.host}:{port}", flush=True)
    if tls is not None:
        mode = "mutual TLS" if tls.mutual else "TLS"
        names = f", callers named {', '.join(tls.client_names)}" if tls.client_names else ""
        log.info("the port serves %s (%s%s)", mode, cfg.tls_cert, names)
    if cfg.metrics and telemetry.metrics is not None:
        serve_metrics(telemetry.metrics, cfg.metrics_host or cfg.host, cfg.metrics_port, role)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def rank_died(message: str) -> None:  # a tensor-parallel rank's watcher thread; the process exits next
        async def down() -> None:
            await health_servicer.set(service_name, NOT_SERVING)
            await health_servicer.set("", NOT_SERVING)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(down(), loop)

    load = asyncio.create_task(_in_thread(lambda: build(rank_died)))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    fatal: list[BaseException] = []  # an InvariantViolation at STRICT: stop the process
    sched: Scheduler | None = None
    if load.done():
        exc = load.exception()
        if isinstance(exc, StartupError):
            log.error("start-up failed: %s", exc)
            code = 1
        elif exc is not None:
            log.error("model load failed", exc_info=exc)
            code = 1
        else:
            sched = attach(load.result())
            background: set[asyncio.Task] = set()  # a reference, so the task is not collected mid-flight

            async def unhealthy() -> None:
                # The engine's state is unknown: not ready, and not live either, so the process is replaced.
                await health_servicer.set(service_name, NOT_SERVING)
                await health_servicer.set("", NOT_SERVING)

            def on_failure(exc: BaseException) -> None:  # the scheduler thread: hop to the loop
                if isinstance(exc, InvariantViolation):
                    log.critical("%s: stopping the process", exc)
                    fatal.append(exc)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lambda: background.add(loop.create_task(unhealthy())))
                    if fatal:
                        loop.call_soon_threadsafe(stop.set)

            def on_violation(v: Violation, rids: tuple[str, ...]) -> None:  # scheduler thread, rare
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(telemetry.violation, v, rids)

            sched.on_failure = on_failure
            sched.watch_invariants(on_violation)
            if telemetry.metrics is not None:
                telemetry.metrics.watch_pool(sched.pool_state)
            await health_servicer.set(service_name, SERVING)
            log.info("ready (%s): %s", cfg.model or "embedded default", sched.capacity())
            print(f"pdserve {role} ready", flush=True)
            await stopping
            log.info("draining (timeout %.1fs)", cfg.drain_timeout)
            await health_servicer.set(service_name, NOT_SERVING)
            await _drain(sched, cfg.drain_timeout, log)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(_STOP_GRACE_S)
    if sched is not None:
        sched.shutdown()
    stopping.cancel()
    telemetry.shutdown()
    print(f"pdserve {role} stopped", flush=True)
    return EXIT_INVARIANT if fatal else code
