"""How each overlay moves the KV, and what the cuda_ipc pair Pod gives the backend
(shared/transfer/cuda_ipc.py): prefill opens decode's pool, so it must see decode's GPU; CUDA
interprocess events rendezvous in a shared /dev/shm; the two processes need distinct pids; decode's
allocator must hand out cudaMalloc memory (no expandable segments). All of it without host namespaces
or privilege, and without bypassing the GPU allocation."""

from __future__ import annotations

import re

from k8s_render import (
    ROLES,
    Obj,
    container,
    container_env,
    deployment,
    find,
    is_sidecar,
    module_constant,
    one,
    paired,
    pdserve_deployments,
    pod_containers,
    render,
)
from test_contract import effective_config
from test_dockerfile import instructions

KV_TRANSFERS = module_constant("decode_service/config.py", "KV_TRANSFERS")
# multi-node runs nixl; inline is its documented fallback, a valid state too.
EXPECTED = {"cpu-demo": ("inline",), "single-node-gpu": ("cuda_ipc",), "multi-node": ("inline", "nixl")}
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Memory these hand out has no legacy CUDA IPC handle (cuMemCreate / stream-ordered pools).
NO_IPC_ALLOC = re.compile(r"expandable_segments\s*:\s*true|backend\s*:\s*cudamallocasync", re.IGNORECASE)


def test_each_overlay_moves_the_kv_as_documented(objs: tuple[Obj, ...], overlay: str) -> None:
    kv = effective_config(objs, "decode").kv_transfer  # parse_args rejects a value not in KV_TRANSFERS
    assert kv in KV_TRANSFERS and kv in EXPECTED[overlay], f"{overlay}: decode's kv_transfer is {kv!r}"


def test_cuda_ipc_only_inside_a_pair_pod(objs: tuple[Obj, ...]) -> None:
    """A prefill in another Pod cannot see decode's GPU nor share its /dev/shm and PID namespace."""
    if effective_config(objs, "decode").kv_transfer == "cuda_ipc":
        assert paired(objs), "cuda_ipc needs prefill and decode as two containers of one Pod"
        assert is_sidecar(container(objs, "prefill")), "prefill outlives decode's drain as a native sidecar"


def test_cuda_ipc_allocator_hands_out_ipc_memory(objs: tuple[Obj, ...]) -> None:
    if effective_config(objs, "decode").kv_transfer != "cuda_ipc":
        return
    for role in ROLES:
        env = container_env(objs, container(objs, role))
        for var in ALLOC_VARS:
            assert not NO_IPC_ALLOC.search(env.get(var, "")), f"{role}: {var}={env[var]} breaks cuda_ipc"


def test_image_sets_no_allocator_without_ipc_handles() -> None:
    envs = " ".join(args for word, args in instructions() if word == "ENV")
    assert not NO_IPC_ALLOC.search(envs), "the image's ENV would break cuda_ipc"


def test_no_host_namespaces_or_privilege(objs: tuple[Obj, ...]) -> None:
    """Pod Security "baseline" and the GPU isolation hold: the pair shares namespaces inside its Pod."""
    for dep in pdserve_deployments(objs):
        pod = dep["spec"]["template"]["spec"]
        for field in ("hostIPC", "hostPID", "hostNetwork"):
            assert not pod.get(field), f"{dep['metadata']['name']}: {field}"
        for ctr in pod_containers(pod):
            sc = ctr.get("securityContext", {})
            assert not sc.get("privileged") and sc.get("capabilities", {}).get("drop") == ["ALL"], ctr["name"]
            assert "NVIDIA_VISIBLE_DEVICES" not in container_env(objs, ctr), "GPUs come from the allocation"


def test_pair_pod_gives_cuda_ipc_what_it_needs() -> None:
    objs = render("overlays/single-node-gpu")
    dep = deployment(objs, "decode")
    pod = dep["spec"]["template"]["spec"]
    pair = container(objs, "prefill"), container(objs, "decode")
    # Distinct pids for the two processes (each would be pid 1 in a PID namespace of its own).
    assert pod.get("shareProcessNamespace") is True
    # One tmpfs at /dev/shm in both: the CUDA IPC events' rendezvous (the IPC namespace is the Pod's).
    shm = {c["name"]: [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"] for c in pair}
    assert shm["prefill"] == shm["decode"] and len(shm["decode"]) == 1, shm
    [vol] = [v for v in pod["volumes"] if v["name"] == shm["decode"][0]]
    assert vol["emptyDir"]["medium"] == "Memory"
    # Both containers see every GPU of one claim: prefill must see decode's GPU.
    # (A claim entry naming one `request` would give a container only that request's devices.)
    claim_names = [{c["name"] for c in ctr["resources"]["claims"] if "request" not in c} for ctr in pair]
    [claim] = claim_names[0] & claim_names[1]
    [pod_claim] = [c for c in pod["resourceClaims"] if c["name"] == claim]
    template = one(objs, "ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"])
    requests = template["spec"]["spec"]["devices"]["requests"]
    assert all(r["exactly"]["deviceClassName"] == "gpu.nvidia.com" for r in requests)
    gpus = sum(r["exactly"].get("count", 1) for r in requests)
    # Each process computes on its own GPU of the claim (both list the same GPUs in the same order).
    devices = [effective_config(objs, role).device for role in ROLES]
    indices = [int(d.partition(":")[2] or 0) for d in devices]
    assert all(0 <= i < gpus for i in indices), f"devices {devices} outside the claim's {gpus} GPU(s)"
    assert gpus < 2 or len(set(indices)) == 2, f"two GPUs claimed, one used: {devices}"
    # The claim is the only GPU allocation (no device-plugin GPUs beside it).
    assert not find(objs, "ResourceClaim")
    for ctr in pair:
        for key in ("requests", "limits"):
            assert "nvidia.com/gpu" not in ctr["resources"].get(key, {}), ctr["name"]
