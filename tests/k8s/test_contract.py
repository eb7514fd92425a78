"""The manifests against the services' code: env vars the services read, flags they take, ports they
listen on, probe service names they serve, drain timeout vs the termination grace. Drift fails here.
A role runs either in a Deployment of its own or beside the other role in a pair Pod (single-node-gpu)."""

from __future__ import annotations

import dataclasses

import pytest
from k8s_render import (
    GPU_OVERLAYS,
    ROLES,
    Obj,
    RejectedConfig,
    container,
    container_env,
    deployment,
    find,
    is_sidecar,
    module_constant,
    one,
    paired,
    parse_container,
    pdserve_deployments,
    pod_containers,
    port_named,
    referenced_vars,
    role_parser,
    roles_of,
    selects,
)

from decode_service.prefill_targets import parse_targets

# OTEL_* variables the services read: shared/serving/telemetry.py itself (exporter choice, protocol, service
# name, SDK off), Resource.create (resource attributes), TracerProvider (sampler), BatchSpanProcessor (BSP)
# and the OTLP span exporter (endpoint, headers, timeout, TLS). Not here: OTEL_PROPAGATORS (the services
# always use W3C trace context) and OTEL_METRICS/LOGS_EXPORTER (metrics are Prometheus; no OTel logs).
OTEL_ALLOWLIST = frozenset({
    "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
})  # fmt: skip
# Read by PyTorch in the service process: the CUDA caching allocator's settings (the generic name and the
# older CUDA one). cuda_ipc forbids some of them (tests/k8s/test_kv_transfer.py).
TORCH_ALLOWLIST = frozenset({"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"})
# Read by the libraries in the process: $HOME places Triton's kernel cache, CUDA's JIT cache and ~/.cache in
# the writable emptyDir (the root filesystem is read-only).
RUNTIME_ALLOWLIST = frozenset({"HOME"})
# PDSERVE_* variables read outside the config dataclasses.
EXTRA_PDSERVE = frozenset({module_constant("invariants/levels.py", "ENV_VAR")})
READINESS_NAME = {"decode": "pdserve.v1.Generation", "prefill": "pdserve.v1.Prefill"}
STOP_GRACE_S = module_constant("shared/serving/runtime.py", "_STOP_GRACE_S")


def effective_config(objs: tuple[Obj, ...], role: str):  # -> the role's config dataclass
    """Parse the container's args and env with the service's own parser, as the process would
    (k8s_render.parse_container; test_settings.py checks every container and value this way)."""
    ctr = container(objs, role)
    module, _, _ = role_parser(role)
    args = ctr.get("args", [])
    assert args[:1] == [module], f"{role}: args must start with {module}, got {args}"
    try:
        return parse_container(objs, ctr)
    except RejectedConfig as e:
        pytest.fail(f"{role}: {e}")


def services_to(objs: tuple[Obj, ...], role: str) -> list[tuple[Obj, Obj]]:
    """(Service, its port) pairs that route to `role`'s gRPC port: the selector matches the pod and the
    targetPort, a number or a port name looked up in the whole pod, is that container's port."""
    dep = deployment(objs, role)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    ports = [p for c in pod_containers(dep["spec"]["template"]["spec"]) for p in c.get("ports", [])]
    names = [p["name"] for p in ports]
    assert len(names) == len(set(names)), f"port names unique in the pod (a Service takes the first): {names}"
    by_name = {p["name"]: p["containerPort"] for p in ports}
    grpc = port_named(container(objs, role), "grpc")
    out = []
    for svc in find(objs, "Service"):
        selector = svc["spec"].get("selector", {})
        if not selector or not selector.items() <= pod_labels.items():
            continue
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            if by_name.get(target, target) == grpc:
                out.append((svc, sp))
    return out


