"""A decode worker whose engine thread is held: its probes still answer at once, and
readiness goes NOT_SERVING only by the forward-progress rule (issue 18 item 1).

A real DecodeServicer on a MeshServer (gRPC on loopback port 0, the metrics/probe
HTTP port on port 0) over a real tiny TorchEngine, with the worker's HealthWatch.
The one stand-in is `StepHold` (tests/service/decode/hold.py): it wraps the engine
core's `step()` so the test can hold the engine's step thread (as a deadlocked or
wedged accelerator would) and let it go again; everything around it runs as in a
worker process.
"""

from __future__ import annotations

import time

import pytest
from grpc_health.v1 import health_pb2

from services.router.convert import load_from_proto
from tests.service.decode.real_worker import PROBE_TIMEOUT_S, Worker, hold_mid_stream, rest_of
from tests.support.poll import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def worker(request):
    w = Worker(stall_s=request.param)
    await w.start()
    try:
        yield w
    finally:
        await w.close()


@pytest.mark.parametrize("worker", [0.3], indirect=True)
async def test_a_held_engine_goes_not_serving_by_forward_progress_and_recovers(worker):
    w = worker
    assert await w.check() == SERVING
    call, got = await hold_mid_stream(w)
    held_at = time.monotonic()

    # Readiness flips, as an answer to the probe (the probe never times out) ...
    await eventually(lambda: _status_is(w, NOT_SERVING), what="readiness NOT_SERVING")
    assert await w.check("") == SERVING  # liveness stays OK
    stats = await w.stats()
    assert stats.load.not_serving_reason == "no_progress"
    assert stats.load.no_progress_ms >= 300 and stats.load.running == 1
    # ... the router's reading of the load report carries the reason (ListWorkers, heartbeats) ...
    assert load_from_proto(stats.load).not_serving_reason == "no_progress"
    # ... and the HTTP probes say the same: /livez 200, /readyz 503 with the reason.
    assert await w.http("/livez") == (True, "200")
    ok, text = await w.http("/readyz")
    assert not ok and text.startswith("503") and "no_progress" in text

    # Held longer than the probe timeout: every probe still answers (and says why).
    while time.monotonic() - held_at < 2 * PROBE_TIMEOUT_S:
        assert await w.check() == NOT_SERVING
        assert (await w.stats()).load.not_serving_reason == "no_progress"

    # Tokens flow again: SERVING, the reason cleared, the request completes whole.
    w.hold.release()
    got += await rest_of(call)
    assert got == 24
    await eventually(lambda: _status_is(w, SERVING), what="readiness SERVING again")
    assert (await w.stats()).load.not_serving_reason == ""
    assert await w.http("/readyz") == (True, "200")
    await w.assert_pool_back()


@pytest.mark.parametrize("worker", [3600.0], indirect=True)
async def test_a_held_engine_within_its_stall_time_stays_serving_and_probes_answer(worker):
    """Held for longer than the probe timeout but under --stall-not-serving-s: a busy
    worker is never reported down just because its engine is busy."""
    w = worker
    call, got = await hold_mid_stream(w)
    held_at = time.monotonic()
    while time.monotonic() - held_at < 2 * PROBE_TIMEOUT_S:
        assert await w.check() == SERVING
        stats = await w.stats()
        assert stats.load.not_serving_reason == "" and stats.load.running == 1
        assert await w.http("/readyz") == (True, "200")
    assert (await w.stats()).load.no_progress_ms >= 1000 * PROBE_TIMEOUT_S
    w.hold.release()
    got += await rest_of(call)
    assert got == 24
    await w.assert_pool_back()


async def _status_is(w: Worker, status: int) -> bool:
    return await w.check() == status
