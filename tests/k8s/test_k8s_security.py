"""Secure by default (k8s/README.md, "Security"), checked on every overlay: the NetworkPolicies admit
exactly the intended peers and ports (evaluated as a CNI would, for concrete Pods in and out of the
namespace), every pdserve container runs non-root on a read-only root filesystem with writable emptyDirs
where the runtime writes, /metrics binds the pod's IP, and the optional components (k8s/components/tls,
cert-manager, auth) render and validate on every overlay, mount whole Secrets, set only settings the
services read, and probe over TLS with the real `pdserve health` command line."""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import test_contract
import test_settings
from cert_manager import is_cert_manager
from cert_manager import validate as validate_cert_manager
from k8s_render import (
    DOWNWARD_SAMPLES,
    K8S,
    KUBERNETES_VERSION,
    ROLES,
    Obj,
    container,
    container_env,
    deployment,
    find,
    one,
    paired,
    pdserve_deployments,
    pod_containers,
    render,
    render_with,
    selects,
)
from test_contract import READINESS_NAME, effective_config

# Operator kustomizations checked here: an overlay alone, with TLS (Secrets made by the operator, or by
# cert-manager) and with bearer tokens.
VARIANTS = (
    (),
    ("tls",),
    ("tls", "cert-manager"),
    ("tls", "auth"),
    ("tls", "cert-manager", "auth"),
)
COMPONENTS = ("tls", "cert-manager", "auth")
TLS_SECRET = {"decode": "pdserve-decode-tls", "prefill": "pdserve-prefill-tls"}
AUTH_SECRET = "pdserve-auth-tokens"
DECODE_CLIENT_LABEL = ("pdserve/decode-client", "true")


def variant_id(components: tuple[str, ...]) -> str:
    return "+".join(components) or "plain"


