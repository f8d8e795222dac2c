"""The router reads a worker's own not-serving reason (issue 18 item 1): from the
Stats it polls (static workers) and from heartbeats (runtime members), and shows it
in ListWorkers. What it does with it is the outlier work's; here only that it sees
it. Real router on port 0, fake decode workers (tests/service/router/fakes.py)."""

from __future__ import annotations

from pdmesh.v1 import common_pb2, router_pb2


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
