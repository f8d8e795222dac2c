"""HealthWatch (services/worker/health.py) on a fake clock: the verdict reaches the
server's readiness (grpc.health.v1 and the HTTP probe's answer) and the load report,
for any worker role. The engine is a stand-in that reports the stats a test sets
(the watch reads nothing else of it); the server is a real, unstarted MeshServer."""

from __future__ import annotations

import dataclasses

from grpc_health.v1 import health_pb2

from pdmesh.v1 import common_pb2
from services.common.server import MeshServer, ServerConfig
from services.engine.api import EngineStats
from services.worker.health import HealthWatch
from services.worker.serving import load_from_stats
from tests.unit.router.fakes import FakeClock

SERVICE = "pdmesh.v1.PrefillService"


class StatsOnly:
    """Answers `stats()` with what the test set."""

    def __init__(self) -> None:
        self.s = EngineStats(
            running=0,
            waiting=0,
            total_blocks=8,
            free_blocks=8,
            cached_blocks=0,
            held_blocks=0,
            tokens_waiting=0,
            active_decode_blocks=0,
            prompt_tokens_computed=0,
            decode_tokens_computed=0,
            prompt_tokens_cached=0,
            prompt_tokens_transferred=0,
            preemptions=0,
        )

    def stats(self) -> EngineStats:
        return self.s

    def set(self, **kw) -> None:
        self.s = dataclasses.replace(self.s, **kw)


async def status(server: MeshServer) -> int:
    resp = await server.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), None)
    return resp.status


async def test_the_verdict_drives_grpc_and_http_readiness_and_the_load_report():
    clock, engine = FakeClock(), StatsOnly()
    server = MeshServer(ServerConfig(), SERVICE)
    await server.set_ready(True)
    watch = HealthWatch(engine, server, stall_s=2.0, interval_s=0.5, clock=clock)
    engine.set(running=1, prompt_tokens_computed=40)  # a prefill in progress
    await watch.check()
    clock.advance(1.0)
    engine.set(prompt_tokens_computed=80)
    await watch.check()
    assert await status(server) == health_pb2.HealthCheckResponse.SERVING
    clock.advance(2.0)  # the engine computes nothing more
    v = await watch.check()
    assert not v.serving
    assert await status(server) == health_pb2.HealthCheckResponse.NOT_SERVING
    ok, reason = server.http_readiness()
    assert not ok and reason.startswith("no_progress")
    load = load_from_stats(engine.stats(), 0.0, watch)
    assert (load.not_serving_reason, load.no_progress_ms) == ("no_progress", 2000)

    engine.set(decode_tokens_computed=1)  # tokens flow again
    await watch.check()
    assert await status(server) == health_pb2.HealthCheckResponse.SERVING
    assert server.http_readiness() == (True, "serving")
    assert load_from_stats(engine.stats(), 0.0, watch).not_serving_reason == ""


async def test_the_http_probe_reports_a_blocked_event_loop():
    """The probe answers on the metrics thread; when the watch's task stops ticking
    (the loop itself is blocked) it must not keep saying ready from a stale verdict."""
    clock, engine = FakeClock(), StatsOnly()
    server = MeshServer(ServerConfig(), SERVICE)
    await server.set_ready(True)
    watch = HealthWatch(engine, server, stall_s=2.0, interval_s=0.5, clock=clock)
    watch.start()
    try:
        await watch.check()
        assert server.http_readiness() == (True, "serving")
        clock.advance(10.0)  # no check for 10 s (the task never ran: the fake clock moved)
        ok, reason = server.http_readiness()
        assert not ok and reason.startswith("event_loop_stalled")
    finally:
        await watch.stop()


async def test_draining_wins_over_the_verdict():
    clock, engine = FakeClock(), StatsOnly()
    server = MeshServer(ServerConfig(), SERVICE)
    await server.set_ready(True)
    watch = HealthWatch(engine, server, stall_s=2.0, clock=clock)
    server._gate.draining = True  # what drain() sets first
    await watch.check()
    assert server.http_readiness() == (False, "draining")


def test_a_load_report_without_a_watch_has_no_reason():
    load = load_from_stats(StatsOnly().stats(), 0.0)
    assert isinstance(load, common_pb2.WorkerLoad) and load.not_serving_reason == ""
