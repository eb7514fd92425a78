"""The decode service's process: Generation + health + reflection, and the shared lifecycle
(shared/serving/runtime.py: listen, load on a thread, ready, SIGTERM drain).

With --prefill-target, start-up handshakes with every prefill replica it names before turning ready
(decode_service/prefill_targets.py): a KV layout mismatch (dtype, page size, layer layout, window, ...)
logs an error naming every mismatching field and the process exits 1, so an orchestrator sees a crash
rather than a decode that is never ready. Later mismatches (a prefill restarted with another
configuration, a new pod behind the same name) are caught per request: every Prefill carries decode's
layout (decode_service/routing.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import grpc

from decode_service.config import ServiceConfig
from decode_service.prefill_client import Pool, PrefillClient, handshake
from decode_service.prefill_targets import (
    STARTUP_WAIT_S,
    Address,
    handshake_all,
    parse_targets,
    resolve,
    resolve_async,
)
from decode_service.routing import Membership, PrefillRouter
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
from shared.transfer.ranks import export_ranks, wire_layout

__all__ = ["add_services", "build_serving", "serve"]

log = logging.getLogger("decode_service")


def build_serving(cfg: ServiceConfig, on_rank_death: Callable[[str], None] | None = None) -> Serving:
    """Load the model, build the Engine, handshake with prefill, start the scheduler (blocking).
    `on_rank_death`: see `build_engine`."""
    loaded, engine = build_engine(cfg, "decode", mixed=cfg.mixed_steps, on_rank_death=on_rank_death)
    ipc = nixl = None
    router = PrefillRouter(None, cfg.local_prefill_max_tokens, cfg.queue_limit)
    if cfg.prefill_target:
        layout = wire_layout(engine, loaded.name, loaded.fingerprint)
        try:
            if cfg.kv_transfer == "cuda_ipc":
                ipc = IpcReceiver(engine.cache)  # the pool's IPC handles, made once
            elif cfg.kv_transfer == "nixl":
                nixl = NixlReceiver(engine.cache)  # the pool registered with this process's agent, once
        except (IpcUnavailable, NixlUnavailable) as e:
            raise StartupError(f"--kv-transfer {cfg.kv_transfer}: {e}") from e
        # With ranks: every rank's pool, each exported by its own process (nixl: its own agent)
        receiver = ipc if ipc is not None else nixl
        pool = export_ranks(engine, receiver) if receiver is not None else None
        pin = engine.cache.device.type == "cuda"  # inline batches upload to it without a host wait
        router = _prefill_router(cfg, layout, pool, pin)
    scheduler = DecodeScheduler(engine, SchedulerConfig(max_queue=cfg.max_queue), ipc, nixl)
    scheduler.start()
    limits = Limits(vocab_size=loaded.config.vocab_size, max_context=engine.max_context())
    kv_dtype = str(engine.cache.k_pages.dtype).removeprefix("torch.")
    return Serving(
        loaded, scheduler, limits, cfg.page_size, kv_dtype,
        router=router, window_history=cfg.window_history,
    )  # fmt: skip


def _prefill_router(cfg: ServiceConfig, layout: KVLayout, pool: Pool | None, pin: bool) -> PrefillRouter:
    """Find the prefill replicas, handshake with each (blocking) and route over them."""
    tls = _prefill_tls(cfg)
    entries = parse_targets(cfg.prefill_target)
    deadline = time.monotonic() + STARTUP_WAIT_S
    try:
        addresses = resolve(entries, wait_s=STARTUP_WAIT_S)  # no prefill pod may be ready yet
    except OSError as e:
        raise StartupError(str(e)) from e

    def shake(a: Address) -> None:
        wait_s = max(deadline - time.monotonic(), 0.0)
        handshake(a.target, layout, wait_s, pool=pool, tls=tls, server_name=a.server_name)

    def make_client(a: Address) -> PrefillClient:
        return PrefillClient(
            a.target, cfg.prefill_timeout, layout, pool, pin=pin, tls=tls, server_name=a.server_name
        )

    answered = handshake_all(addresses, shake)
    down = [a.target for a in addresses if a.target not in answered]
    if down:
        log.warning(
            "prefill replicas %s did not answer the handshake in time: prompts skip them until one does "
            "(asked in the background)", ", ".join(down),
        )  # fmt: skip
    follow = any(e.dns for e in entries)  # DNS names: follow them as the replicas come and go
    membership = Membership(lambda: resolve_async(entries), make_client) if follow else None
    clients = [make_client(a) for a in addresses]
    return PrefillRouter(
        clients, cfg.local_prefill_max_tokens, cfg.queue_limit, down=down, membership=membership
    )


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
        log.error("%s", e)
        return 1
    server = new_server(cfg, tokens)
    telemetry = service_telemetry("decode", cfg)
    servicer, health_servicer = add_services(server, telemetry, with_reflection=cfg.reflection)

    def attach(serving: Serving) -> Scheduler:
        if telemetry.metrics is not None:
            telemetry.metrics.bind_model(serving.loaded.name)  # before the first request is recorded
            router = serving.router
            telemetry.metrics.watch_prefill(lambda: router.usable, router.queue_estimate, router.queue_limit)
        serving.router.start()  # re-handshakes, DNS: on this loop
        servicer.serving = serving
        return serving.scheduler

    build = functools.partial(build_serving, cfg)  # build(on_rank_death)
    return await run_service("decode", cfg, server, health_servicer, SERVICE_NAME, build, attach, telemetry)
