"""compose.yaml, run: exactly the commands and environments it declares, as local
processes on loopback (pdmesh/compose_launch.py), with `--scale decode=2`.

The workers find the router only through PDMESH_ROUTER_ADDRESS (runtime join),
a long prompt is prefilled remotely and its KV moves between "containers" with
the file's own transport settings, the router's HTTP port answers an OpenAI request, and
every metric the Grafana dashboard queries is exposed by some process.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request

import grpc
import openai
import pytest

from pdmesh.compose_launch import ComposeLaunch, load_compose
from pdmesh.launcher import Launcher
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.unit.deploy import repo

pytestmark = pytest.mark.e2e

DASHBOARD = repo.ROOT / "deploy" / "grafana" / "pdmesh.json"


def exposed_metric_names(text: str) -> set[str]:
    """Sample names a Prometheus text page exposes (families without samples included)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind in ("histogram", "summary"):
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def dashboard_metrics() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\bpdmesh_[a-z0-9_]+", e)}


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    services = load_compose(repo.ROOT / "compose.yaml")
    # Only the file configures the services: none of the caller's PDMESH_* variables leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
    launcher = Launcher(tmp_path_factory.mktemp("compose"), base_env=env)
    launch = ComposeLaunch(launcher, services, scale={"decode": 2})
    try:
        launch.up(timeout_s=120)
        yield launch
    finally:
        # Router first: workers drain their in-flight calls on SIGTERM, and the router's KV-event
        # subscriptions count as in flight until the router goes.
        for name in ("router",):
            for svc in launch.replicas.get(name, []):
                launcher.stop(svc)
        launcher.close()


def test_workers_join_the_router_at_run_time(compose):
    router = compose.replicas["router"][0]
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.internal_address))
    workers = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
    roles = sorted(common_pb2.WorkerRole.Name(w.info.role) for w in workers)
    assert roles == ["WORKER_ROLE_DECODE", "WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"]
    assert {w.source for w in workers} == {"registered"}
    assert {w.info.address for w in workers} == {
        r.address for name in ("decode", "prefill") for r in compose.replicas[name]
    }


def generate_long(compose, text: str) -> tuple[list[int], router_pb2.GenerateFinal]:
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(compose.address("router")))
    sampling = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    msgs = list(stub.Generate(router_pb2.GenerateRequest(text=text, sampling=sampling), timeout=60))
    return [t for m in msgs if m.HasField("delta") for t in m.delta.token_ids], msgs[-1].final


def test_a_long_prompt_is_prefilled_remotely_and_streams_back(compose):
    # Not cached anywhere yet, and the first of its decode worker with a prefill candidate: the
    # time rule (compose pins no token threshold) measures the remote path on that tie.
    tokens, final = generate_long(compose, "The mesh moves KV between containers. " * 20)
    assert len(tokens) == 8
    assert final.prefill_path == "remote"


def test_the_gateway_serves_openai_requests(compose):
    client = openai.OpenAI(
        base_url=f"http://{compose.http_address('router')}/v1", api_key="unused", max_retries=0
    )
    got = client.completions.create(
        model="builtin-tiny", prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 6 and got.choices[0].finish_reason == "length"


def test_every_dashboard_metric_is_exposed(compose):
    # Traffic first, so that every labelled family has been created.
    generate_long(compose, "Another long prompt, so that transfer metrics exist. " * 15)
    test_the_gateway_serves_openai_requests(compose)
    exposed: set[str] = set()
    for replicas in compose.replicas.values():
        for svc in replicas:
            assert svc.metrics_port, f"{svc.spec.name} serves no metrics"
            url = f"http://127.0.0.1:{svc.metrics_port}/metrics"
            exposed |= exposed_metric_names(urllib.request.urlopen(url, timeout=5).read().decode())
    queried = dashboard_metrics()
    assert len(queried) >= 10
    assert queried <= exposed, (
        f"the dashboard queries metrics no service exposes: {sorted(queried - exposed)}"
    )
