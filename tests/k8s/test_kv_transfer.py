"""How each overlay moves the KV, and what the cuda_ipc shapes give the backend
(shared/transfer/cuda_ipc.py): prefill opens decode's pool, so it must see decode's GPU; CUDA
interprocess events rendezvous in a shared /dev/shm; the two processes need distinct pids; decode's
allocator must hand out cudaMalloc memory (no expandable segments). The pair Pod (single-node-gpu) does
it without host namespaces or privilege; one Deployment per role (single-node-gpu-per-role) needs
hostIPC and hostPID and nothing more. Neither bypasses the GPU allocation."""

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
EXPECTED = {
    "cpu-demo": ("inline",),
    "single-node-gpu": ("cuda_ipc",),
    "single-node-gpu-per-role": ("cuda_ipc",),
    "multi-node": ("inline", "nixl"),
}
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Memory these hand out has no legacy CUDA IPC handle (cuMemCreate / stream-ordered pools).
NO_IPC_ALLOC = re.compile(r"expandable_segments\s*:\s*true|backend\s*:\s*cudamallocasync", re.IGNORECASE)


def test_each_overlay_moves_the_kv_as_documented(objs: tuple[Obj, ...], overlay: str) -> None:
    kv = effective_config(objs, "decode").kv_transfer  # parse_args rejects a value not in KV_TRANSFERS
    assert kv in KV_TRANSFERS and kv in EXPECTED[overlay], f"{overlay}: decode's kv_transfer is {kv!r}"


def cross_pod_cuda_ipc(objs: tuple[Obj, ...]) -> bool:
    """cuda_ipc between a prefill Pod and a decode Pod (one Deployment per role)."""
    return effective_config(objs, "decode").kv_transfer == "cuda_ipc" and not paired(objs)


def test_cuda_ipc_in_a_pair_pod_or_across_pods_on_host_namespaces(objs: tuple[Obj, ...]) -> None:
    """A prefill in another Pod sees decode's GPU only through a shared named claim, and shares its
    /dev/shm and PID namespace only through the host's (test_per_role_pods_give_cuda_ipc_what_it_needs)."""
    if effective_config(objs, "decode").kv_transfer != "cuda_ipc":
        return
    if paired(objs):
        assert is_sidecar(container(objs, "prefill")), "prefill outlives decode's drain as a native sidecar"
        return
    for role in ROLES:
        pod = deployment(objs, role)["spec"]["template"]["spec"]
        assert pod.get("hostIPC") is True and pod.get("hostPID") is True, f"{role}: cuda_ipc across Pods"


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
    """Pod Security "baseline" and the GPU isolation hold: the pair shares namespaces inside its Pod.
    Only cuda_ipc across Pods (single-node-gpu-per-role) takes hostIPC and hostPID, nothing more."""
    allowed = {"hostIPC", "hostPID"} if cross_pod_cuda_ipc(objs) else set()
    for dep in pdserve_deployments(objs):
        pod = dep["spec"]["template"]["spec"]
        for field in ("hostIPC", "hostPID", "hostNetwork"):
            assert field in allowed or not pod.get(field), f"{dep['metadata']['name']}: {field}"
        for ctr in pod_containers(pod):
            sc = ctr.get("securityContext", {})
            assert not sc.get("privileged") and sc.get("capabilities", {}).get("drop") == ["ALL"], ctr["name"]
            assert "NVIDIA_VISIBLE_DEVICES" not in container_env(objs, ctr), "GPUs come from the allocation"


def claim_sources(pod: Obj, ctr: Obj) -> set[tuple[str, str]]:
    """The claims whose every GPU `ctr` sees: (kind, name) of a named ResourceClaim or of the
    ResourceClaimTemplate that gives its Pod a claim of its own. A container's claim entry naming one
    `request` would give it only that request's devices: not counted."""
    out = set()
    for ref in ctr["resources"].get("claims", []):
        if "request" in ref:
            continue
        [pod_claim] = [c for c in pod.get("resourceClaims", []) if c["name"] == ref["name"]]
        if "resourceClaimName" in pod_claim:
            out.add(("ResourceClaim", pod_claim["resourceClaimName"]))
        else:
            out.add(("ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"]))
    return out


