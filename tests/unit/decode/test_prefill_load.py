"""PrefillLoadProbe against real gRPC servers on port 0 (a minimal PrefillService
that only answers Stats with a chosen load) and a closed port."""

import socket

import grpc
import pytest

from pdmesh.v1 import common_pb2, prefill_pb2_grpc, worker_pb2
from services.common.channels import ChannelCache
from services.decode.disagg_policy import Candidate
from services.decode.prefill_load import PrefillLoadProbe


class StatsOnly(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, wait_ms):
        self.wait_ms = wait_ms
        self.calls = 0

    async def Stats(self, request, context):
        self.calls += 1
        return worker_pb2.StatsResponse(load=common_pb2.WorkerLoad(estimated_wait_ms=self.wait_ms))


@pytest.fixture
async def busy_worker():
    server = grpc.aio.server()
    servicer = StatsOnly(2500.0)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(0)


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


async def test_fresh_wait_replaces_the_routers_estimate_and_is_cached(busy_worker):
    address, servicer = busy_worker
    channels = ChannelCache()
    probe = PrefillLoadProbe(channels, max_age_s=60.0, timeout_s=2.0)
    stale = [Candidate("p", address, estimated_wait_s=0.0)]
    fresh = await probe.refresh(stale)
    assert fresh[0].estimated_wait_s == pytest.approx(2.5) and fresh[0].healthy
    await probe.refresh(stale)
    assert servicer.calls == 1  # answered from the cache within max_age_s
    await channels.close()


async def test_unreachable_candidate_is_unhealthy_and_only_the_top_are_probed(busy_worker):
    address, servicer = busy_worker
    channels = ChannelCache()
    probe = PrefillLoadProbe(channels, max_age_s=0.0, timeout_s=2.0, probe_top=1)
    dead = Candidate("dead", closed_port(), estimated_wait_s=0.1)
    alive = Candidate("alive", address, estimated_wait_s=0.2)
    out = await probe.refresh([dead, alive])
    assert out[0].healthy is False
    assert out[1] == alive and servicer.calls == 0  # beyond probe_top: left as the router said
    await channels.close()


def test_own_dispatches_raise_a_stale_estimate_until_they_come_back():
    from services.decode.prefill_load import OwnDispatches

    own = OwnDispatches()
    stale = [Candidate("p0", "a:0", estimated_wait_s=0.0), Candidate("p1", "a:1", estimated_wait_s=5.0)]
    assert own.apply(stale, tokens_per_s=1000) == stale
    own.begin("a:0", 2000)
    own.begin("a:1", 1000)
    got = own.apply(stale, tokens_per_s=1000)
    assert [c.estimated_wait_s for c in got] == [2.0, 5.0]  # a fresher, higher estimate stays
    own.end("a:0", 2000)
    own.end("a:1", 1000)
    assert own.apply(stale, tokens_per_s=1000) == stale and own.tokens == {}