@pytest.fixture(params=VARIANTS, ids=variant_id)
def components(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return request.param


@pytest.fixture
def variant(overlay: str, components: tuple[str, ...]) -> tuple[Obj, ...]:
    return render_with(overlay, components) if components else render(f"overlays/{overlay}")


def validate(obj: Obj) -> None:
    if is_cert_manager(obj):
        validate_cert_manager(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


GENERATED = ("pdserve-common", "pdserve-decode", "pdserve-prefill", "otel-collector")


def base_name(obj: Obj) -> tuple[str, str]:
    """(kind, name) with a generated ConfigMap's hash suffix dropped."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "ConfigMap" and name.rsplit("-", 1)[0] in GENERATED:
        name = name.rsplit("-", 1)[0]
    return obj["kind"], name


# --- components: render, validate, change only what they say -----------------------------------------


def test_every_component_is_checked() -> None:
    assert sorted(COMPONENTS) == sorted(
        p.name for p in (K8S / "components").iterdir() if p.is_dir() and p.name != "podmonitor"
    )  # podmonitor: tests/k8s/test_observability.py
    assert {c for v in VARIANTS for c in v} == set(COMPONENTS)


def test_variant_renders_and_validates_strictly(
    variant: tuple[Obj, ...], overlay: str, components: tuple[str, ...]
) -> None:
    for obj in variant:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{overlay}+{variant_id(components)}: {obj['kind']}/{obj['metadata']['name']}: {e}")
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "pdserve", base_name(obj)


def test_components_add_only_certificates(
    variant: tuple[Obj, ...], overlay: str, components: tuple[str, ...]
) -> None:
    """tls and auth change existing objects only; cert-manager adds its Issuers and Certificates."""
    plain = {base_name(o) for o in render(f"overlays/{overlay}")}
    added = {base_name(o) for o in variant} - plain
    expected = set()
    if "cert-manager" in components:
        expected = {("Issuer", "pdserve-selfsigned"), ("Issuer", "pdserve-ca"), ("Certificate", "pdserve-ca"),
                    ("Certificate", "pdserve-decode"), ("Certificate", "pdserve-prefill")}  # fmt: skip
    assert added == expected
    assert {base_name(o) for o in variant} >= plain, "a component removed an object"


def test_cert_manager_schema_is_not_a_no_op() -> None:
    [cert] = find(render_with("cpu-demo", ("cert-manager",)), "Certificate", "pdserve-decode")
    validate_cert_manager(cert)
    bad_usage, typo, no_secret = (copy.deepcopy(cert) for _ in range(3))
    bad_usage["spec"]["usages"] = ["serverAuth"]
    typo["spec"]["dnsName"] = ["x"]
    del no_secret["spec"]["secretName"]
    for bad in (bad_usage, typo, no_secret):
        with pytest.raises(jsonschema.ValidationError):
            validate_cert_manager(bad)


# --- the contract checks of test_settings.py / test_contract.py, on each component variant -------------


def test_variant_settings_are_real_and_parse(
    variant: tuple[Obj, ...], overlay: str, components: tuple[str, ...]
) -> None:
    """Every PDSERVE_* key a component sets is a setting the role reads, lives in a ConfigMap, and the
    whole env parses through the service's own parser."""
    name = f"{overlay}+{variant_id(components)}"
    test_settings.test_every_container_parses(variant, name)
    for role in ROLES:
        test_contract.test_env_is_read_by_the_service(variant, role)
        test_settings.test_every_setting_lives_in_a_configmap(variant, role)


# --- TLS ------------------------------------------------------------------------------------------------


def mount_of(pod: Obj, ctr: Obj, path: str) -> tuple[Obj, Obj]:
    """(volumeMount, volume) of the mount `path` lies under in `ctr`."""
    found = [m for m in ctr.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(found) == 1, f"{ctr['name']}: {path} is under no single mount: {found}"
    [vol] = [v for v in pod["volumes"] if v["name"] == found[0]["name"]]
    return found[0], vol


def secret_file(objs: tuple[Obj, ...], role: str, path: str) -> tuple[str, str]:
    """(Secret name, key) a file in `role`'s container comes from: a whole-Secret volume, read-only, no
    subPath (a subPath mount never sees a rotated Secret)."""
    pod = deployment(objs, role)["spec"]["template"]["spec"]
    mount, vol = mount_of(pod, container(objs, role), path)
    assert "secret" in vol, f"{role}: {path} is not from a Secret: {vol}"
    assert "subPath" not in mount and "subPathExpr" not in mount, f"{role}: {mount} would never update"
    assert mount.get("readOnly") is True
    assert "items" not in vol["secret"], "the whole Secret: cert-manager's keys as they are"
    assert vol["secret"].get("defaultMode") == 0o440, "readable by the pod's group (fsGroup) only"
    assert vol["secret"].get("optional") is not True, "no Secret, no start (never plaintext by accident)"
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    return vol["secret"]["secretName"], key


@dataclass
class Cert:
    secret: str
    names: set[str]  # SAN DNS names, IP addresses and the CN
    usages: set[str]
    issuer: str
    spec: Obj = field(repr=False)


def certificates(objs: tuple[Obj, ...]) -> dict[str, Cert]:
    """Secret name -> what cert-manager puts in it."""
    out = {}
    for c in find(objs, "Certificate"):
        spec = c["spec"]
        names = {*spec.get("dnsNames", []), *spec.get("ipAddresses", []), spec.get("commonName", "")} - {""}
        usages = set(spec.get("usages", []))
        out[spec["secretName"]] = Cert(spec["secretName"], names, usages, spec["issuerRef"]["name"], spec)
    return out


def probe_args(ctr: Obj, probe: str) -> Any:
    """The probe's command through the real `pdserve` CLI parser (shared/client/cli.py)."""
    from shared.client.cli import build_parser

    spec = ctr[probe]
    assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, f"{ctr['name']} {probe}: {spec}"
    command = spec["exec"]["command"]
    assert command[:2] == ["pdserve", "health"], shlex.join(command)
    args = build_parser().parse_args(command[1:])
    assert args.timeout < spec.get("timeoutSeconds", 1), f"{probe}: --timeout within timeoutSeconds"
    return args


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("with_cert_manager", [False, True], ids=["own-secrets", "cert-manager"])
def test_tls_component(overlay: str, role: str, with_cert_manager: bool) -> None:
    """Each role serves TLS from its own Secret; prefill demands decode's certificate; decode speaks TLS
    to prefill with that certificate; the probes are `pdserve health` over TLS on the service's port."""
    objs = render_with(overlay, ("tls", "cert-manager") if with_cert_manager else ("tls",))
    cfg = effective_config(objs, role)
    ctr = container(objs, role)
    files = {secret_file(objs, role, p) for p in (cfg.tls_cert, cfg.tls_key)}
    assert files == {(TLS_SECRET[role], "tls.crt"), (TLS_SECRET[role], "tls.key")}
    if role == "prefill":
        assert secret_file(objs, role, cfg.tls_client_ca) == (TLS_SECRET["prefill"], "ca.crt")
        assert cfg.client_names == ("pdserve-decode",), "only decode's certificate may call Prefill"
    else:
        assert not cfg.tls_client_ca, "the public API: TLS, callers authenticate with tokens (auth)"
        assert secret_file(objs, role, cfg.prefill_tls_ca) == (TLS_SECRET["decode"], "ca.crt")
        assert (cfg.prefill_tls_cert, cfg.prefill_tls_key) == (cfg.tls_cert, cfg.tls_key), "its own cert"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        args = probe_args(ctr, probe)
        host, _, port = args.target.rpartition(":")
        assert host in ("127.0.0.1", "localhost") and int(port) == cfg.port, args.target
        assert args.service == (READINESS_NAME[role] if probe == "readinessProbe" else "")
        # The probe trusts the CA and shows the role's own certificate (prefill checks every caller's).
        assert secret_file(objs, role, args.tls_ca) == (TLS_SECRET[role], "ca.crt")
        assert (args.tls_cert, args.tls_key) == (cfg.tls_cert, cfg.tls_key)
        assert args.tls_server_name == f"pdserve-{role}"
    # The Services announce no cleartext HTTP/2.
    for svc in find(objs, "Service"):
        if svc["metadata"]["labels"].get("app.kubernetes.io/name") == "pdserve":
            assert all("appProtocol" not in p for p in svc["spec"]["ports"]), svc["metadata"]["name"]
    if not with_cert_manager:
        return
    # What cert-manager issues satisfies every name the roles check.
    certs = certificates(objs)
    mine = certs[TLS_SECRET[role]]
    assert {"server auth", "client auth"} <= mine.usages
    assert f"pdserve-{role}" in mine.names, "the probes' --tls-server-name"
    if role == "decode":
        assert set(effective_config(objs, "prefill").client_names) & mine.names, "prefill admits decode"
        target = cfg.prefill_target.removeprefix("dns:///").rpartition(":")[0]
        assert target in certs[TLS_SECRET["prefill"]].names, f"decode checks prefill as {target}"
    else:
        svc = find(objs, "Service", "pdserve-prefill")
        assert bool(svc) != paired(objs)
        for s in svc:  # the Service's names, short to fully qualified
            ns = s["metadata"]["namespace"]
            fqdn = {
                f"pdserve-prefill.{ns}",
                f"pdserve-prefill.{ns}.svc",
                f"pdserve-prefill.{ns}.svc.cluster.local",
            }
            assert fqdn <= mine.names
    decode_svc = one(objs, "Service", "pdserve-decode")
    assert f"pdserve-decode.{decode_svc['metadata']['namespace']}.svc" in certs[TLS_SECRET["decode"]].names


def test_cert_manager_chain() -> None:
    """self-signed Issuer -> CA Certificate -> CA Issuer -> one Certificate per role."""
    objs = render_with("cpu-demo", ("tls", "cert-manager"))
    issuers = {i["metadata"]["name"]: i["spec"] for i in find(objs, "Issuer")}
    certs = {c["metadata"]["name"]: c["spec"] for c in find(objs, "Certificate")}
    assert not find(objs, "ClusterIssuer"), "namespaced: nothing outside pdserve can use this CA"
    [root] = [n for n, s in issuers.items() if "selfSigned" in s]
    [(ca_name, ca)] = [(n, s) for n, s in certs.items() if s.get("isCA")]
    assert ca["issuerRef"] == {"name": root, "kind": "Issuer", "group": "cert-manager.io"}
    [ca_issuer] = [n for n, s in issuers.items() if s.get("ca", {}).get("secretName") == ca["secretName"]]
    leaves = {n: s for n, s in certs.items() if n != ca_name}
    assert {s["secretName"] for s in leaves.values()} == set(TLS_SECRET.values())
    for name, spec in leaves.items():
        assert spec["issuerRef"] == {"name": ca_issuer, "kind": "Issuer", "group": "cert-manager.io"}, name
        assert not spec.get("isCA")
        assert {"server auth", "client auth"} <= set(spec["usages"]), name
        assert spec["privateKey"].get("rotationPolicy") == "Always", f"{name}: a new key at each renewal"
    # No Pod mounts the CA's key.
    for dep in find(objs, "Deployment"):
        for vol in dep["spec"]["template"]["spec"].get("volumes", []):
            assert vol.get("secret", {}).get("secretName") != ca["secretName"], dep["metadata"]["name"]


def test_auth_component(overlay: str) -> None:
    objs = render_with(overlay, ("tls", "auth"))
    cfg = effective_config(objs, "decode")
    assert secret_file(objs, "decode", cfg.auth_tokens_file) == (AUTH_SECRET, "tokens")
    prefill = container(objs, "prefill")
    assert "PDSERVE_AUTH_TOKENS_FILE" not in container_env(objs, prefill), "prefill reads no tokens"
    volumes = {v["name"]: v for v in deployment(objs, "prefill")["spec"]["template"]["spec"]["volumes"]}
    for mount in prefill.get("volumeMounts", []):
        assert volumes[mount["name"]].get("secret", {}).get("secretName") != AUTH_SECRET
    assert not find(objs, "Secret"), "no token ships in the manifests: the operator creates the Secret"


def test_without_tls_probes_stay_grpc(objs: tuple[Obj, ...]) -> None:
    """The plain overlays keep the kubelet's own gRPC probes (test_contract.py checks ports and names)."""
    for role in ROLES:
        cfg = effective_config(objs, role)
        assert not cfg.tls_cert and not getattr(cfg, "prefill_tls_ca", "")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in container(objs, role)[probe]


# --- non-root, read-only root filesystem -----------------------------------------------------------------

# Pod Security "restricted" admits these volume kinds only.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip


def effective_security(pod: Obj, ctr: Obj, key: str) -> Any:
    return ctr.get("securityContext", {}).get(key, pod.get("securityContext", {}).get(key))


def test_every_pdserve_container_is_locked_down(variant: tuple[Obj, ...]) -> None:
    for dep in pdserve_deployments(variant):
        pod = dep["spec"]["template"]["spec"]
        for ctr in pod_containers(pod):
            where = f"{dep['metadata']['name']}/{ctr['name']}"
            sc = ctr.get("securityContext", {})
            assert effective_security(pod, ctr, "runAsNonRoot") is True, where
            assert effective_security(pod, ctr, "runAsUser") not in (None, 0), where
            assert effective_security(pod, ctr, "runAsGroup") not in (None, 0), where
            assert effective_security(pod, ctr, "seccompProfile") == {"type": "RuntimeDefault"}, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities") == {"drop": ["ALL"]}, f"{where}: drop all, add none"
            assert not sc.get("privileged"), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            check_writable_paths(pod, ctr, container_env(variant, ctr), where)


def check_writable_paths(pod: Obj, ctr: Obj, env: dict[str, str], where: str) -> None:
    """What the runtime writes lands on an emptyDir: /tmp (Triton's gcc builds) and $HOME (Triton's and
    CUDA's caches, ~/.cache); /dev/shm is an emptyDir or, with hostIPC, the host's."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in ctr.get("volumeMounts", [])}
    home = env.get("HOME")
    assert home, f"{where}: HOME not set: a runtime without the image's passwd entry would use /"
    for path in ("/tmp", home):
        assert path in mounts and "emptyDir" in mounts[path], f"{where}: {path} is not a writable emptyDir"
        assert mounts[path]["emptyDir"].get("sizeLimit"), f"{where}: {path} without a size limit"
    if not pod.get("hostIPC"):
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", where


def restricted_violations(pod: Obj) -> list[str]:
    """What Pod Security "restricted" (latest) would refuse in a pod spec."""
    out = []
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(ns):
            out.append(ns)
    for vol in pod.get("volumes", []):
        kind = (set(vol) - {"name"}).pop()
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: {kind}")
    for ctr in pod_containers(pod):
        sc, name = ctr.get("securityContext", {}), ctr["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if effective_security(pod, ctr, "runAsNonRoot") is not True:
            out.append(f"{name}: runAsNonRoot")
        if effective_security(pod, ctr, "runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = effective_security(pod, ctr, "seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities")
        if any(p.get("hostPort") for p in ctr.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


def test_namespace_enforces_pod_security(variant: tuple[Obj, ...], overlay: str) -> None:
    """The namespace enforces "restricted" and every Pod (collector and Jaeger too) meets it; only
    single-node-gpu-per-role (hostIPC, hostPID for cuda_ipc across Pods) runs "privileged"."""
    [ns] = find(variant, "Namespace")
    level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    for dep in find(variant, "Deployment"):
        violations = restricted_violations(dep["spec"]["template"]["spec"])
        if level == "restricted":
            assert not violations, f"{dep['metadata']['name']}: {violations}"
    if overlay == "single-node-gpu-per-role":
        assert level == "privileged"
        for role in ROLES:  # host namespaces, and nothing else "restricted" forbids
            pod = deployment(variant, role)["spec"]["template"]["spec"]
            assert set(restricted_violations(pod)) == {"hostPID", "hostIPC"}
    else:
        assert level == "restricted"


# --- /metrics on the pod's IP ----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_metrics_bind_the_pod_ip(objs: tuple[Obj, ...], role: str) -> None:
    ctr = container(objs, role)
    [var] = [v for v in ctr["env"] if v["name"] == "PDSERVE_METRICS_HOST"]
    assert var["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    cfg = effective_config(objs, role)
    assert cfg.metrics_host == DOWNWARD_SAMPLES["status.podIP"]
    # gRPC stays on every address: kubectl port-forward connects over the pod's loopback.
    assert cfg.host == "[::]"


# --- NetworkPolicy ---------------------------------------------------------------------------------------

ANY = None  # a port rule without a port: every port of the protocol


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: outside the cluster
    labels: tuple[tuple[str, str], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()  # named container ports

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass
class Cluster:
    """The rendered objects plus the namespaces and Pods around them."""

    objs: tuple[Obj, ...]
    namespaces: dict[str, dict[str, str]]
    pods: dict[str, Pod]

    def policies_for(self, pod: Pod, direction: str) -> list[Obj]:
        return [
            p for p in find(self.objs, "NetworkPolicy")
            if p["metadata"]["namespace"] == pod.namespace and direction in p["spec"].get("policyTypes", [])
            and selects(p["spec"]["podSelector"], pod.label_map)
        ]  # fmt: skip

    def peer_matches(self, policy: Obj, peer: Obj, other: Pod) -> bool:
        assert "ipBlock" not in peer, "peers are Pods and namespaces, not addresses"
        if other.namespace is None:
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], self.namespaces[other.namespace]):
                return False
        elif other.namespace != policy["metadata"]["namespace"]:
            return False
        return selects(peer.get("podSelector", {}), other.label_map)

    def allows(self, pod: Pod, direction: str, other: Pod, port: int, protocol: str, dst: Pod) -> bool:
        policies = self.policies_for(pod, direction)
        if not policies:
            return True  # not isolated in this direction
        peers_key = "from" if direction == "Ingress" else "to"
        for policy in policies:
            for rule in policy["spec"].get(direction.lower(), []):
                peers = rule.get(peers_key, [])
                if peers and not any(self.peer_matches(policy, p, other) for p in peers):
                    continue
                ports = rule.get("ports", [])
                if not ports or any(port_matches(r, port, protocol, dst) for r in ports):
                    return True
        return False

    def connects(self, src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        """`src`'s egress and `dst`'s ingress both allow it."""
        a, b = self.pods[src], self.pods[dst]
        return self.allows(a, "Egress", b, port, protocol, b) and self.admits(dst, src, port, protocol)

    def admits(self, dst: str, src: str, port: int, protocol: str = "TCP") -> bool:
        """`dst`'s ingress allows it (whatever `src`'s own egress says)."""
        a, b = self.pods[src], self.pods[dst]
        return self.allows(b, "Ingress", a, port, protocol, b)

    def admitted(self, dst: str, port: int) -> set[str]:
        return {p for p in self.pods if p != dst and self.admits(dst, p, port)}


def port_matches(rule: Obj, port: int, protocol: str, dst: Pod) -> bool:
    if rule.get("protocol", "TCP") != protocol:
        return False
    want = rule.get("port", ANY)
    if want is ANY:
        return True
    if isinstance(want, str):  # a named port of the destination Pod
        want = dict(dst.ports).get(want)
    return want is not None and want <= port <= rule.get("endPort", want)


def pod_of(dep: Obj, name: str) -> Pod:
    template = dep["spec"]["template"]
    ports = tuple(
        (p["name"], p["containerPort"]) for c in pod_containers(template["spec"]) for p in c.get("ports", [])
    )
    labels = tuple(sorted(template["metadata"]["labels"].items()))
    return Pod(name, dep["metadata"]["namespace"], labels, ports)


def cluster(objs: tuple[Obj, ...]) -> Cluster:
    """The overlay's Pods in namespace pdserve (labelled as rendered, plus the label every namespace
    gets), Prometheus and another Pod in `monitoring`, a client in a namespace labelled for decode, one
    in a namespace that is not, cluster DNS, and an address outside the cluster."""
    [ns] = find(objs, "Namespace")
    name = ns["metadata"]["name"]
    label, value = DECODE_CLIENT_LABEL
    namespaces = {
        name: {**ns["metadata"].get("labels", {}), "kubernetes.io/metadata.name": name},
        "monitoring": {"kubernetes.io/metadata.name": "monitoring"},
        "ingress-nginx": {"kubernetes.io/metadata.name": "ingress-nginx", label: value},
        "other": {"kubernetes.io/metadata.name": "other"},
        "kube-system": {"kubernetes.io/metadata.name": "kube-system"},
    }  # fmt: skip
    pods = {
        "prometheus": Pod("prometheus", "monitoring", (("app.kubernetes.io/name", "prometheus"),)),
        "grafana": Pod("grafana", "monitoring", (("app.kubernetes.io/name", "grafana"),)),
        "ingress": Pod("ingress", "ingress-nginx", (("app.kubernetes.io/name", "ingress-nginx"),)),
        "stranger": Pod("stranger", "other", (("app", "x"),)),
        # Labelled as a pdserve decode, but in another namespace: not one of ours.
        "impostor": Pod("impostor", "other", (("app.kubernetes.io/name", "pdserve"),
                                              ("app.kubernetes.io/component", "decode"))),
        "kube-dns": Pod("kube-dns", "kube-system", (("k8s-app", "kube-dns"),)),
        "internet": Pod("internet", None),
        "neighbour": Pod("neighbour", name, (("app", "client"),)),
    }  # fmt: skip
    for dep in find(objs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        ours = labels["app.kubernetes.io/name"] == "pdserve"
        key = labels["app.kubernetes.io/component"] if ours else labels["app.kubernetes.io/name"]
        pods[key] = pod_of(dep, key)  # decode, prefill or pair; otel-collector, jaeger
    return Cluster(objs, namespaces, pods)


def opened(c: Cluster, pod: str, direction: str) -> set[tuple[str, int | None]]:
    """(protocol, port) pairs any rule of the policies selecting `pod` opens in `direction`."""
    out = set()
    for policy in c.policies_for(c.pods[pod], direction):
        for rule in policy["spec"].get(direction.lower(), []):
            assert rule.get("ports"), f"{policy['metadata']['name']}: a rule for every port and protocol"
            out |= {(r.get("protocol", "TCP"), r.get("port", ANY)) for r in rule["ports"]}
    return out


def nixl(objs: tuple[Obj, ...]) -> bool:
    return effective_config(objs, "decode").kv_transfer == "nixl"


def test_policies_select_the_pods_they_claim(objs: tuple[Obj, ...]) -> None:
    """Every pdserve Pod is isolated both ways by exactly one policy, every policy selects pdserve Pods
    of this overlay, and the collector and Jaeger are left as they were (no policy selects them)."""
    c = cluster(objs)
    ours = {pod_of(d, "").labels for d in pdserve_deployments(objs)}
    for policy in find(objs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        selected = [lbl for lbl in ours if selects(policy["spec"]["podSelector"], dict(lbl))]
        assert selected, f"{policy['metadata']['name']} selects no Pod of this overlay"
    for dep in find(objs, "Deployment"):
        pod = pod_of(dep, dep["metadata"]["name"])
        for direction in ("Ingress", "Egress"):
            n = len(c.policies_for(pod, direction))
            assert n == (1 if pod.labels in ours else 0), (
                f"{dep['metadata']['name']} {direction}: {n} policies"
            )


def test_policies_open_exactly_these_ports(objs: tuple[Obj, ...]) -> None:
    c = cluster(objs)
    port = {r: effective_config(objs, r).port for r in ROLES}
    metrics = {r: effective_config(objs, r).metrics_port for r in ROLES}
    dns = {("UDP", 53), ("TCP", 53)}
    otlp = {("TCP", 4317)}
    nixl_any = {("TCP", ANY)} if nixl(objs) else set()
    if paired(objs):
        # Both roles' /metrics, decode's API; not prefill's gRPC port (loopback only).
        scraped = {("TCP", metrics["decode"]), ("TCP", metrics["prefill"])}
        assert opened(c, "pair", "Ingress") == {("TCP", port["decode"])} | scraped
        assert opened(c, "pair", "Egress") == dns | otlp
        return
    assert opened(c, "decode", "Ingress") == {("TCP", port["decode"]), ("TCP", metrics["decode"])} | nixl_any
    assert opened(c, "decode", "Egress") == dns | otlp | {("TCP", port["prefill"])} | nixl_any
    assert (
        opened(c, "prefill", "Ingress") == {("TCP", port["prefill"]), ("TCP", metrics["prefill"])} | nixl_any
    )
    assert opened(c, "prefill", "Egress") == dns | otlp | nixl_any


def test_policies_admit_exactly_these_peers(objs: tuple[Obj, ...]) -> None:
    c = cluster(objs)
    port = {r: effective_config(objs, r).port for r in ROLES}
    metrics = {r: effective_config(objs, r).metrics_port for r in ROLES}
    decode = "pair" if paired(objs) else "decode"
    everyone = [p for p in c.pods if p != decode]
    # The public API: every Pod of this namespace and of a namespace labelled for it; nobody else.
    public = c.admitted(decode, port["decode"])
    assert public == {p for p in everyone if c.pods[p].namespace in ("pdserve", "ingress-nginx")}, public
    assert c.connects("neighbour", decode, port["decode"]) and c.connects("ingress", decode, port["decode"])
    # /metrics: Prometheus in `monitoring` only (and, under nixl's any-port rule, the other role).
    for role in ROLES:
        target = decode if paired(objs) else role
        others = {r for r in ROLES if r != role} if nixl(objs) else set()
        assert c.admitted(target, metrics[role]) == {"prometheus"} | others, f"{role} /metrics"
        assert c.connects("prometheus", target, metrics[role])
    # Out: DNS anywhere (a node-local cache included), OTLP to the collector only, nothing else outside.
    assert c.connects(decode, "kube-dns", 53, "UDP") and c.connects(decode, "kube-dns", 53, "TCP")
    assert c.connects(decode, "otel-collector", 4317)
    assert not c.connects(decode, "jaeger", 4317), "spans go through the collector"
    assert not c.connects(decode, "internet", 443) and not c.connects(decode, "stranger", 50051)
    if paired(objs):
        # Prefill's port in the pair Pod: nobody over the network (decode calls it over loopback).
        assert not c.admitted(decode, port["prefill"])
        return
    # Prefill's gRPC port: this namespace's decode Pods only (not one labelled so elsewhere).
    assert c.admitted("prefill", port["prefill"]) == {"decode"}
    assert c.connects("decode", "prefill", port["prefill"])
    assert c.connects("prefill", "otel-collector", 4317) and c.connects("prefill", "kube-dns", 53, "UDP")
    assert not c.connects("prefill", "internet", 443)
    # NIXL/UCX (multi-node): prefill and decode reach each other on any TCP port, both ways; still not
    # decode to decode, not UDP, and nobody else.
    ucx_port = 40123
    both_ways = c.connects("prefill", "decode", ucx_port) and c.connects("decode", "prefill", ucx_port)
    assert both_ways == nixl(objs)
    assert not c.connects("prefill", "decode", port["decode"]) or nixl(objs), (
        "prefill never calls decode's API"
    )
    assert not c.connects("decode", "prefill", ucx_port, "UDP")
    assert not c.connects("decode", "decode", ucx_port)
    for role in ROLES:
        assert c.admitted(role, ucx_port) == ({"decode", "prefill"} - {role} if nixl(objs) else set())


# The documented way to admit one namespace to decode's port instead of the labelled ones (k8s/README.md).
ADMIT_INGRESS_NGINX = """
patches:
  - target: {kind: NetworkPolicy, name: pdserve-decode}
    patch: |-
      - op: replace
        path: /spec/ingress/0/from
        value:
          - namespaceSelector:
              matchLabels: {kubernetes.io/metadata.name: ingress-nginx}
"""


def test_decode_clients_are_configurable() -> None:
    objs = render_with("cpu-demo", (), ADMIT_INGRESS_NGINX)
    c = cluster(objs)
    c.namespaces["ingress-nginx"].pop(DECODE_CLIENT_LABEL[0])
    assert c.admitted("decode", 50051) == {"ingress"}
    assert c.connects("decode", "prefill", 50052), "the rest is unchanged"


def test_network_policy_check_is_not_a_no_op() -> None:
    """The evaluator above refuses what a CNI would: a decode policy that admits every namespace opens
    the API to strangers; without the prefill policy anyone reaches prefill."""
    objs = copy.deepcopy(render("overlays/cpu-demo"))
    [policy] = [p for p in objs if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "pdserve-decode"]
    policy["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}}]
    assert cluster(objs).connects("stranger", "decode", 50051)
    without_prefill = tuple(
        o for o in objs if o["metadata"]["name"] != "pdserve-prefill" or o["kind"] != "NetworkPolicy"
    )
    assert cluster(without_prefill).connects("stranger", "prefill", 50052)
    assert not cluster(render("overlays/cpu-demo")).connects("stranger", "prefill", 50052)


def test_components_keep_the_policies(objs: tuple[Obj, ...], overlay: str) -> None:
    """TLS changes no port: the policies with every component are the overlay's own."""
    with_all = render_with(overlay, ("tls", "cert-manager", "auth"))
    assert find(with_all, "NetworkPolicy") == find(objs, "NetworkPolicy")