def check_both_see_one_claim(objs: tuple[Obj, ...], pods: dict[str, Obj]) -> Obj:
    """Prefill and decode (pod spec per role) both see every GPU of one claim, each computes on a GPU
    of its own within it, and the claim is their only GPU allocation. Returns the claim's object."""
    ctrs = {role: container(objs, role) for role in ROLES}
    [(kind, name)] = set.intersection(*(claim_sources(pods[r], ctrs[r]) for r in ROLES))
    if pods["prefill"] is not pods["decode"]:
        assert kind == "ResourceClaim", "across Pods, a claim template gives each Pod GPUs of its own"
    claim = one(objs, kind, name)
    spec = claim["spec"] if kind == "ResourceClaim" else claim["spec"]["spec"]
    requests = spec["devices"]["requests"]
    assert all(r["exactly"]["deviceClassName"] == "gpu.nvidia.com" for r in requests)
    gpus = sum(r["exactly"].get("count", 1) for r in requests)
    # Each process computes on its own GPU of the claim (both list the same GPUs in the same order).
    devices = [effective_config(objs, role).device for role in ROLES]
    indices = [int(d.partition(":")[2] or 0) for d in devices]
    assert all(0 <= i < gpus for i in indices), f"devices {devices} outside the claim's {gpus} GPU(s)"
    assert gpus < 2 or len(set(indices)) == 2, f"two GPUs claimed, one used: {devices}"
    # The claim is the only GPU allocation (no device-plugin GPUs beside it).
    for ctr in ctrs.values():
        for key in ("requests", "limits"):
            assert "nvidia.com/gpu" not in ctr["resources"].get(key, {}), ctr["name"]
    return claim


def test_pair_pod_gives_cuda_ipc_what_it_needs() -> None:
    objs = render("overlays/single-node-gpu")
    pod = deployment(objs, "decode")["spec"]["template"]["spec"]
    pair = container(objs, "prefill"), container(objs, "decode")
    # Distinct pids for the two processes (each would be pid 1 in a PID namespace of its own).
    assert pod.get("shareProcessNamespace") is True
    # One tmpfs at /dev/shm in both: the CUDA IPC events' rendezvous (the IPC namespace is the Pod's).
    shm = {c["name"]: [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"] for c in pair}
    assert shm["prefill"] == shm["decode"] and len(shm["decode"]) == 1, shm
    [vol] = [v for v in pod["volumes"] if v["name"] == shm["decode"][0]]
    assert vol["emptyDir"]["medium"] == "Memory"
    # Both containers see every GPU of one claim: prefill must see decode's GPU.
    check_both_see_one_claim(objs, {role: pod for role in ROLES})
    assert not find(objs, "ResourceClaim"), "a claim per pair Pod, from the template"


def test_per_role_pods_give_cuda_ipc_what_it_needs() -> None:
    objs = render("overlays/single-node-gpu-per-role")
    assert not paired(objs), "one Deployment per role"
    deps = {role: deployment(objs, role) for role in ROLES}
    pods = {role: dep["spec"]["template"]["spec"] for role, dep in deps.items()}
    for role, pod in pods.items():
        # The host's IPC namespace and /dev/shm (the CUDA IPC events' rendezvous across Pods), not an
        # emptyDir of the Pod's own; distinct pids in the host's PID namespace.
        assert pod.get("hostIPC") is True and pod.get("hostPID") is True, role
        assert not pod.get("shareProcessNamespace"), f"{role}: hostPID already gives one PID namespace"
        mounts = [m["mountPath"] for m in container(objs, role).get("volumeMounts", [])]
        assert "/dev/shm" not in mounts, f"{role}: a volume at /dev/shm would hide the host's"
        # Every replica shares the claim's GPUs: one replica, and no surge onto the same GPUs.
        assert deps[role]["spec"].get("replicas", 1) == 1, role
        assert deps[role]["spec"]["strategy"] == {"type": "Recreate"}, role
    # Both Pods see both GPUs of ONE named claim: prefill must see decode's GPU.
    claim = check_both_see_one_claim(objs, pods)
    assert claim["kind"] == "ResourceClaim" and not find(objs, "ResourceClaimTemplate")
    [pair_template] = find(render("overlays/single-node-gpu"), "ResourceClaimTemplate")
    assert claim["apiVersion"] == pair_template["apiVersion"], "the same DRA API as single-node-gpu"
    # Decode reaches that prefill through the prefill Service (test_contract.py checks it is headless).
    assert effective_config(objs, "decode").prefill_target.startswith("dns:///pdserve-prefill:")
    # hostIPC and hostPID are Pod Security "privileged": the namespace must admit them.
    [ns] = find(objs, "Namespace")
    assert ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "privileged"
