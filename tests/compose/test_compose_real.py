"""compose.yaml (and compose.yaml + compose.tls.yaml) run for real under Docker.

`make compose-test` (scripts/compose_test.sh) sets Docker up, makes the offline base image and
runs this with PDMESH_COMPOSE_TEST=1; anywhere else (plain `make test`) it is skipped. For each
variant: `docker compose up --build --scale decode=2 --wait` (host ports chosen by Docker, on
127.0.0.1), a Generate through the router's published gRPC port, a completion through the
router's published HTTP port (the router serves the OpenAI API itself), then the decode container serving a stream SIGKILLed
(`docker kill`) after its first tokens: the stream must still finish, migrated by the router to
the other decode worker, with the tokens an undisturbed stream gives; `docker compose down` in `finally`.

Each stack gets its own project name, so a user's running `docker compose` stack is untouched.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import ssl
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdmesh.certs import write_mesh_certs
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.config import build
from services.common.tls import TlsConfig, client_tls, sync_channel
from services.router.auth import append_entry, new_key

ROOT = Path(__file__).resolve().parents[2]
UID = 10001  # the image's user (docker/Dockerfile)

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("PDMESH_COMPOSE_TEST") != "1",
        reason="runs Docker: `make compose-test` (scripts/compose_test.sh) sets it up and runs this",
    ),
    pytest.mark.timeout(900),
]


@dataclass
class Client:
    """How the test reaches the stack from the host: addresses, TLS, API key."""

    router: str
    gateway: str
    tls_env: dict[str, str]
    api_key: str = ""

    def channel(self) -> grpc.Channel:
        tls = client_tls(build(TlsConfig, None, self.tls_env, "tls_")) if self.tls_env else None
        return sync_channel(self.router, tls)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


class Stack:
    """One `docker compose` project: up, ports, containers, logs, down."""

    def __init__(self, files: list[str], env: dict[str, str]):
        self.project = f"pdmesh-test-{uuid.uuid4().hex[:8]}"
        self.env = env
        self.argv = [*shlex.split(os.environ.get("PDMESH_COMPOSE", "docker compose")), "-p", self.project]
        for f in files:
            self.argv += ["-f", str(ROOT / f)]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        out = subprocess.run(
            [*self.argv, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} -> {out.returncode}\n{out.stderr[-4000:]}\n{self.logs()}"
            )
        return out.stdout

    def up(self) -> None:
        # --wait: every container's healthcheck passes (the file's own readiness), or it fails.
        self.run("up", "--build", "--scale", "decode=2", "--wait", "--wait-timeout", "300", timeout=900)

    def port(self, service: str, port: int) -> str:
        host, _, published = self.run("port", service, str(port)).strip().rpartition(":")
        assert host == "127.0.0.1", f"{service}:{port} published on {host}, not loopback"
        return f"127.0.0.1:{published}"

    def containers(self, service: str) -> list[str]:
        return self.run("ps", "-q", service).split()

    def logs(self) -> str:
        out = subprocess.run(
            [*self.argv, "logs", "--no-color", "--tail", "30"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return out.stdout[-8000:]

    def service_logs(self, service: str) -> str:
        return self.run("logs", "--no-color", service, timeout=60)

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False)


def compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
    # "" = Docker picks free host ports (no fixed ports); PDMESH_BIND_ADDRESS stays the default.
    env.update(PDMESH_ROUTER_PORT="", PDMESH_ROUTER_METRICS_PORT="", PDMESH_GATEWAY_PORT="", **extra)
    # The ~51M-parameter preset: slow enough per token (~0.1 s here) that a stream is still
    # running when its container is found and killed (the 90k-parameter "tiny" one is done first).
    env["PDMESH_PRESET"] = "small"
    return env


def make_certs(folder: Path) -> str:
    """`pdmesh certs` + one API key, owned by the image's user as compose.tls.yaml says."""
    write_mesh_certs(folder)
    key = new_key()
    append_entry(str(folder / "api-keys.jsonl"), "compose-test", key)
    for p in [folder, *folder.iterdir()]:
        os.chown(p, UID, UID)
    return key


@pytest.fixture(scope="module", params=["plain", "tls"])
def stack(request, tmp_path_factory):
    if request.param == "plain":
        files, env, key, tls_env, scheme = ["compose.yaml"], compose_env(), "", {}, "http"
    else:
        certs = tmp_path_factory.mktemp("certs")
        key = make_certs(certs)
        files, env, scheme = (
            ["compose.yaml", "compose.tls.yaml"],
            compose_env(PDMESH_CERTS_DIR=str(certs)),
            "https",
        )
        tls_env = {
            "PDMESH_TLS_CA_FILE": str(certs / "ca.pem"),
            "PDMESH_TLS_CERT_FILE": str(certs / "client.pem"),
            "PDMESH_TLS_KEY_FILE": str(certs / "client-key.pem"),
            "PDMESH_TLS_SERVER_NAME": "localhost",  # the published port is 127.0.0.1; certs name localhost
        }
    s = Stack(files, env)
    try:
        s.up()
        # The router's certificate names localhost; plain HTTP goes straight to the loopback address.
        host = "localhost" if tls_env else "127.0.0.1"
        gateway = f"{scheme}://{host}:{s.port('router', 8000).rpartition(':')[2]}"
        client = Client(s.port("router", 50051), gateway, tls_env, key)
        yield s, client
    finally:
        s.down()
        leftover = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert not leftover, f"`compose down` left containers: {leftover}"


