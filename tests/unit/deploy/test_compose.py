"""compose.yaml, checked without Docker: every image, build, command, healthcheck,
variable and address resolves to something in this repository, the start order
cannot deadlock, and Debian's docker-compose (where installed) accepts the file.
The e2e twin, tests/e2e/test_compose_launch.py, runs it."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from pdmesh.cli import build_parser
from pdmesh.compose_launch import ComposeError, ComposeService, load_compose, local_env, start_order
from tests.unit.deploy import repo

COMPOSE = repo.ROOT / "compose.yaml"
ROLES = {"kvtransfer", "router", "prefill", "decode"}  # the router serves HTTP itself: no gateway


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, ComposeService]:
    return load_compose(COMPOSE)


def test_every_role_is_a_service(services):
    assert set(services) == ROLES


def test_one_image_built_from_docker_dir(raw):
    for name, svc in raw["services"].items():
        gpu = "gpu" in svc.get("profiles", ())  # TensorRT-LLM workers: tests/unit/trtllm/test_gpu_deploy.py
        assert svc["image"] == (repo.image().replace("pdmesh:", "pdmesh-trtllm:") if gpu else repo.image()), (
            name
        )
        if gpu or "build" in svc:
            assert svc["build"]["context"] == "."
            assert (repo.ROOT / svc["build"]["dockerfile"]).is_file(), name


def test_the_cpu_image_is_built_once_and_the_others_reuse_it(raw):
    """One `build:` for the CPU image: `up --build` builds it once, not once per service."""
    cpu = {n: s for n, s in raw["services"].items() if "gpu" not in s.get("profiles", ())}
    builders = [n for n, s in cpu.items() if "build" in s]
    assert builders == ["router"], builders
    assert raw["services"]["router"]["build"]["dockerfile"] == "docker/Dockerfile"
    # The build arguments the Dockerfile declares, passed through from the shell, no host paths.
    dockerfile = (repo.ROOT / "docker" / "Dockerfile").read_text()
    for arg in raw["services"]["router"]["build"]["args"]:
        assert f"ARG {arg}" in dockerfile, arg
    assert not {"PIP_CERT", "PIP_FIND_LINKS"} & set(raw["services"]["router"]["build"]["args"])


def test_commands_are_real_modules_with_known_flags(services):
    for svc in services.values():
        assert repo.module_exists(svc.module), svc.module
        assert repo.accepts(svc.module, list(svc.args)), (svc.name, svc.args)


def test_every_variable_is_a_flag_of_that_service(services):
    for svc in services.values():
        pdmesh_vars = {k for k in svc.env if k.startswith("PDMESH_")}
        unknown = pdmesh_vars - repo.known_env_names(svc.module)
        assert not unknown, f"{svc.name}: {sorted(unknown)} are not flags of {svc.module}"


def test_healthchecks_ask_for_each_services_own_readiness(raw, services):
    assert "health" in build_parser()._subparsers._group_actions[0].choices  # `pdmesh health` exists
    for svc in services.values():
        assert svc.ready.port == svc.port, f"{svc.name} checks a port it does not listen on"
        if svc.module == repo.GATEWAY_MODULE:
            assert (svc.ready.kind, svc.ready.target) == ("http", "/health")
            assert repo.module_exists("services.gateway.healthcheck")
        else:
            assert (svc.ready.kind, svc.ready.target) == ("grpc", repo.ready_name(svc.module))
        assert raw["services"][svc.name]["healthcheck"]["test"][0] == "CMD"


def test_addresses_name_services_on_their_ports_and_their_dependencies(services):
    for svc in services.values():
        for key, value in svc.env.items():
            for host, port in repo.ADDRESS.findall(value):
                assert host in services, f"{svc.name}: {key} names unknown host {host}"
                # a service's port, or the router's internal (membership) listener
                assert int(port) in (services[host].port, services[host].internal_port), (
                    f"{svc.name}: {key} uses {host}:{port}"
                )
                assert host in svc.depends_on, f"{svc.name}: {key} uses {host} without depends_on"


def test_start_order_cannot_deadlock(services):
    """Router readiness needs a decode worker, so the router waits for nothing and
    workers wait for the router only to be started; they join it at run time."""
    assert start_order(services)  # acyclic
    assert services["router"].depends_on == {}
    for worker in ("prefill", "decode"):
        assert services[worker].depends_on["router"] == "service_started"
        assert services[worker].depends_on["kvtransfer"] == "service_healthy"
        # workers join at the router's internal listener, never its public port
        assert (
            services["router"].internal_port and services["router"].internal_port != services["router"].port
        )
        assert services[worker].env["PDMESH_ROUTER_ADDRESS"] == f"router:{services['router'].internal_port}"
    assert "gateway" not in services  # the router process serves the HTTP API itself


def test_the_router_serves_and_publishes_the_http_api(raw, services):
    for name in ("router", "router-gpu"):
        env = raw["services"][name]["environment"]
        assert env["PDMESH_HTTP_PORT"] == "8000", name
        assert any(p.endswith(":8000") for p in raw["services"][name]["ports"]), name
    assert repo.accepts(services["router"].module, ["--http-port", "8000"])


def test_cpu_services_run_with_a_read_only_root_and_no_capabilities(raw):
    for name in ROLES:
        svc = raw["services"][name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert {t.split(":")[0] for t in svc["tmpfs"]} == {"/tmp", "/home/pdmesh"}, name


def test_ports_only_on_router_and_gateway_and_one_network(raw):
    published = {name for name, svc in raw["services"].items() if svc.get("ports")}
    assert published == {"router", "router-gpu"}  # gRPC, metrics and HTTP: the one front door
    for name in published:  # loopback unless PDMESH_BIND_ADDRESS says otherwise; never 50061
        for port in raw["services"][name]["ports"]:
            assert port.startswith("${PDMESH_BIND_ADDRESS:-127.0.0.1}:"), (name, port)
            assert not port.endswith(":50061"), (name, port)
    assert "container_name" not in raw["services"]["decode"]  # --scale decode=N needs generated names
    networks = {tuple(svc["networks"]) for svc in raw["services"].values()}
    assert networks == {("mesh",)} and "mesh" in raw["networks"]


def test_local_env_rewrites_listen_address_ports_and_peer_addresses(services):
    addresses = {"kvtransfer": ["kvtransfer-0.mesh.test:7001"], "router": ["router-0.mesh.test:7002"]}
    internal = {"router": ["router-0.mesh.test:7003"]}
    env = local_env(services["decode"], services, addresses, internal)
    assert (env["PDMESH_HOST"], env["PDMESH_PORT"], env["PDMESH_METRICS_PORT"]) == ("127.0.0.1", "0", "0")
    assert env["PDMESH_KVTRANSFER_ADDRESS"] == "kvtransfer-0.mesh.test:7001"
    assert env["PDMESH_ROUTER_ADDRESS"] == "router-0.mesh.test:7003"  # the internal listener
    untouched = {k: v for k, v in services["decode"].env.items() if k not in env or env[k] == v}
    assert set(services["decode"].env) - set(untouched) == {
        "PDMESH_HOST",
        "PDMESH_PORT",
        "PDMESH_METRICS_PORT",
        "PDMESH_KVTRANSFER_ADDRESS",
        "PDMESH_ROUTER_ADDRESS",
    }


def test_interpolation_defaults_and_overrides():
    assert load_compose(COMPOSE)["decode"].env["PDMESH_ENGINE_PRESET"] == "tiny"
    assert load_compose(COMPOSE, {"PDMESH_PRESET": "small"})["decode"].env["PDMESH_ENGINE_PRESET"] == "small"


def test_the_launcher_refuses_a_cycle_and_an_undeclared_dependency(tmp_path):
    text = COMPOSE.read_text().replace(
        "  router:\n    <<: [*pdmesh, *hardened]\n",
        "  router:\n    <<: [*pdmesh, *hardened]\n    depends_on:\n      decode:\n        condition: service_healthy\n",
    )
    cyclic = tmp_path / "cyclic.yaml"
    cyclic.write_text(text)
    with pytest.raises(ComposeError, match="cycle"):
        load_compose(cyclic)
    services = load_compose(COMPOSE)
    decode = services["decode"]  # names router:50061 and kvtransfer:50051
    stripped = ComposeService(
        decode.name, decode.module, decode.args, decode.env, decode.ready, {}, decode.port
    )
    with pytest.raises(ComposeError, match="does not depend"):
        local_env(stripped, services, {})


def test_an_address_of_a_scaled_service_becomes_every_replica(services):
    """What a DNS name with one A record per replica gives a static worker list."""
    router = services["router"]
    listing = ComposeService(
        "router",
        router.module,
        router.args,
        {**router.env, "PDMESH_DECODE_WORKERS": "decode:50051"},
        router.ready,
        {"decode": "service_healthy"},
        router.port,
    )
    env = local_env(listing, services, {"decode": ["kvtransfer-0.mesh.test:7001", "router-0.mesh.test:7002"]})
    assert env["PDMESH_DECODE_WORKERS"] == "kvtransfer-0.mesh.test:7001,router-0.mesh.test:7002"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_config_accepts_and_resolves_the_file(raw):
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert set(resolved["services"]) == ROLES | {f"{r}-gpu" for r in ("router", "prefill", "decode")}
    assert resolved["services"]["decode"]["environment"]["PDMESH_ROUTER_ADDRESS"] == "router:50061"
