"""Router counters and cost per successful request, in Stats and in Prometheus."""

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.v1 import router_pb2
from tests.service.router.conftest import request


def _samples(registry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


async def test_stats_and_metrics_report_cost_per_successful_request(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    h = await mesh.router([d1, d2], policy="round_robin")
    r = h.router
    # Two clean successes (prompt 4 + 6 tokens each), then a migration after 3 tokens.
    await h.generate("abcd", max_tokens=6)
    await h.generate("abcd", max_tokens=6)
    d1.pause_after = 3
    call = h.stub.Generate(request("abcd", max_tokens=6), timeout=30)
    got = 0
    while got < 3:
        got += len((await call.read()).delta.token_ids)
    d1.die_after = 3
    d1.resume.set()
    while await call.read() is not grpc.aio.EOF:
        pass
    # And one failure: no worker is left after d1 died and d2 fails.
    d2.fail_with = grpc.StatusCode.UNAVAILABLE
    await r.wait_until(lambda: not r.registry.get("d1").healthy)
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("abcd", max_tokens=6)

    s = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert (s.requests_total, s.requests_succeeded, s.requests_failed, s.requests_cancelled) == (4, 3, 1, 0)
    assert s.migrations == 1 and s.inflight == 0 and s.queued == 0
    successful = 10 + 10 + (4 + 3) + (4 + 3 + 3)  # the migrated one recomputed prompt + 3 tokens
    wasted = (4 + 3) + 4  # d1's attempt before the migration, and the failed request's prefill
    assert s.tokens_per_successful_request == pytest.approx(successful / 3)
    assert s.wasted_tokens == wasted and s.computed_tokens == successful + 4

    m = _samples(r.metrics.registry)
    assert m["pdmesh_tokens_per_successful_request"] == pytest.approx(successful / 3)
    assert m["pdmesh_router_wasted_tokens_total"] == wasted
    assert m["pdmesh_router_requests_total{outcome=succeeded}"] == 3
    assert m["pdmesh_router_requests_total{outcome=failed}"] == 1
    assert m["pdmesh_router_migrations_total"] == 1
    assert m["pdmesh_router_ttft_seconds_count"] == 3  # requests that delivered a token
    names = {k.split("{")[0] for k in m}
    assert all(n.startswith("pdmesh_router_") for n in names - {"pdmesh_tokens_per_successful_request"})


async def test_shed_and_invalid_requests_are_counted(mesh):
    d1 = await mesh.decode("d1")
    d1.load.waiting = 500
    h = await mesh.router([d1], max_waiting_per_worker=10)
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("x")
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("")
    m = _samples(h.router.metrics.registry)
    assert m["pdmesh_router_shed_total{reason=saturated}"] == 1
    assert m["pdmesh_router_invalid_requests_total"] == 1
    s = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert s.requests_shed == 1 and s.requests_total == 1


async def test_stats_carry_what_the_planner_needs(mesh):
    """Token totals of finished requests and cumulative TTFT/ITL histograms (services/planner)."""
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    before = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert before.prompt_tokens == 0 and before.ttft.counts[-1] == 0
    await h.generate("abcd", max_tokens=6)
    await h.generate("abcdefgh", max_tokens=3)
    s = await h.internal.Stats(router_pb2.RouterServiceStatsRequest())
    assert (s.prompt_tokens, s.completion_tokens) == (4 + 8, 6 + 3)
    assert s.ttft.upper_bounds_s[-1] == float("inf") and s.ttft.counts[-1] == 2
    assert list(s.ttft.counts) == sorted(s.ttft.counts)  # cumulative
    assert 0 < s.itl.counts[-1] <= (6 - 1) + (3 - 1)  # tokens sent together share one gap
    assert s.ttft.sum_s > 0