def generate(client: Client, max_tokens: int, text: str = "The capital of France is"):
    stub = router_pb2_grpc.RouterServiceStub(client.channel())
    req = router_pb2.GenerateRequest(
        text=text,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    return stub.Generate(req, metadata=client.metadata, timeout=300)


def collect(stream) -> tuple[list[int], router_pb2.GenerateFinal]:
    tokens: list[int] = []
    for chunk in stream:
        if chunk.HasField("delta"):
            tokens += chunk.delta.token_ids
        else:
            return tokens, chunk.final
    raise AssertionError("stream ended without a final message")


def test_generate_through_the_router(stack):
    _, client = stack
    tokens, final = collect(generate(client, 8))
    assert len(tokens) == 8 and final.usage.completion_tokens == 8
    assert final.worker_id.startswith("decode-")


def test_the_router_reaches_the_decode_workers_over_their_raw_link(stack):
    # Requests would still succeed over gRPC if the raw link failed (the fallback), so the
    # router's own log says which transport it got, TLS included in the TLS stack.
    s, client = stack
    collect(generate(client, 2))
    logs = s.service_logs("router")
    assert '"link_connected"' in logs or "link_connected" in logs, logs[-3000:]
    assert "link_connect_failed" not in logs, logs[-3000:]
    if client.tls_env:
        assert "tls=True" in logs or '"tls": true' in logs, logs[-3000:]


def test_completion_through_the_gateway(stack):
    _, client = stack
    body = {"model": "", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    models = _http(client, "GET", "/v1/models")
    body["model"] = models["data"][0]["id"]
    reply = _http(client, "POST", "/v1/completions", body)
    assert reply["object"] == "text_completion"
    assert reply["usage"]["completion_tokens"] == 5


def _http(client: Client, method: str, path: str, body: dict | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if client.api_key:
        headers["Authorization"] = f"Bearer {client.api_key}"
    req = urllib.request.Request(
        client.gateway + path,
        method=method,
        headers=headers,
        data=json.dumps(body).encode() if body else None,
    )
    ctx = ssl.create_default_context(cafile=client.tls_env["PDMESH_TLS_CA_FILE"]) if client.tls_env else None
    with urllib.request.urlopen(req, timeout=120, context=ctx) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def running_requests(container: str) -> float:
    """pdmesh_engine_running of a decode container, read from its metrics port inside it (its
    PDMESH_METRICS_PORT, not published; this does not depend on which router port serves
    ListWorkers)."""
    code = (
        "import os, urllib.request;"
        "u='http://localhost:%s/metrics' % os.environ['PDMESH_METRICS_PORT'];"
        "t=urllib.request.urlopen(u,timeout=5).read().decode();"
        "print(sum(float(l.split()[-1]) for l in t.splitlines() if l.startswith('pdmesh_engine_running')))"
    )
    out = subprocess.run(
        ["docker", "exec", container, "python", "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return float(out.stdout.strip() or 0)


def test_a_decode_container_killed_mid_stream_the_stream_finishes_elsewhere(stack):
    s, client = stack
    n = 200
    reference, _ = collect(generate(client, n))  # the same greedy request, undisturbed
    stream = generate(client, n)
    first = next(stream)
    assert first.HasField("delta")
    # The decode container running it: the one whose engine has a running request.
    victim, deadline = None, time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        busy = [c for c in s.containers("decode") if running_requests(c) > 0]
        victim = busy[0] if len(busy) == 1 else None
    assert victim, "no decode container reported the running stream"
    subprocess.run(
        ["docker", "kill", "--signal", "KILL", victim], check=True, capture_output=True, timeout=60
    )
    rest, final = collect(stream)
    tokens = [*first.delta.token_ids, *rest]
    assert final.migrations >= 1, f"the stream did not move off the killed worker ({final})"
    assert victim[:12] not in final.worker_id
    assert len(tokens) == n and tokens == reference, "the migrated stream is not the undisturbed one"
    # And the mesh still serves (the survivor, or the killed container restarted by its policy).
    more, _ = collect(generate(client, 4))
    assert len(more) == 4


def test_docker_is_what_ran(stack):
    """Not the loopback twin (tests/e2e/test_compose_launch.py): real containers, one image."""
    s, _ = stack
    images = {
        subprocess.run(
            ["docker", "inspect", "--format", "{{.Config.Image}}", c],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for service in ("kvtransfer", "router", "prefill")
        for c in s.containers(service)
    }
    assert images == {"pdmesh:0.1.0"}
    assert shutil.which("docker")