@pytest.mark.parametrize("role", ROLES)
def test_env_is_read_by_the_service(objs: tuple[Obj, ...], role: str) -> None:
    ctr = container(objs, role)
    env = container_env(objs, ctr)
    _, _, config_cls = role_parser(role)
    readable = {f"PDSERVE_{f.name.upper()}" for f in dataclasses.fields(config_cls)} | EXTRA_PDSERVE
    helpers = referenced_vars([v.get("value", "") for v in ctr.get("env", [])])
    # A plain helper (e.g. the pod name from the downward API) may exist only to be expanded into another.
    helpers = {k for k in helpers if not k.startswith(("PDSERVE_", "OTEL_"))}
    known = readable | OTEL_ALLOWLIST | TORCH_ALLOWLIST | RUNTIME_ALLOWLIST | helpers
    unread = sorted(k for k in env if k not in known)
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
    routes = services_to(objs, role)
    if role == "prefill" and paired(objs):  # reached over the pod's loopback only
        assert not routes, "no Service routes to a paired prefill: another pod's decode cannot use it"
        return
    [(_, svc_port)] = routes
    assert svc_port["port"] == cfg.port


def test_prefill_service_is_headless_and_decode_targets_it(objs: tuple[Obj, ...]) -> None:
    target = effective_config(objs, "decode").prefill_target
    prefill_port = effective_config(objs, "prefill").port
    if paired(objs):  # the pair's own prefill, the only one that sees this decode's GPU
        host, _, port = target.rpartition(":")
        assert host in ("127.0.0.1", "localhost", "[::1]"), f"a paired decode calls its own prefill: {target}"
        assert int(port) == prefill_port
        return
    prefill_svc = one(objs, "Service", "pdserve-prefill")
    assert prefill_svc["spec"]["clusterIP"] == "None", "headless: DNS returns every prefill pod"
    [entry] = parse_targets(target)
    host, port = entry.host, entry.port
    assert entry.dns, f"prefill target {target!r}: use dns:/// so that decode sees every pod"
    ns = prefill_svc["metadata"]["namespace"]
    assert host in ("pdserve-prefill", f"pdserve-prefill.{ns}", f"pdserve-prefill.{ns}.svc.cluster.local")
    assert int(port) == prefill_svc["spec"]["ports"][0]["port"] == prefill_port


def test_roles_agree_on_the_kv_layout(objs: tuple[Obj, ...]) -> None:
    """Decode's Handshake refuses a mismatch at start-up; catch it before deploying."""
    decode, prefill = effective_config(objs, "decode"), effective_config(objs, "prefill")
    for name in ("model", "dtype", "page_size"):
        assert getattr(decode, name) == getattr(prefill, name), name
    # The same kind of device; a pair Pod puts the roles on different GPUs (cuda:0, cuda:1).
    assert decode.device.partition(":")[0] == prefill.device.partition(":")[0]


@pytest.mark.parametrize("role", ROLES)
def test_metrics_are_scraped_on_the_metrics_port(objs: tuple[Obj, ...], role: str) -> None:
    cfg = effective_config(objs, role)
    assert cfg.metrics, f"{role}: metrics disabled"
    ctr = container(objs, role)
    assert port_named(ctr, "metrics") == cfg.metrics_port
    annotations = deployment(objs, role)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    if role == "prefill" and paired(objs):
        # The annotation names one port per Pod (decode's); prefill's is a named port for a PodMonitor.
        assert int(annotations["prometheus.io/port"]) == effective_config(objs, "decode").metrics_port
        return
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port


def test_termination_grace_outlasts_the_drain(objs: tuple[Obj, ...]) -> None:
    """SIGKILL never lands mid-drain: the grace exceeds preStop + drain + stop grace of the main
    containers, plus, for a native sidecar (stopped only after they exit, its one client gone), its
    preStop + stop grace."""
    for dep in pdserve_deployments(objs):
        pod = dep["spec"]["template"]["spec"]
        main, after = 0.0, 0.0
        for ctr in pod_containers(pod):
            if ctr["name"] not in ROLES:
                continue
            cfg = effective_config(objs, ctr["name"])
            pre_stop = ctr.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            if is_sidecar(ctr):
                after += pre_stop + STOP_GRACE_S
            else:
                main = max(main, pre_stop + cfg.drain_timeout + STOP_GRACE_S)
        needed = main + after
        name = dep["metadata"]["name"]
        assert pod["terminationGracePeriodSeconds"] > needed, f"{name}: grace must exceed {needed}s"


