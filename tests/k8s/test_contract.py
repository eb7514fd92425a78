"""The manifests against the services' code: env vars the services read, flags they take, ports they
listen on, probe service names they serve, drain timeout vs the termination grace. Drift fails here."""

from __future__ import annotations

import dataclasses

import pytest
from k8s_render import (
    GPU_OVERLAYS,
    ROLES,
    Obj,
    container,
    container_env,
    deployment,
    find,
    module_constant,
    one,
    referenced_vars,
    role_parser,
)

# OTEL_* variables the services read: shared/telemetry.py itself (exporter choice, protocol, service name,
# SDK off), Resource.create (resource attributes), TracerProvider (sampler), BatchSpanProcessor (BSP) and
# the OTLP span exporter (endpoint, headers, timeout, TLS). Not here: OTEL_PROPAGATORS (the services
# always use W3C trace context) and OTEL_METRICS/LOGS_EXPORTER (metrics are Prometheus; no OTel logs).
OTEL_ALLOWLIST = frozenset({
    "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
})  # fmt: skip
# PDSERVE_* variables read outside the config dataclasses.
EXTRA_PDSERVE = frozenset({module_constant("invariants/levels.py", "ENV_VAR")})
READINESS_NAME = {"decode": "pdserve.v1.Generation", "prefill": "pdserve.v1.Prefill"}
STOP_GRACE_S = module_constant("shared/service_runtime.py", "_STOP_GRACE_S")


def effective_config(objs: tuple[Obj, ...], role: str):  # -> the role's config dataclass
    """Parse the container's args and env with the service's own parser, as the process would."""
    ctr = container(objs, role)
    module, parse_args, _ = role_parser(role)
    args = ctr.get("args", [])
    assert "command" not in ctr, "the image's ENTRYPOINT (python -m) is kept; args name the module"
    assert args[:1] == [module], f"{role}: args must start with {module}, got {args}"
    try:
        return parse_args(args[1:], env=container_env(objs, ctr))
    except SystemExit as e:  # argparse: unknown flag or unparsable value
        pytest.fail(f"{role}: {module} rejects args {args[1:]} / its env (exit {e.code})")


def port_named(ctr: Obj, name: str) -> int:
    [port] = [p["containerPort"] for p in ctr["ports"] if p["name"] == name]
    return port


@pytest.mark.parametrize("role", ROLES)
def test_env_is_read_by_the_service(objs: tuple[Obj, ...], role: str) -> None:
    ctr = container(objs, role)
    env = container_env(objs, ctr)
    _, _, config_cls = role_parser(role)
    readable = {f"PDSERVE_{f.name.upper()}" for f in dataclasses.fields(config_cls)} | EXTRA_PDSERVE
    helpers = referenced_vars([v.get("value", "") for v in ctr.get("env", [])])
    # A plain helper (e.g. the pod name from the downward API) may exist only to be expanded into another.
    helpers = {k for k in helpers if not k.startswith(("PDSERVE_", "OTEL_"))}
    unread = sorted(k for k in env if k not in readable | OTEL_ALLOWLIST | helpers)
    assert not unread, f"{role} sets variables {role}_service does not read: {unread}"
    assert env.get("OTEL_SERVICE_NAME") == f"pdserve-{role}"
    from invariants.levels import parse

    parse(env.get("PDSERVE_INVARIANT_CHECK", ""))  # raises on a spec the services would reject


@pytest.mark.parametrize("role", ROLES)
def test_ports_and_probes_match_the_service(objs: tuple[Obj, ...], role: str) -> None:
    cfg = effective_config(objs, role)
    ctr = container(objs, role)
    assert port_named(ctr, "grpc") == cfg.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ctr[probe]["grpc"]["port"] == cfg.port, f"{role} {probe} port"
    assert ctr["readinessProbe"]["grpc"]["service"] == READINESS_NAME[role]
    assert ctr["livenessProbe"]["grpc"].get("service", "") == ""
    [svc] = [
        s for s in find(objs, "Service")
        if s["spec"]["selector"] == deployment(objs, role)["spec"]["selector"]["matchLabels"]
    ]  # fmt: skip
    [svc_port] = svc["spec"]["ports"]
    assert svc_port["port"] == cfg.port and svc_port["targetPort"] in ("grpc", cfg.port)


