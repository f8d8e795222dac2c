"""`pdmesh certs` / `pdmesh keys`, TlsConfig validation, and the --tls-* flags of every
service and CLI command (derived from the parsers, as the deploy tests do)."""

from __future__ import annotations

import json
import os

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdmesh.certs import ROLES, SERVICE_NAMES
from pdmesh.cli import build_parser, main
from services.common.call_guards import INTERNAL_ROLES, allowed_roles
from services.common.config import ConfigError, build
from services.common.tls import MESH_DNS_NAME, TlsConfig, check_key_pair, parse_identity
from services.router.auth import hash_key
from tests.unit.deploy import repo

TLS_VARS = {
    "PDMESH_TLS_CERT_FILE",
    "PDMESH_TLS_KEY_FILE",
    "PDMESH_TLS_CA_FILE",
    "PDMESH_TLS_REQUIRE_CLIENT_CERT",
    "PDMESH_TLS_SERVER_NAME",
}


def san(path) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_pdmesh_certs_writes_a_ca_and_one_certificate_per_role(tmp_path, capsys):
    assert (
        main(
            [
                "certs",
                "--out",
                str(tmp_path),
                "--hosts",
                "mesh.example.com,10.1.2.3",
                "--worker",
                "decode/d-0",
            ]
        )
        == 0
    )
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / f"{role}.pem").read_bytes())
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        check_key_pair((tmp_path / f"{role}.pem").read_bytes(), (tmp_path / f"{role}-key.pem").read_bytes())
        assert os.stat(tmp_path / f"{role}-key.pem").st_mode & 0o777 == 0o600
        names = san(tmp_path / f"{role}.pem")
        (uri,) = names.get_values_for_type(x509.UniformResourceIdentifier)
        assert parse_identity(uri).role == role
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
        dns = names.get_values_for_type(x509.DNSName)
        if role == "client":  # a caller only: it cannot pose as a server
            assert dns == [] and ExtendedKeyUsageOID.SERVER_AUTH not in usage
            continue
        assert {"localhost", role, "mesh.example.com"} <= set(dns)
        assert (MESH_DNS_NAME in dns) == (role in INTERNAL_ROLES)
        assert "10.1.2.3" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        assert not (set(SERVICE_NAMES) - {role}) & set(dns)  # no other role's service name
    (uri,) = san(tmp_path / "decode-d-0.pem").get_values_for_type(x509.UniformResourceIdentifier)
    assert parse_identity(uri).name == "d-0"
    assert "ca.pem" in capsys.readouterr().out
    # Run again: the CA is kept (certificates issued before stay valid) unless --new-ca.
    before = (tmp_path / "ca.pem").read_bytes()
    assert main(["certs", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ca.pem").read_bytes() == before
    assert main(["certs", "--out", str(tmp_path), "--new-ca"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != before


def test_pdmesh_certs_refuses_a_bad_worker_spec(tmp_path):
    assert main(["certs", "--out", str(tmp_path), "--worker", "pilot/x"]) == 2


def test_pdmesh_keys_add_prints_the_key_once_and_stores_its_hash(tmp_path, capsys):
    path = tmp_path / "keys.jsonl"
    assert (
        main(["keys", "add", "acme", "--file", str(path), "--max-priority", "3", "--max-inflight", "4"]) == 0
    )
    key = capsys.readouterr().out.strip()
    entry = json.loads(path.read_text())
    assert entry == {"key_sha256": hash_key(key), "tenant": "acme", "max_priority": 3, "max_inflight": 4}
    assert main(["keys", "hash", key]) == 0
    assert capsys.readouterr().out.strip() == hash_key(key)
    assert main(["keys", "add", "acme", "--file", str(path), "--max-inflight", "0"]) == 2


def test_tls_config_refuses_half_configurations(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    with pytest.raises(ConfigError, match="go together"):
        build(TlsConfig, None, {"PDMESH_TLS_CERT_FILE": str(pem)}, "tls_")
    with pytest.raises(ConfigError, match="require_client_cert needs"):
        build(
            TlsConfig, None, {"PDMESH_TLS_REQUIRE_CLIENT_CERT": "1", "PDMESH_TLS_CA_FILE": str(pem)}, "tls_"
        )
    with pytest.raises(ConfigError, match="no such file"):
        build(TlsConfig, None, {"PDMESH_TLS_CA_FILE": str(tmp_path / "missing.pem")}, "tls_")
    assert not TlsConfig().enabled
    assert build(TlsConfig, None, {"PDMESH_TLS_CA_FILE": str(pem)}, "tls_").enabled


@pytest.mark.parametrize("module", [*repo.GRPC_MODULES, repo.GATEWAY_MODULE])
def test_every_service_takes_the_tls_flags(module):
    assert repo.flag_env_names(module) >= TLS_VARS


def test_the_router_takes_api_keys_and_every_grpc_service_the_health_port_and_call_cap():
    assert {"PDMESH_API_KEYS_FILE", "PDMESH_API_KEYS", "PDMESH_ADMISSION_TENANT_MAX_INFLIGHT"} <= (
        repo.flag_env_names("services.router.main")
    )
    for module in repo.GRPC_MODULES:
        names = repo.flag_env_names(module)
        assert {
            "PDMESH_HEALTH_PORT",
            "PDMESH_MAX_CALLS_PER_CONNECTION",
            "PDMESH_MAX_CONCURRENT_STREAMS",
        } <= names


@pytest.mark.parametrize("command", ["health", "generate", "workers"])
def test_cli_commands_take_tls_flags(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    flags = {opt for a in sub._actions for opt in a.option_strings}
    assert {"--tls-cert-file", "--tls-key-file", "--tls-ca-file", "--tls-server-name"} <= flags
    assert ("--api-key" in flags) == (command != "health")


def test_internal_methods_are_closed_to_public_roles_by_default():
    # Issue 13 item 7: decode Generate is the router's alone; an RPC the table does not name
    # is closed to every role (it used to be open to every internal one).
    assert allowed_roles("/pdmesh.v1.DecodeService/Generate") == {"router"}
    assert allowed_roles("/pdmesh.v1.SomeFutureService/Anything") == frozenset()
    assert not allowed_roles("/pdmesh.v1.DecodeService/Generate") & (INTERNAL_ROLES - {"router"})
    assert "client" in allowed_roles("/pdmesh.v1.RouterService/Generate")
    assert allowed_roles("/pdmesh.v1.PrefillService/Release") == {"decode"}


def test_cli_tls_and_key_come_from_flags_or_the_environment(tmp_path, monkeypatch):
    from pdmesh.client import auth_metadata, tls_of

    assert main(["certs", "--out", str(tmp_path)]) == 0
    sub = build_parser()._subparsers._group_actions[0].choices["workers"]
    assert tls_of(sub.parse_args([])) is None  # nothing set: plaintext
    monkeypatch.setenv("PDMESH_TLS_CA_FILE", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("PDMESH_API_KEY", "pdm_from_env")
    args = sub.parse_args(
        ["--tls-cert-file", str(tmp_path / "client.pem"), "--tls-key-file", str(tmp_path / "client-key.pem")]
    )
    tls = tls_of(args)
    assert (
        tls is not None
        and tls.config.ca_file.endswith("ca.pem")
        and tls.config.cert_file.endswith("client.pem")
    )
    assert auth_metadata(args) == (("authorization", "Bearer pdm_from_env"),)
    assert auth_metadata(sub.parse_args(["--api-key", "pdm_flag"])) == (("authorization", "Bearer pdm_flag"),)
