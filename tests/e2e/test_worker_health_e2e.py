"""A real decode worker process whose engine is slowed (issue 18 item 1): while one
engine step runs longer than `--stall-not-serving-s`, readiness is NOT_SERVING with the
reason `no_progress` on grpc.health.v1, on HTTP `/readyz` and in Stats, while liveness
and every probe keep answering at once; when the request's tokens come, it is ready
again, and the pool is whole.

The engine is the `sim` backend slowed down (`--engine-sim-speedup` below 1: its step
thread sleeps the modeled GPU time / speedup), so one prefill step of the request
takes ~4 s of wall time and the stall rule (1 s) must fire during it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import decode_pb2_grpc, worker_pb2
from services.common.http_probe import http_ready
from tests.e2e.helpers import generate
from tests.support.poll import wait_until

pytestmark = pytest.mark.e2e

SERVICE = "pdmesh.v1.DecodeService"
PROBE_TIMEOUT_S = 1.0
# dynamo-mocker prices a 16-token prefill at ~17 ms and a decode step at ~6 ms:
# at speedup 0.004 they take ~4.2 s and ~1.4 s, each longer than the 1 s stall time.
SLOW = flags(
    engine_backend="sim",
    engine_sim_speedup=0.004,
    engine_num_blocks=64,
    stall_not_serving_s=1,
    metrics_port=0,
)


def test_a_slowed_worker_process_goes_not_serving_while_stalled_and_back(tmp_path):
    with Launcher(tmp_path) as launcher:
        svc = launcher.start_ready(
            ServiceSpec(
                "decode-0", "services.decode.main", flags(worker_id="decode-0") + SLOW, ready_service=SERVICE
            )
        )
        channel = grpc.insecure_channel(svc.address)
        health = health_pb2_grpc.HealthStub(channel)
        decode = decode_pb2_grpc.DecodeServiceStub(channel)
        base = f"http://127.0.0.1:{svc.metrics_port}"

        def ready() -> int:
            req = health_pb2.HealthCheckRequest(service=SERVICE)
            return health.Check(req, timeout=PROBE_TIMEOUT_S).status

        def stats() -> worker_pb2.StatsResponse:
            return decode.Stats(worker_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)

        assert ready() == health_pb2.HealthCheckResponse.SERVING
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(
                generate, decode, list(range(1, 17)), request_id="slow", max_tokens=2, timeout=120
            )
            wait_until(
                lambda: ready() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=60, what="NOT_SERVING"
            )
            s = stats()
            assert s.load.not_serving_reason == "no_progress" and s.load.running + s.load.waiting >= 1
            ok, text = http_ready(base + "/readyz", PROBE_TIMEOUT_S)
            assert not ok and text.startswith("503") and "no_progress" in text
            assert http_ready(base + "/livez", PROBE_TIMEOUT_S) == (True, "200")
            check_live = health_pb2.HealthCheckRequest(service="")
            assert (
                health.Check(check_live, timeout=PROBE_TIMEOUT_S).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            tokens, final = call.result(timeout=120)
        assert len(tokens) == 2 and final.usage.completion_tokens == 2
        wait_until(
            lambda: ready() == health_pb2.HealthCheckResponse.SERVING, timeout=30, what="SERVING again"
        )
        assert http_ready(base + "/readyz", PROBE_TIMEOUT_S) == (True, "200")
        s = stats()
        assert s.load.not_serving_reason == "" and s.load.no_progress_ms == 0
        assert (s.load.running, s.load.waiting) == (0, 0)
        assert s.info.free_blocks == s.info.kv_capacity_blocks == 64
        channel.close()