@pytest.mark.parametrize("role", ROLES)
def test_pod_shape(objs: tuple[Obj, ...], overlay: str, role: str) -> None:
    dep = deployment(objs, role)
    component = "pair" if roles_of(dep) == ["prefill", "decode"] else role
    assert roles_of(dep) in ([role], ["prefill", "decode"]), "a pair Pod: prefill (sidecar) then decode"
    labels = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}
    assert dep["spec"]["selector"]["matchLabels"] == labels
    assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pod = dep["spec"]["template"]["spec"]
    ctr = container(objs, role)
    assert is_sidecar(ctr) == (component == "pair" and role == "prefill"), "in a pair, prefill is the sidecar"
    shm = [m for m in ctr.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if pod.get("hostIPC"):
        # The host's /dev/shm, shared with the other role's Pod (CUDA IPC events); an emptyDir there
        # would hide it and give this Pod a tmpfs of its own (single-node-gpu-per-role).
        assert not shm, f"{role}: with hostIPC, /dev/shm must stay the host's"
    else:
        [mount] = shm
        [vol] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"]["runAsNonRoot"] is True
    [pdb] = [p for p in find(objs, "PodDisruptionBudget") if p["spec"]["selector"]["matchLabels"] == labels]
    assert pdb
    resources = ctr["resources"]
    gpus = (
        resources.get("requests", {}).get("nvidia.com/gpu"),
        resources.get("limits", {}).get("nvidia.com/gpu"),
    )
    claims = resources.get("claims", [])
    if overlay in GPU_OVERLAYS:
        # A GPU from the device plugin (requests = limits) or from a DRA claim, never both.
        if claims:
            assert gpus == (None, None), f"{role}: a DRA claim and nvidia.com/gpu would count GPUs twice"
        else:
            assert gpus[0] == gpus[1] and int(gpus[0]) >= 1, f"{role}: nvidia.com/gpu requests = limits"
        assert effective_config(objs, role).device.startswith("cuda")
    else:
        assert gpus == (None, None) and not claims, "cpu-demo requests no GPU"
        assert effective_config(objs, role).device == "cpu"


def test_overlay_placement(objs: tuple[Obj, ...], overlay: str) -> None:
    affinity = {r: deployment(objs, r)["spec"]["template"]["spec"].get("affinity", {}) for r in ROLES}
    if overlay == "single-node-gpu":  # one Pod per pair: co-located by construction (test_kv_transfer.py)
        assert paired(objs)
    if overlay == "single-node-gpu-per-role":  # one Deployment per role, both Pods on the claim's node
        assert not paired(objs)
        labels = {r: deployment(objs, r)["spec"]["template"]["metadata"]["labels"] for r in ROLES}
        for role in ROLES:
            assert "podAntiAffinity" not in affinity[role]
            [term] = affinity[role]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            # Matching both roles lets the first Pod schedule alone (it matches its own term): a term
            # selecting only the other role would leave both Pods waiting for each other.
            assert all(selects(term["labelSelector"], labels[r]) for r in ROLES), f"{role}: {term}"
    if overlay == "multi-node":  # replicas of each role spread over nodes
        assert not paired(objs)
        for role in ROLES:
            assert "podAffinity" not in affinity[role]
            [term] = affinity[role]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            assert (
                term["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == role
            )


def test_decode_routes_over_the_pods_of_the_headless_prefill_service() -> None:
    # The headless Service hands out every prefill pod's address; decode resolves the name itself and
    # routes each prompt to one pod (prefix-aware, decode_service/routing.py), a channel per pod.
    from decode_service.prefill_client import _CHANNEL_OPTIONS

    assert all(name != "grpc.lb_policy_name" for name, _ in _CHANNEL_OPTIONS)  # pick_first: one pod each
