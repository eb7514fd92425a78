"""Every pdserve container's args and env through the services' real config parsers
(shared/service_config.parse_config, the role's config dataclass and its __post_init__), as the process
parses them at start-up. An unknown flag, an unparsable value, or a value the dataclass rejects (a device
not auto/cpu/cuda/cuda:N, an unknown kv_transfer, cuda_ipc on cpu, a page size of 0) fails here instead
of crash-looping on the cluster. Also: every PDSERVE_* setting lives in a ConfigMap, and each value
there (even one a later ConfigMap overrides) parses on its own."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
from k8s_render import (
    K8S,
    OVERLAYS,
    ROLES,
    ROOT,
    SERVICE_MODULES,
    Obj,
    RejectedConfig,
    container,
    find,
    one,
    parse_container,
    pdserve_deployments,
    pod_containers,
    render,
    role_parser,
)

from invariants.levels import ENV_VAR as INVARIANT_VAR
from invariants.levels import parse as parse_levels
from shared.serving.config import CommonConfig

# Set inline in the pod template, not in a ConfigMap: it carries the pod and node names, which only
# `env` can expand ($(K8S_POD_NAME) from the downward API; envFrom does not expand references).
INLINE_ALLOWED = frozenset({"OTEL_RESOURCE_ATTRIBUTES"})
# Settings the pod template overrides from the downward API (envFrom cannot read it): the ConfigMap keeps
# the setting with its documented default, the pod's env wins with the pod's own value.
INLINE_DOWNWARD = {"PDSERVE_METRICS_HOST": "status.podIP"}
# Not a setting: where the read-only root filesystem's writable emptyDir is (k8s/base/*.yaml).
INLINE_RUNTIME = frozenset({"HOME"})


def service_containers(objs: tuple[Obj, ...]) -> list[tuple[str, Obj]]:
    """(Deployment name, container) for every container that runs a pdserve service."""
    return [
        (dep["metadata"]["name"], ctr)
        for dep in pdserve_deployments(objs)
        for ctr in pod_containers(dep["spec"]["template"]["spec"])
        if ctr.get("args", [""])[0] in SERVICE_MODULES
    ]  # fmt: skip


def role_of(ctr: Obj) -> str:
    return SERVICE_MODULES[ctr["args"][0]]


def setting_vars(role: str) -> set[str]:
    """Every PDSERVE_* variable `role` reads: one per config field, plus the invariant levels."""
    _, _, cls = role_parser(role)
    return {f"PDSERVE_{f.name.upper()}" for f in dataclasses.fields(cls)} | {INVARIANT_VAR}


def test_every_container_parses(objs: tuple[Obj, ...], overlay: str) -> None:
    ctrs = service_containers(objs)
    assert sorted(role_of(c) for _, c in ctrs) == sorted(ROLES), f"{overlay}: one container per role"
    for dep, ctr in ctrs:
        try:
            parse_container(objs, ctr)
        except RejectedConfig as e:
            pytest.fail(f"{overlay}: {dep}/{ctr['name']}: {e}")


def test_every_configmap_value_parses_alone(objs: tuple[Obj, ...], overlay: str) -> None:
    """Each PDSERVE_* value of each ConfigMap a role reads, on its own through that role's parser: a bad
    value hidden by a later ConfigMap (e.g. pdserve-common's device under a per-role one) still fails."""
    for _, ctr in service_containers(objs):
        role = role_of(ctr)
        _, parse_args, _ = role_parser(role)
        for source in ctr.get("envFrom", []):
            cm = one(objs, "ConfigMap", source["configMapRef"]["name"])
            for key, value in cm.get("data", {}).items():
                if key == INVARIANT_VAR:
                    parse_levels(value)  # raises on a spec the services would reject
                elif key.startswith("PDSERVE_"):
                    try:
                        parse_args([], env={key: value})
                    except (SystemExit, ValueError, TypeError) as e:
                        pytest.fail(f"{overlay}: ConfigMap {cm['metadata']['name']}: {key}={value!r}: {e}")


def device_values() -> list[tuple[str, str]]:
    """(where, value) of every device setting in the rendered manifests (ConfigMaps, args) and in the
    Kubernetes docs and manifest comments (what an operator copies)."""
    out = []
    for overlay in OVERLAYS:
        objs = render(f"overlays/{overlay}")
        for cm in find(objs, "ConfigMap"):
            if "PDSERVE_DEVICE" in cm.get("data", {}):
                out.append((f"{overlay}: ConfigMap {cm['metadata']['name']}", cm["data"]["PDSERVE_DEVICE"]))
        for dep, ctr in service_containers(objs):
            args = " ".join(ctr["args"])
            out += [
                (f"{overlay}: {dep}/{ctr['name']} args", v) for v in re.findall(r"--device[= ](\S+)", args)
            ]
    docs = [ROOT / "README.md", *K8S.rglob("*.md"), *K8S.rglob("*.yaml"), *K8S.rglob("*.env")]
    for path in docs:
        text = path.read_text()
        found = re.findall(r"PDSERVE_DEVICE=([^\s`'\",;)\]]+)", text) + re.findall(r"--device[= ](\S+)", text)
        out += [(str(path.relative_to(ROOT)), v.rstrip(".,")) for v in found]
    return out


def test_every_device_value_is_accepted() -> None:
    """The device form is checked at parse (auto, cpu, cuda, cuda:N): a value the services refuse would
    stop every Pod at start-up."""
    values = device_values()
    assert {v for _, v in values} >= {"cpu", "cuda", "cuda:0", "cuda:1"}, values
    for where, value in values:
        try:
            CommonConfig(device=value)
        except ValueError as e:
            pytest.fail(f"{where}: PDSERVE_DEVICE={value!r}: {e}")


@pytest.mark.parametrize(
    ("extra_env", "args", "reason"),
    [
        ({"PDSERVE_DEVICE": "gpu"}, [], "device must be"),
        ({"PDSERVE_DEVICE": "cuda:one"}, [], "device must be"),
        ({"PDSERVE_DEVICE": "CUDA"}, [], "device must be"),
        ({"PDSERVE_DEVICE": "cuda:0,1"}, [], "device must be"),
        ({"PDSERVE_KV_TRANSFER": "rdma"}, [], "kv_transfer must be"),
        ({"PDSERVE_KV_TRANSFER": "cuda_ipc"}, [], "needs a CUDA device"),  # cpu-demo runs on cpu
        ({"PDSERVE_PAGE_SIZE": "0"}, [], "page_size must be"),
        ({"PDSERVE_PREFILL_TIMEOUT": "0"}, [], "prefill_timeout must be"),
        ({"PDSERVE_PORT": "fifty"}, [], "invalid literal"),
        ({"PDSERVE_METRICS": "maybe"}, [], "not a boolean"),
        ({}, ["--no-such-flag"], "argparse"),
        ({}, ["--device", "tpu"], "device must be"),
    ],
)
def test_a_value_the_service_rejects_fails_the_check(
    extra_env: dict[str, str], args: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checks above are not a no-op: cpu-demo's decode with one bad setting (set in the pod's env,
    which wins over envFrom, or appended to its args) is rejected for the service's own reason."""
    objs = copy.deepcopy(render("overlays/cpu-demo"))
    ctr = container(objs, "decode")
    ctr["env"] = [*ctr.get("env", []), *({"name": k, "value": v} for k, v in extra_env.items())]
    ctr["args"] = [*ctr["args"], *args]
    parse_container(objs, container(render("overlays/cpu-demo"), "decode"))  # the original parses
    with pytest.raises(RejectedConfig, match=reason):
        parse_container(objs, ctr)
    capsys.readouterr()  # argparse's usage message


@pytest.mark.parametrize("role", ROLES)
def test_every_setting_lives_in_a_configmap(objs: tuple[Obj, ...], role: str) -> None:
    """Every PDSERVE_* variable the role reads is set in a ConfigMap it loads (an operator sees and
    tunes every setting there; a new flag without an entry fails here), and the pod template sets none
    inline except the downward-API resource attributes and the pod's IP for /metrics (which overrides
    the ConfigMap's entry), plus $HOME."""
    ctr = container(objs, role)
    from_maps: set[str] = set()
    for source in ctr.get("envFrom", []):
        from_maps |= set(one(objs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    missing = sorted(setting_vars(role) - from_maps)
    assert not missing, f"{role}: settings missing from its ConfigMaps: {missing}"
    assert {"OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= from_maps
    inline = {v["name"] for v in ctr.get("env", []) if v["name"].startswith(("PDSERVE_", "OTEL_"))}
    allowed = INLINE_ALLOWED | INLINE_DOWNWARD.keys()
    assert inline <= allowed, f"{role}: set these in a ConfigMap, not the pod: {sorted(inline - allowed)}"
    for var in ctr.get("env", []):
        if var["name"] in INLINE_DOWNWARD:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == INLINE_DOWNWARD[var["name"]], var
            continue
        # The rest only feed OTEL_RESOURCE_ATTRIBUTES, or place the runtime's files.
        assert var["name"] in INLINE_ALLOWED | INLINE_RUNTIME or "fieldRef" in var.get("valueFrom", {}), var
