"""The worker registry over gRPC: static workers (flags, DNS), runtime join with
leases and heartbeats, leaving, health, and join checks (model, block size)."""

import asyncio

import grpc
import pytest

from pdmesh.v1 import common_pb2, router_pb2
from tests.unit.router.fakes import FakeClock


def _register(worker, lease_ms=3000, **changes):
    info = worker.info()
    for k, v in changes.items():
        setattr(info, k, v)
    return router_pb2.RegisterWorkerRequest(worker=info, lease_ms=lease_ms)


async def _listed(h):
    resp = await h.internal.ListWorkers(router_pb2.ListWorkersRequest())
    return {w.info.worker_id: w for w in resp.workers}


async def test_a_worker_joining_at_run_time_receives_traffic(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False)
    r = h.router
    assert not r.ready()
    resp = await h.internal.RegisterWorker(_register(d1, lease_ms=3000))
    assert resp.lease_ms == 3000 and resp.heartbeat_interval_ms == 1000
    await r.wait_until(lambda: d1.kv.subscriptions == 1 and r.sequencer.last_seq("d1") == 0)
    assert r.ready()
    _, final, _ = await h.generate("joined", max_tokens=2)
    assert final.worker_id == "d1" and len(d1.calls) == 1
    w = (await _listed(h))["d1"]
    assert w.source == "registered" and w.info.address == d1.address
    assert w.health == router_pb2.WORKER_HEALTH_SERVING


async def test_heartbeats_carry_load_and_renew_the_lease(mesh):
    clock = FakeClock()
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False, clock=clock, stats_interval_s=3600)
    r = h.router
    joined = await h.internal.RegisterWorker(_register(d1, lease_ms=2000))
    beat = router_pb2.RouterServiceHeartbeatRequest(
        worker_id="d1", load=common_pb2.WorkerLoad(waiting=7), incarnation=joined.incarnation
    )
    clock.advance(1.5)
    assert (await h.internal.Heartbeat(beat)).known
    assert (await _listed(h))["d1"].load.waiting == 7
    clock.advance(1.5)  # 3 s after joining, 1.5 s after the heartbeat
    assert await r.expire_leases() == []
    clock.advance(1.0)  # 2.5 s after the heartbeat: the lease ran out
    assert await r.expire_leases() == ["d1"]
    assert await _listed(h) == {}
    assert not (await h.internal.Heartbeat(beat)).known  # must register again
    assert r.index.blocks("d1") == 0 and r.sequencer.last_seq("d1") is None
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("anyone?")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert d1.calls == []


