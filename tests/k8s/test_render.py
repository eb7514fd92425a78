"""Every overlay renders with real kustomize and every object passes the Kubernetes schemas, strictly
(unknown fields and wrong types fail)."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
import yaml
from k8s_render import K8S, KUBERNETES_VERSION, OVERLAYS, Obj, find, render


def validate(obj: Obj) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_overlay_is_checked() -> None:
    """The overlay list the tests iterate is every folder under k8s/overlays/."""
    assert sorted(OVERLAYS) == sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())


@pytest.mark.parametrize("path", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_renders_and_validates_strictly(path: str) -> None:
    objs = render(path)
    assert objs, f"{path} rendered nothing"
    for obj in objs:
        try:
            validate(obj)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path}: {obj['kind']}/{obj['metadata']['name']}: {e}")


def test_strict_validation_rejects_drift() -> None:
    """The validator is not a no-op: a misspelt field and a wrongly typed one both fail."""
    dep = find(render("overlays/cpu-demo"), "Deployment", "pdserve-decode")[0]
    typo = copy.deepcopy(dep)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50051}
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


def test_every_object_is_namespaced_in_pdserve(objs: tuple[Obj, ...]) -> None:
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "pdserve", obj["metadata"]["name"]


def test_images_are_pinned(objs: tuple[Obj, ...]) -> None:
    for dep in find(objs, "Deployment"):
        for ctr in dep["spec"]["template"]["spec"]["containers"]:
            name, _, tag = ctr["image"].rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, f"unpinned image {ctr['image']}"


def test_grafana_dashboard_is_provisioned(objs: tuple[Obj, ...]) -> None:
    [cm] = find(objs, "ConfigMap", "pdserve-grafana-dashboard")
    assert cm["metadata"]["labels"].get("grafana_dashboard") == "1"
    dashboard = json.loads(cm["data"]["pdserve.json"])
    assert dashboard.get("panels") or dashboard.get("rows"), "the dashboard has no panels"


def test_collector_receives_otlp_and_exports_traces(objs: tuple[Obj, ...]) -> None:
    [cm] = [c for c in find(objs, "ConfigMap") if c["metadata"]["name"].startswith("otel-collector")]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert {"grpc", "http"} <= set(config["receivers"]["otlp"]["protocols"])
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    for exporter in traces["exporters"]:
        host, port = config["exporters"][exporter]["endpoint"].rsplit(":", 1)
        [svc] = find(objs, "Service", host)  # the exporter's target is a Service in the manifests
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    [dep] = find(objs, "Deployment", "otel-collector")
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in volumes)
