"""Real decode servers for the service tests: a subprocess (`python -m decode_service`) on a free port,
or an in-process grpc.aio server on its own event loop thread. Both serve tiny random models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.config import ServiceConfig
from decode_service.server import add_services, build_serving
from decode_service.servicer import SERVICE_NAME, Serving
from shared.client.client import Client, GenerationError
from shared.engine.kv.cache import KVCache, KVConfig
from shared.model import LoadedModel
from shared.model.fingerprint import fingerprint
from shared.pb.pdserve.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from shared.serving.api.model_source import load_served_model
from shared.transfer.base import KVLayout

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "layers": "SSFS",
    "window": 8,
    "vocab": 97,
    "seed": 0,
}  # shared.serving.api.model_source's random model


def random_spec(**overrides: Any) -> str:
    return "random:" + json.dumps({**TINY, **overrides}, separators=(",", ":"))


def kv_layout(page_size: int, **overrides: Any) -> prefill_pb2.KVLayout:
    """The KV layout a service serving random_spec(**overrides) with --page-size announces."""
    return layout_of(load_served_model(random_spec(**overrides)), page_size)


def layout_of(loaded: LoadedModel, page_size: int) -> prefill_pb2.KVLayout:
    """The KV layout a service serving `loaded` (as loaded, norms unfolded) with --page-size announces."""
    cache = KVCache(loaded.config, KVConfig(page_size=page_size, num_pages=1, max_requests=1))
    return KVLayout.of(cache, loaded.name, fingerprint(loaded.model, loaded.tokenizer)).to_pb()


class ServerProcess:
    """`python -m decode_service` (or `module`) in a subprocess; `target` once it listens."""

    def __init__(
        self, model: str, *args: str, wait_ready: bool = True, module: str = "decode_service",
        service: str = SERVICE_NAME, port: int = 0, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"{module}-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--model", model]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [*cmd, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(60):
            self.kill()
            raise RuntimeError(f"server did not start:\n{self.log()}")
        self.target = self.lines[0].rsplit(" ", 1)[1]
        if wait_ready:
            try:
                wait_health(self.target, service, health_pb2.HealthCheckResponse.SERVING, timeout=60)
            except TimeoutError as e:  # say why: the server's own log
                raise TimeoutError(f"{e}; its log ends:\n{self.log()[-3000:]}") from e

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if "listening on" in line:
                self._listening.set()

    def log(self) -> str:
        return Path(self._log.name).read_text()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        Path(self._log.name).unlink(missing_ok=True)


def stop_all(*procs: ServerProcess) -> None:
    """SIGTERM every process first (they drain in parallel), then wait for and reap each."""
    for p in procs:
        if p.proc.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        finally:
            p.kill()


@contextlib.contextmanager
def remote_pair(
    *common: str, prefill_env: dict[str, str] | None = None
) -> Iterator[tuple[Client, PrefillInfo]]:
    """A prefill and a decode process on the tiny random model, decode sending every prompt to
    prefill; yields decode's Client and prefill's stub, and stops both after."""
    from prefill_service.servicer import SERVICE_NAME as PREFILL

    env = prefill_env
    prefill = ServerProcess(random_spec(), *common, module="prefill_service", service=PREFILL, env=env)
    decode = ServerProcess(
        random_spec(), *common, "--prefill-target", prefill.target, "--local-prefill-max-tokens", "0"
    )
    info = PrefillInfo(prefill.target)
    try:
        with Client(decode.target) as client:
            yield client, info
    finally:
        info.close()
        stop_all(decode, prefill)


def health_status(target: str, service: str, channel: grpc.Channel | None = None) -> int:
    """grpc.health.v1 Check of `service` at `target` (over `channel` when given: TLS, say)."""
    if channel is not None:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(req, timeout=5).status
    with grpc.insecure_channel(target) as ch:
        return health_status(target, service, ch)


def wait_health(
    target: str, service: str, want: int, timeout: float = 30, channel: grpc.Channel | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if health_status(target, service, channel) == want:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service!r} on {target} never reached health status {want}")
        time.sleep(0.05)


class PrefillInfo:
    """The prefill service's stub; `model_info` answers what Client.model_info does, so wait_pool_idle
    reads prefill's pool too."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self.stub = prefill_pb2_grpc.PrefillStub(self._channel)

    def model_info(self) -> generation_pb2.ModelInfo:
        return self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)

    def close(self) -> None:
        self._channel.close()


def abandon_then_idle(
    client: Client, prefill: PrefillInfo, prompt: list[int], timeouts: Sequence[float], idle_s: float = 20
) -> None:
    """Requests whose deadlines end mid-flight (in the queue, the compute or the transfer); then both
    pools must come back to their idle baseline (a zero-copy backend's lease included)."""
    failed = 0
    for timeout in timeouts:
        try:
            client.complete(prompt, max_tokens=300, temperature=0.0, ignore_eos=True, timeout=timeout)
        except GenerationError:
            failed += 1
    assert failed >= len(timeouts) - 2, f"only {failed} of {len(timeouts)} deadlines ended their request"
    wait_pool_idle(client, timeout=idle_s)
    wait_pool_idle(prefill, timeout=idle_s)  # type: ignore[arg-type]


def wait_pool_idle(client: Client, timeout: float = 10) -> None:
    """Every page and window slot back (free, or kept by the prefix cache), nothing running or waiting:
    the pool's idle baseline."""
    deadline = time.monotonic() + timeout
    while True:
        pool = client.model_info().kv_pool
        if (
            pool.pages_free + pool.pages_cached == pool.pages_total
            and pool.window_slots_free == pool.window_slots_total
            and pool.running == pool.waiting == 0
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pool not back at its idle baseline: {pool}")
        time.sleep(0.02)


class InProcessServer:
    """A grpc.aio server on port 0 in this process, on its own loop thread; `serving` is inspectable."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.serving: Serving = build_serving(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.port = self._call(self._start())
        self.target = f"127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        servicer, health_servicer = add_services(server)
        servicer.serving = self.serving
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def close(self) -> None:
        self._call(self.server.stop(1))
        self.serving.scheduler.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
