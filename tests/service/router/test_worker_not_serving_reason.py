"""The router reads a worker's own not-serving reason (issue 18 item 1): from the
Stats it polls (static workers) and from heartbeats (runtime members), and shows it
in ListWorkers. What it does with it is the outlier work's; here only that it sees
it. Real router on port 0, fake decode workers (tests/service/router/fakes.py), and
one real decode worker with a held engine."""

from __future__ import annotations

import grpc

from pdmesh.v1 import common_pb2, router_pb2
from tests.service.decode.real_worker import Worker
from tests.service.router.conftest import request
from tests.support.poll import eventually


async def _listed(h, worker_id: str) -> router_pb2.WorkerStatus | None:
    listed = await h.internal.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return next((w for w in listed.workers if w.info.worker_id == worker_id), None)


async def test_a_static_workers_reason_reaches_list_workers_from_its_stats(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    d1.load.not_serving_reason = "no_progress"
    d1.load.no_progress_ms = 7_500
    await h.router.wait_until(lambda: h.router.registry.get("d1").load.not_serving_reason == "no_progress")
    status = await _listed(h, "d1")
    assert status is not None
    assert (status.load.not_serving_reason, status.load.no_progress_ms) == ("no_progress", 7_500)
    d1.load.not_serving_reason, d1.load.no_progress_ms = "", 0  # tokens flow again
    await h.router.wait_until(lambda: h.router.registry.get("d1").load.not_serving_reason == "")


async def test_a_members_reason_reaches_list_workers_from_its_heartbeat(mesh):
    d0 = await mesh.decode("d0")
    h = await mesh.router([], wait=False)
    joined = await h.internal.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=d0.info()), timeout=10)
    load = common_pb2.WorkerLoad(running=2, not_serving_reason="no_progress", no_progress_ms=6_000)
    beat = router_pb2.RouterServiceHeartbeatRequest(worker_id="d0", load=load, incarnation=joined.incarnation)
    assert (await h.internal.Heartbeat(beat, timeout=10)).known
    status = await _listed(h, "d0")
    assert status is not None and status.load.not_serving_reason == "no_progress"
    assert status.load.no_progress_ms == 6_000 and status.load.running == 2


async def test_a_real_worker_held_mid_stream_leaves_routing_with_its_reason_and_comes_back(mesh):
    """A real decode worker (tests/service/decode/real_worker.py) whose engine thread is
    held mid-stream: the router's health probe sees NOT_SERVING (the worker's own
    verdict, not a probe timeout), stops counting it eligible, ListWorkers says why;
    released, the stream completes through the router and the worker is routable again."""
    w = Worker(stall_s=0.3)
    await w.start()
    try:
        h = await mesh.router([], static=[w.server.address], wait=False)
        r = h.router
        await r.wait_until(lambda: h.healthy_decode() == 1)
        call = h.stub.Generate(request(list(range(1, 21)), max_tokens=24), timeout=60)
        first = await call.read()
        assert first.delta.token_ids
        w.hold.hold()
        await eventually(w.hold.entered.is_set, what="the engine thread blocked in a step")
        await r.wait_until(lambda: h.healthy_decode() == 0)
        status = await _listed(h, "decode-0")
        assert status is not None and status.health == router_pb2.WORKER_HEALTH_NOT_SERVING
        await r.wait_until(lambda: r.registry.get("decode-0").load.not_serving_reason == "no_progress")
        w.hold.release()
        got = len(first.delta.token_ids)
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.HasField("delta"):
                got += len(msg.delta.token_ids)
        assert got == 24
        await r.wait_until(lambda: h.healthy_decode() == 1)
        _, final, _ = await h.generate(list(range(1, 21)), max_tokens=4)
        assert final.worker_id == "decode-0"
        await w.assert_pool_back()
    finally:
        await w.close()
