"""What an operator watches a request with, against the services' code: the Grafana dashboard queries
only series and labels the services export (shared/serving/metrics.py), the optional PodMonitor component
(k8s/components/podmonitor) scrapes every pdserve metrics port in every overlay, and each role's OTEL_*
settings build the tracer the service would (shared/serving/telemetry.py) with spans bound for the
collector."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_render import (
    K8S,
    ROLES,
    Obj,
    container,
    container_env,
    find,
    one,
    pdserve_deployments,
    pod_containers,
    selects,
    tool,
)
from test_contract import effective_config

DASHBOARD = K8S / "base" / "dashboards" / "pdserve.json"
# Labels Prometheus adds to every scraped series (kubernetes_sd relabelling, prometheus-operator).
TARGET_LABELS = frozenset({"namespace", "pod", "container", "instance", "job", "endpoint"})
PROMQL_WORDS = frozenset({"by", "without", "sum", "max", "min", "avg", "rate", "histogram_quantile"})


def exported_series() -> dict[str, set[str]]:
    """Series name (as exposed: counters with _total, histograms with _bucket/_sum/_count) -> its labels."""
    from shared.serving.metrics import Metrics

    registry = Metrics("decode").registry
    out: dict[str, set[str]] = {}
    for collector in set(registry._collector_to_names):  # every metric, sampled yet or not
        # A metric object, or a custom collector that describes the families it yields at scrape time.
        metrics = [(c._name, c._type, c) for c in [collector] if hasattr(c, "_name")] or [
            (f.name, f.type, f) for f in collector.describe()
        ]
        for name, kind, metric in metrics:
            labels = set(getattr(metric, "_labelnames", ()))
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(kind, ("",))
            for suffix in suffixes:
                out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def dashboard_exprs() -> list[str]:
    def walk(panels: list[dict[str, Any]]) -> list[str]:
        out = []
        for p in panels:
            out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
            out += walk(p.get("panels", []))
        return out

    dashboard = json.loads(DASHBOARD.read_text())
    variables = [v["query"] for v in dashboard.get("templating", {}).get("list", []) if v["type"] == "query"]
    return walk(dashboard["panels"]) + [q if isinstance(q, str) else q["query"] for q in variables]


def test_dashboard_queries_series_the_services_export() -> None:
    series = exported_series()
    exprs = dashboard_exprs()
    assert exprs, "the dashboard queries nothing"
    for expr in exprs:
        names = set(re.findall(r"\bpdserve_[a-z0-9_]+", expr))
        unknown = names - series.keys()
        assert not unknown, f"the services export no {sorted(unknown)} (shared/serving/metrics.py): {expr}"
        labels = set().union(*(series[n] for n in names)) | TARGET_LABELS
        used = {m for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for m in group.split(",")}
        used |= set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!~|!=|=)", expr))
        used |= set(re.findall(r"label_values\([^,]+,\s*([a-z_]+)\)", expr))
        missing = {u.strip() for u in used if u.strip()} - labels - PROMQL_WORDS
        assert not missing, f"labels {sorted(missing)} are on no series of {sorted(names)}: {expr}"


def test_dashboard_check_is_not_a_no_op() -> None:
    series = exported_series()
    assert "pdserve_requests_total" in series and "pdserve_time_to_first_token_seconds_bucket" in series
    assert "pdserve_no_such_series" not in series and "finish_reason" in series["pdserve_requests_total"]


def render_with_component(overlay: str, component: str, tmp: Path) -> tuple[Obj, ...]:
    """An overlay plus a component under k8s/components/, as an operator's kustomization adds it."""
    rel = os.path.relpath(K8S, tmp)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"{rel}/overlays/{overlay}"],
        "components": [f"{rel}/components/{component}"],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run([tool("kubectl"), "kustomize", str(tmp)], check=True, capture_output=True, text=True)
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def test_podmonitor_scrapes_every_metrics_port(overlay: str, objs: tuple[Obj, ...], tmp_path: Path) -> None:
    with_monitor = render_with_component(overlay, "podmonitor", tmp_path)
    [monitor] = find(with_monitor, "PodMonitor")
    added = [o for o in with_monitor if o not in objs]
    assert added == [monitor], "the component adds the PodMonitor and changes nothing else"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "pdserve"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}, sorted(spec)
    endpoints = spec["podMetricsEndpoints"]
    for ep in endpoints:  # a name, not a number: the field is `port` (string) in monitoring.coreos.com/v1
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"} and isinstance(ep["port"], str), ep
    scraped: set[tuple[str, int]] = set()
    for dep in pdserve_deployments(objs):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(spec["selector"], labels), f"{dep['metadata']['name']} is not scraped"
        for ctr in pod_containers(dep["spec"]["template"]["spec"]):
            ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
            for ep in endpoints:
                if ep["port"] in ports:
                    assert ep.get("path", "/metrics") == "/metrics"
                    scraped.add((ctr["name"], ports[ep["port"]]))
    for role in ROLES:  # each role's metrics port, as the service binds it
        assert (role, effective_config(objs, role).metrics_port) in scraped, f"{role}'s /metrics not scraped"
    others = [d for d in find(objs, "Deployment") if d not in pdserve_deployments(objs)]
    assert not any(selects(spec["selector"], d["spec"]["template"]["metadata"]["labels"]) for d in others)


@pytest.mark.parametrize("role", ROLES)
def test_otel_settings_build_the_services_tracer(
    objs: tuple[Obj, ...], role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The role's env through shared/serving/telemetry.provider_from_env: spans are exported over OTLP to the
    collector's Service, named by role, carrying the pod's resource attributes."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from shared.serving.telemetry import provider_from_env

    env = container_env(objs, container(objs, role))
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the OTLP exporter reads its endpoint from os.environ
    provider = provider_from_env(role)
    assert provider is not None, f"{role}: no span exporter from {sorted(k for k in env if 'OTEL' in k)}"
    try:
        attrs = provider.resource.attributes
        assert attrs["service.name"] == f"pdserve-{role}"
        assert "k8s.pod.name" in attrs and "k8s.node.name" in attrs
        processors = provider._active_span_processor._span_processors
        assert any(isinstance(p, BatchSpanProcessor) for p in processors), "spans batched to OTLP"
    finally:
        provider.shutdown()
    # The endpoint is the collector's OTLP gRPC Service port (the protocol the services speak by default).
    assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc"
    host, _, port = env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://").partition(":")
    svc = one(objs, "Service", host)
    [grpc_port] = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    assert grpc_port["name"] == "otlp-grpc"
    pod_labels = one(objs, "Deployment", host)["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels), (
        f"Service {host} selects no collector"
    )