async def test_a_worker_that_leaves_gets_no_more_traffic(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    h = await mesh.router([d2], policy="round_robin")
    r = h.router
    joined = await h.internal.RegisterWorker(_register(d1))
    await r.wait_until(lambda: r.sequencer.last_seq("d1") == 0)
    dereg = router_pb2.DeregisterWorkerRequest(worker_id="d1", incarnation=joined.incarnation)
    assert (await h.internal.DeregisterWorker(dereg)).removed
    assert not (await h.internal.DeregisterWorker(dereg)).removed
    for _ in range(3):
        _, final, _ = await h.generate("x", max_tokens=2)
        assert final.worker_id == "d2"
    assert d1.calls == [] and set(await _listed(h)) == {"d2"}


async def test_an_unhealthy_worker_gets_no_traffic_until_it_recovers(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    h = await mesh.router([d1, d2], policy="round_robin")
    r = h.router
    await d1.mesh.set_ready(False)
    await r.wait_until(lambda: not r.registry.get("d1").healthy)
    assert (await _listed(h))["d1"].health == router_pb2.WORKER_HEALTH_NOT_SERVING
    for _ in range(3):
        await h.generate("x", max_tokens=2)
    assert d1.calls == []
    await d1.mesh.set_ready(True)
    await r.wait_until(lambda: r.registry.get("d1").healthy)
    for _ in range(2):
        await h.generate("x", max_tokens=2)
    assert len(d1.calls) == 1


@pytest.mark.parametrize(
    ("changes", "needle"),
    [({"block_size": 32}, "block_size 32"), ({"model_id": "other-model"}, "model_id 'other-model'")],
)
async def test_a_mismatched_worker_is_refused_at_join(mesh, changes, needle):
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.internal.RegisterWorker(_register(d1, **changes))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert needle in e.value.details()
    assert await _listed(h) == {}


@pytest.mark.parametrize(
    "changes", [{"role": common_pb2.WORKER_ROLE_UNSPECIFIED}, {"role": 9}, {"worker_id": ""}, {"address": ""}]
)
async def test_malformed_registrations_are_invalid(mesh, changes):
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.internal.RegisterWorker(_register(d1, **changes))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_static_worker_with_another_block_size_is_refused(mesh):
    good, bad = await mesh.decode("good"), await mesh.decode("bad", block_size=32)
    h = await mesh.router([good, bad], wait=False)
    r = h.router
    conn = next(c for c in r.pool.connections() if c.address == bad.address)
    await r.wait_until(lambda: conn.refused is not None and r.sequencer.last_seq("good") == 0)
    assert "block_size 32" in conn.refused
    assert set(await _listed(h)) == {"good"}
    for _ in range(3):
        await h.generate("x", max_tokens=2)
    assert bad.calls == [] and len(good.calls) == 3


async def test_a_dns_name_with_several_addresses_is_several_workers(mesh):
    d1 = await mesh.decode("d1")
    port = d1.mesh.port
    try:
        d2 = await mesh.decode("d2", host="127.0.0.2", port=port)
    except OSError:
        pytest.skip("cannot bind 127.0.0.2 on this machine")
    names = {}

    def resolver(host):
        names[host] = names.get(host, 0) + 1
        return ["127.0.0.1", "127.0.0.2"]

    h = await mesh.router([], static=[f"decode.test:{port}"], resolver=resolver, wait=False)
    r = h.router
    await r.wait_until(lambda: len(r.registry) == 2 and r.sequencer.last_seq("d2") == 0)
    listed = await _listed(h)
    assert {w.info.address for w in listed.values()} == {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
    assert names == {"decode.test": 1}
    await h.generate("x", max_tokens=2)
    assert len(d1.calls) + len(d2.calls) == 1


async def test_a_worker_that_moves_address_is_followed(mesh):
    old, new = await mesh.decode("d1"), await mesh.decode("d1")  # one worker id, restarted elsewhere
    h = await mesh.router([], wait=False)
    r = h.router
    joined = await h.internal.RegisterWorker(_register(old))
    await r.wait_until(lambda: r.sequencer.last_seq("d1") == 0)
    moved = _register(new)
    moved.incarnation = joined.incarnation  # the same worker: it holds its registration's secret
    await h.internal.RegisterWorker(moved)
    await r.wait_until(lambda: r.sequencer.last_seq("d1") == 0 and new.kv.subscriptions == 1)
    assert [c.address for c in r.pool.connections()] == [new.address]
    await old.stop()
    _, final, _ = await h.generate("x", max_tokens=2)
    assert final.worker_id == "d1" and len(new.calls) == 1 and old.calls == []


async def test_a_worker_leaves_even_when_a_health_probe_was_just_asked_for(mesh):
    # Found by the RPC fuzzers: DeregisterWorker hung until the caller's deadline. On
    # Python 3.11, asyncio.wait_for returns (instead of raising) when it is cancelled in
    # the same step as its awaitable completes; the connection's health loop then lost
    # stop()'s cancel whenever its KV loop had just asked for a probe.
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False, health_interval_s=3600)
    r = h.router
    await h.internal.RegisterWorker(_register(d1))
    conn = r.pool.connection("d1")
    await r.wait_until(lambda: bool(conn._probe_now._waiters))  # the health loop waits for a probe request
    conn._probe_now.set()  # ... which arrives in the same step as the cancel
    leaving = asyncio.create_task(r.pool.detach("d1"))
    # No cancel may rescue it (a cancel from outside would wake the lost one up again).
    await r.wait_until(leaving.done, timeout=5)
    assert conn._main is not None and conn._main.done()
    assert "d1" not in r.registry


class _Unanswered:
    """A health stub that lets `fail` probes go unanswered (DEADLINE_EXCEEDED, as a probe
    starved of CPU would), then answers through the real one; it records the worker's
    health as the router saw it at each probe."""

    def __init__(self, real, registry, worker_id, fail):
        self.real, self.registry, self.worker_id, self.fail = real, registry, worker_id, fail
        self.seen: list[bool] = []

    async def Check(self, request, timeout=None):
        self.seen.append(self.registry.get(self.worker_id).healthy)
        if self.fail > 0:
            self.fail -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "probe timed out"
            )
        return await self.real.Check(request, timeout=timeout)


async def _unanswered_mesh(mesh, threshold: int, fail: int):
    """Two workers round robin; d1's next `fail` probes go unanswered."""
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    h = await mesh.router([d1, d2], policy="round_robin", health_failure_threshold=threshold)
    conn = h.router.pool.connection("d1")
    stub = conn._health = _Unanswered(conn._health, h.router.registry, "d1", fail=fail)
    return h, d1, stub


async def test_one_unanswered_probe_keeps_a_busy_worker_serving(mesh):
    # A probe that times out on a busy worker is not a dead worker: with the threshold
    # at 2, one late answer changes nothing and the next probe follows at once.
    h, d1, stub = await _unanswered_mesh(mesh, threshold=2, fail=1)
    r = h.router
    await r.wait_until(lambda: len(stub.seen) >= 3)
    assert stub.fail == 0 and all(stub.seen), stub.seen
    for _ in range(2):
        await h.generate("x", max_tokens=2)
    assert len(d1.calls) == 1


async def test_unanswered_probes_in_a_row_mark_a_worker_not_serving(mesh):
    h, d1, stub = await _unanswered_mesh(mesh, threshold=3, fail=3)
    r = h.router
    await r.wait_until(lambda: not r.registry.get("d1").healthy)
    assert stub.seen[:3] == [True, True, True]  # marked by the third, not before
    for _ in range(2):
        await h.generate("x", max_tokens=2)
    assert d1.calls == []
    await r.wait_until(lambda: r.registry.get("d1").healthy)  # an answer brings it back
    assert stub.fail == 0


async def test_a_registration_describes_the_hardware_and_the_router_keeps_it(mesh):
    """Heterogeneous fleets (issue 21 item 3): generation, headroom, warm models, load time."""
    d1 = await mesh.decode("d1")
    h = await mesh.router([], wait=False)
    req = _register(d1)
    req.worker.accelerator = common_pb2.ACCELERATOR_KIND_CUDA
    req.worker.accelerator_generation = "h200"
    req.worker.memory_headroom_bytes = 7 << 30
    req.worker.warm_models[:] = [d1.info().model_id]
    req.worker.model_load_s = 42.5
    await h.internal.RegisterWorker(req)
    w = (await _listed(h))["d1"]
    assert (w.info.accelerator_generation, w.info.memory_headroom_bytes) == ("h200", 7 << 30)
    assert list(w.info.warm_models) == [d1.info().model_id] and w.info.model_load_s == 42.5
    assert w.prefill_speed_factor == w.decode_speed_factor == 1.0  # nothing measured yet
    p = h.router.profiles.get("d1")
    assert p.accelerator == "cuda/h200" and p.model_load_s == 42.5 and p.memory_headroom_bytes == 7 << 30
