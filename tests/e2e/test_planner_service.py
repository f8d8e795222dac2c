"""`python -m services.planner.main` as a process: it reads a real router's internal listener
(in this test's process, fake decode workers behind it), becomes ready after its first read,
exports its decisions as Prometheus metrics, logs them as JSON, and drains on SIGTERM (exit 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.planner.main import SERVICE_NAME
from tests.service.router.conftest import mesh  # noqa: F401 (a real router over fake workers)
from tests.support.poll import eventually

pytestmark = pytest.mark.e2e


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


async def test_planner_process_decides_exports_and_drains(mesh, tmp_path):  # noqa: F811
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    port_file, log = tmp_path / "planner.port.json", tmp_path / "planner.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.planner.main",
            "--router-address", h.listeners.internal_address, "--actuator", "metrics-only",
            "--interval-s", "0.2", "--max-prefill", "0", "--min-prefill", "0", "--max-decode", "3",
            "--port", "0", "--metrics-port", "0", "--port-file", str(port_file),
            env=env, stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        ports = await eventually(
            lambda: port_file.exists() and json.loads(port_file.read_text()), timeout=60, what="port file"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def ready():
                r = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING

            await eventually(ready, timeout=30, what="planner ready")
        await h.generate("abcd", max_tokens=4)
        text = await eventually(
            lambda: next(
                (t for t in [_metrics(ports["metrics_port"])] if "pdmesh_planner_input{" in t), None
            ),
            timeout=30,
            what="a decision in the metrics",
        )
        assert 'pdmesh_planner_desired_replicas{role="decode"} 1.0' in text
        assert "pdmesh_planner_decisions_total{" in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    decisions = [x for x in lines if x.get("event") == "planner.decision"]
    assert decisions and {"reason", "decode", "forecast_rate", "observed_rate"} <= set(decisions[-1])


async def test_planner_process_scales_a_deployment_through_the_api_server(mesh, tmp_path):  # noqa: F811
    """The kubernetes actuator end to end: the process reads the router, decides that 3 decode
    replicas are 2 too many for no load, and PATCHes the decode Deployment's scale subresource on
    the API-server stand-in of tests/unit/planner/test_k8s_actuator.py (no API server runs here)."""
    from tests.unit.planner.test_k8s_actuator import TOKEN, FakeApiServer

    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
    with FakeApiServer({("mesh", "prefill"): 0, ("mesh", "decode"): 3}) as api:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.planner.main",
            "--router-address", h.listeners.internal_address, "--actuator", "kubernetes",
            "--k8s-api-host", api.url, "--k8s-api-token", TOKEN, "--k8s-namespace", "mesh",
            "--k8s-prefill-deployment", "prefill", "--k8s-decode-deployment", "decode",
            "--interval-s", "0.2", "--min-prefill", "0", "--max-prefill", "0", "--max-decode", "3",
            "--down-after", "1", "--down-cooldown-s", "0", "--port", "0",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            await eventually(
                lambda: api.replicas[("mesh", "decode")] == 1, timeout=60, what="decode scaled to 1"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    patches = [r for r in api.requests if r[0] == "PATCH"]
    assert patches and patches[0][1] == "/apis/apps/v1/namespaces/mesh/deployments/decode/scale"
    assert api.replicas[("mesh", "prefill")] == 0  # decode-only: prefill never touched
    assert proc.returncode == 0