def test_prefill_service_is_headless_and_decode_targets_it(objs: tuple[Obj, ...]) -> None:
    prefill_svc = one(objs, "Service", "pdserve-prefill")
    assert prefill_svc["spec"]["clusterIP"] == "None", "headless: DNS returns every prefill pod"
    target = effective_config(objs, "decode").prefill_target
    scheme, _, rest = target.partition(":///")
    host, _, port = rest.rpartition(":")
    assert scheme == "dns", f"prefill target {target!r}: use dns:/// so the channel sees every pod"
    ns = prefill_svc["metadata"]["namespace"]
    assert host in ("pdserve-prefill", f"pdserve-prefill.{ns}", f"pdserve-prefill.{ns}.svc.cluster.local")
    assert int(port) == prefill_svc["spec"]["ports"][0]["port"] == effective_config(objs, "prefill").port


def test_roles_agree_on_the_kv_layout(objs: tuple[Obj, ...]) -> None:
    """Decode's Handshake refuses a mismatch at start-up; catch it before deploying."""
    decode, prefill = effective_config(objs, "decode"), effective_config(objs, "prefill")
    for name in ("model", "dtype", "page_size", "device"):
        assert getattr(decode, name) == getattr(prefill, name), name


@pytest.mark.parametrize("role", ROLES)
def test_metrics_are_scraped_on_the_metrics_port(objs: tuple[Obj, ...], role: str) -> None:
    cfg = effective_config(objs, role)
    assert cfg.metrics, f"{role}: metrics disabled"
    expected = cfg.metrics_port
    ctr = container(objs, role)
    annotations = deployment(objs, role)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port_named(ctr, "metrics") == expected


@pytest.mark.parametrize("role", ROLES)
def test_termination_grace_outlasts_the_drain(objs: tuple[Obj, ...], role: str) -> None:
    cfg = effective_config(objs, role)
    pod = deployment(objs, role)["spec"]["template"]["spec"]
    pre_stop = (
        container(objs, role).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    )
    needed = pre_stop + cfg.drain_timeout + STOP_GRACE_S
    assert pod["terminationGracePeriodSeconds"] > needed, f"{role}: grace must exceed {needed}s"


@pytest.mark.parametrize("role", ROLES)
def test_pod_shape(objs: tuple[Obj, ...], overlay: str, role: str) -> None:
    dep = deployment(objs, role)
    labels = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": role}
    assert dep["spec"]["selector"]["matchLabels"] == labels
    assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pod = dep["spec"]["template"]["spec"]
    ctr = container(objs, role)
    [shm] = [m for m in ctr["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [vol] = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert vol["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"]["runAsNonRoot"] is True
    [pdb] = [p for p in find(objs, "PodDisruptionBudget") if p["spec"]["selector"]["matchLabels"] == labels]
    assert pdb
    resources = ctr["resources"]
    gpus = (
        resources.get("requests", {}).get("nvidia.com/gpu"),
        resources.get("limits", {}).get("nvidia.com/gpu"),
    )
    if overlay in GPU_OVERLAYS:
        assert gpus[0] == gpus[1] and int(gpus[0]) >= 1, f"{role}: nvidia.com/gpu requests = limits"
        assert effective_config(objs, role).device.startswith("cuda")
    else:
        assert gpus == (None, None), "cpu-demo requests no GPU"
        assert effective_config(objs, role).device == "cpu"


def test_overlay_placement(objs: tuple[Obj, ...], overlay: str) -> None:
    affinity = {r: deployment(objs, r)["spec"]["template"]["spec"].get("affinity", {}) for r in ROLES}
    if overlay == "single-node-gpu":  # decode next to prefill (cuda_ipc later; the transfer stays local)
        [term] = affinity["decode"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    if overlay == "multi-node":  # replicas of each role spread over nodes
        for role in ROLES:
            assert "podAffinity" not in affinity[role]
            [term] = affinity[role]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            assert (
                term["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == role
            )


def test_decode_balances_over_the_headless_prefill_service() -> None:
    # The headless Service hands out every prefill pod's address; only round_robin spreads calls.
    from decode_service.prefill_client import _CHANNEL_OPTIONS

    assert ("grpc.lb_policy_name", "round_robin") in _CHANNEL_OPTIONS
