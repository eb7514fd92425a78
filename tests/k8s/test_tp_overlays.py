"""The multi-node overlay's tensor-parallel setting: each role's PDSERVE_TP, set in the overlay, is what
its Pods request in GPUs (one process a rank, a GPU each), and the two roles may differ."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.k8s.k8s_render import K8S, one, render, tool


def _gpus(objs: tuple, role: str) -> tuple[str, str]:
    pod = one(objs, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == role]
    res = container["resources"]
    return res["requests"]["nvidia.com/gpu"], res["limits"]["nvidia.com/gpu"]


def test_gpus_per_pod_follow_each_roles_degree(tmp_path: Path) -> None:
    assert _gpus(render("overlays/multi-node"), "decode") == ("1", "1")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    overlay = copy / "overlays" / "multi-node" / "kustomization.yaml"
    text = overlay.read_text()
    decode_at = text.index("name: pdserve-decode")
    text = text[:decode_at] + text[decode_at:].replace("PDSERVE_TP=1", "PDSERVE_TP=2", 1)
    overlay.write_text(text.replace("PDSERVE_KV_TRANSFER=nixl", "PDSERVE_KV_TRANSFER=inline"))
    out = subprocess.run([tool("kubectl"), "kustomize", str(overlay.parent)], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    objs = tuple(d for d in yaml.safe_load_all(out) if d)
    assert _gpus(objs, "decode") == ("2", "2")
    assert _gpus(objs, "prefill") == ("1", "1")
    decode_env = [
        c for c in objs if c["kind"] == "ConfigMap" and c["metadata"]["name"].startswith("pdserve-decode")
    ]
    assert [c["data"]["PDSERVE_TP"] for c in decode_env] == ["2"]
