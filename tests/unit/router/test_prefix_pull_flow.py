"""The router's prefix-pull hook through RequestFlow (fake decode calls, fake clock): with the
planner on, a request routed away from the loaded holder of its prefix carries a
PrefixPullHint naming the holder; off (the default), no request ever does."""

from __future__ import annotations

from services.router.policy import WorkerLoad
from services.router.prefix_pull import PrefixPullConfig, PrefixPullPlanner
from tests.unit.router.test_routing_burst import BS, WORKERS, Mesh


class RecordingMesh(Mesh):
    def __init__(self, planner: bool):
        super().__init__(load_view=True, ttl_s=0)
        self.requests = []
        if planner:
            self.ctx.pull_planner = PrefixPullPlanner(PrefixPullConfig(enabled=True), BS)

    def _call(self, worker, request, timeout):
        self.requests.append((worker, request))
        return super()._call(worker, request, timeout)

    def report(self, w0_tokens_waiting: int, w0_wait_ms: float):
        for w in WORKERS:
            self.registry.update_load(w, WorkerLoad())
        self.registry.update_load(
            "w0", WorkerLoad(tokens_waiting=w0_tokens_waiting, estimated_wait_ms=w0_wait_ms)
        )


async def test_routed_away_from_a_busy_holder_the_request_pulls_its_prefix():
    mesh = RecordingMesh(planner=True)
    mesh.report(100 * BS, 1000.0)  # w0 holds the 8 shared blocks behind a 1 s queue
    worker = await mesh.route(0)
    assert worker != "w0"
    ((_, req),) = mesh.requests
    assert req.HasField("prefix_pull")
    assert (req.prefix_pull.worker_id, req.prefix_pull.address, req.prefix_pull.blocks) == ("w0", "w0:1", 8)
    # The load view counts only the blocks the target still computes (4 of 12).
    assert mesh.view.own(worker)[0] == 4 * BS
    await mesh.cancel_all()


async def test_a_holder_the_policy_still_picks_is_left_for_a_clear_gain():
    mesh = RecordingMesh(planner=True)
    # 7 queued blocks keep w0 the policy's choice (4 + 7 < 12), but it is slow: 0.5 s wait.
    mesh.report(7 * BS, 500.0)
    worker = await mesh.route(0)
    assert worker != "w0"
    assert mesh.requests[0][1].prefix_pull.worker_id == "w0"
    await mesh.cancel_all()


async def test_an_idle_holder_keeps_the_request_and_no_hint_is_sent():
    mesh = RecordingMesh(planner=True)
    mesh.report(0, 0.0)
    assert await mesh.route(0) == "w0"
    assert not mesh.requests[0][1].HasField("prefix_pull")
    await mesh.cancel_all()


async def test_off_by_default_no_request_carries_a_hint():
    mesh = RecordingMesh(planner=False)
    mesh.report(100 * BS, 1000.0)
    assert await mesh.route(0) != "w0"
    assert not mesh.requests[0][1].HasField("prefix_pull")
    await mesh.cancel_all()
