"""The cpu-demo overlay's settings boot the real services: each process gets exactly the env and args
its container would (envFrom ConfigMaps + env), only the bind addresses moved to free loopback ports, the
prefill target to the local prefill and $HOME to the runner's. Both become ready on their readiness
names, serve /metrics, answer one remote-prefilled request, and drain to exit 0 on SIGTERM."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from k8s_render import ROOT, container, container_env, render

from shared.client.client import Client

pytestmark = pytest.mark.slow
READINESS_NAME = {"decode": "pdserve.v1.Generation", "prefill": "pdserve.v1.Prefill"}


def spawn(role: str, overrides: dict[str, str], log: Path) -> subprocess.Popen:
    objs = render("overlays/cpu-demo")
    ctr = container(objs, role)
    env = {**os.environ, **container_env(objs, ctr), **overrides}
    env.update({"PDSERVE_HOST": "127.0.0.1", "PDSERVE_PORT": "0", "PDSERVE_METRICS_PORT": "0"})
    # The pod's IP (downward API) and its emptyDir home exist only in the pod.
    env.update({"PDSERVE_METRICS_HOST": "127.0.0.1", "HOME": os.environ.get("HOME", str(log.parent))})
    env.update({"OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"})  # no collector here
    cmd = [sys.executable, "-m", *ctr["args"]]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for(proc: subprocess.Popen, log: Path, pattern: str) -> re.Match:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if found := re.search(pattern, log.read_text()):
            return found
        time.sleep(0.2)
    pytest.fail(f"no {pattern!r} in:\n{log.read_text()[-2000:]}")


def test_cpu_demo_settings_serve_a_request(tmp_path: Path) -> None:
    procs = []
    logs = {role: tmp_path / f"{role}.log" for role in ("prefill", "decode")}
    try:
        procs.append(spawn("prefill", {}, logs["prefill"]))
        # The address is printed before the model loads: decode starts alongside and waits in its Handshake.
        prefill_target = wait_for(procs[0], logs["prefill"], r"listening on (\S+)").group(1)
        procs.append(spawn("decode", {"PDSERVE_PREFILL_TARGET": f"dns:///{prefill_target}"}, logs["decode"]))
        for proc, role in zip(procs, ("prefill", "decode"), strict=True):
            wait_for(proc, logs[role], f"pdserve {role} ready")
        target = wait_for(procs[1], logs["decode"], r"listening on (\S+)").group(1)
        metrics = wait_for(procs[1], logs["decode"], r"metrics on (\S+)").group(1)
        for addr, role in ((prefill_target, "prefill"), (target, "decode")):
            with grpc.insecure_channel(addr) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", READINESS_NAME[role]):
                    status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                    assert status == health_pb2.HealthCheckResponse.SERVING, (role, service)
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        assert "pdserve_" in body
        with Client(target) as client:
            done = client.complete("The capital of France is", max_tokens=4, timeout=60)
        assert done.text and done.finish_reason in ("stop", "length")
    finally:
        for proc in reversed(procs):
            proc.terminate()
        codes = [proc.wait(60) for proc in reversed(procs)]
    assert codes == [0] * len(procs), "SIGTERM drains to exit 0"
