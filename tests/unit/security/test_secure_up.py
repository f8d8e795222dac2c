"""`pdmesh up --tls-dir DIR --api-keys-file F` (issue 13 item 9) and the router's internal
port in the launchers: each service gets its own certificate, the router its internal port
and the keys file; compose's internal-port addresses map to the router's internal listener."""

from __future__ import annotations

import json

import pytest

from pdmesh.cli import build_parser
from pdmesh.cli import main as pdmesh_main
from pdmesh.commands import check_certificates, mesh_specs
from pdmesh.compose_launch import ComposeService, Readiness, local_env
from pdmesh.mesh_tls import MissingCertificates
from tests.service.tls_mesh import make_certs


def up_args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def _flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_service_gets_its_own_certificate(tmp_path):
    certs = make_certs(
        tmp_path, workers=(("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1"))
    )
    args = up_args("--tls-dir", str(certs.dir), "--decode", "2")
    check_certificates(args)
    specs = {s.name: s for s in mesh_specs(args)}
    want = {
        "kvtransfer": "kvtransfer.pem",
        "prefill-0": "prefill-prefill-0.pem",
        "decode-0": "decode-decode-0.pem",
        "decode-1": "decode-decode-1.pem",
    }
    for name, cert in want.items():
        a = specs[name].args
        assert _flag(a, "--tls-cert-file").endswith("/" + cert), name
        assert _flag(a, "--tls-key-file").endswith(cert.replace(".pem", "-key.pem"))
        assert _flag(a, "--tls-require-client-cert") == "1"
        assert _flag(a, "--tls-server-name") == "pdmesh.internal"
        assert not any(k.startswith("PDMESH_TLS") for k in specs[name].env)  # flags, not a shared env


def test_missing_per_worker_certificates_are_named_with_the_command_that_makes_them(tmp_path):
    certs = make_certs(tmp_path)  # role certificates only
    with pytest.raises(MissingCertificates) as e:
        check_certificates(up_args("--tls-dir", str(certs.dir)))
    assert "decode-decode-0.pem" in str(e.value) and "pdmesh certs --out" in str(e.value)
    assert "--worker decode/decode-0" in str(e.value)


def test_up_takes_the_secure_layout_options():
    args = up_args("--tls-dir", "d", "--api-keys-file", "k.jsonl", "--router-internal-port", "0")
    assert (args.tls_dir, args.api_keys_file, args.router_internal_port) == ("d", "k.jsonl", 0)
    assert up_args().tls_dir is None and up_args().api_keys_file is None


def _svc(name: str, env: dict[str, str], deps=(), port=50051, internal=0) -> ComposeService:
    return ComposeService(
        name, "m", (), env, Readiness("grpc", "x", port), {d: "service_started" for d in deps}, port, internal
    )


def test_compose_addresses_of_the_internal_port_go_to_the_routers_internal_listener():
    router = _svc("router", {"PDMESH_PORT": "50051", "PDMESH_INTERNAL_PORT": "50061"}, internal=50061)
    decode = _svc(
        "decode",
        {"PDMESH_PORT": "50051", "PDMESH_ROUTER_ADDRESS": "router:50061", "X": "router:50051"},
        deps=("router",),
    )
    services = {"router": router, "decode": decode}
    # addresses are mesh hostnames: strings the rewrite maps, nothing binds them
    env = local_env(
        decode, services, {"router": ["router-0.mesh.test:7002"]}, {"router": ["router-0.mesh.test:7003"]}
    )
    assert env["PDMESH_ROUTER_ADDRESS"] == "router-0.mesh.test:7003" and env["X"] == "router-0.mesh.test:7002"
    assert local_env(router, services, {})["PDMESH_INTERNAL_PORT"] == "0"


def test_pdmesh_keys_add_admin_marks_an_operators_key(tmp_path, capsys):
    path = tmp_path / "keys.jsonl"
    assert pdmesh_main(["keys", "add", "ops", "--file", str(path), "--admin"]) == 0
    assert pdmesh_main(["keys", "add", "acme", "--file", str(path)]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("admin") for line in lines] == [True, None]
