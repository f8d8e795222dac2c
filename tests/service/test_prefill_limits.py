"""What a caller can pin on a prefill worker (issue 13, item 3), over real gRPC on port 0.

Before the fix `lease_ms` was not capped (2^32-1 ms is 49.7 days), an empty
`requester_agent` exempted a lease from dead-requester cleanup, and 73 Prefill
calls pinned 8,187 of 8,192 blocks. Now: the lease is clamped to max_lease_ms
(the handle says when it ends), a requester agent is required, one requester
holds at most its share of the pool, and new calls are shed with
RESOURCE_EXHAUSTED and a retry hint while leases hold the pool.
"""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import generate_latest

from kvtransfer.leases import LeaseManager
from pdmesh.v1 import prefill_pb2, prefill_pb2_grpc
from services.common.server import ServerConfig
from services.common.validation import RequestLimits
from services.engine.config import EngineConfig
from services.prefill.config import PrefillConfig
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.support.poll import eventually

POOL = 64
ENGINE = EngineConfig(preset="tiny", num_threads=1, num_blocks=POOL, max_model_len=512)
CONFIG = PrefillConfig(lease_ttl_s=1.0, max_lease_ms=2_000, max_requester_held_share=0.5, max_held_share=0.75)


@pytest.fixture
async def prefill():
    rt = WorkerRuntime(
        "prefill", "pdmesh.v1.PrefillService", ServerConfig(port=0, drain_grace_s=1), WorkerConfig(), ENGINE
    )
    await rt.setup()
    leases = LeaseManager(default_ttl_s=CONFIG.lease_ttl_s)
    servicer = PrefillServicer(
        engine=rt.engine,
        leases=leases,
        metrics=PrefillMetrics(rt.registry),
        limits=RequestLimits(max_tokens_limit=64, max_prompt_tokens=400),
        worker_info=rt.info(),
        kv_source_address=rt.address,
        agent_name="",
        config=CONFIG,
    )
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, rt.server.server)
    await rt.server.start()
    channel = grpc.aio.insecure_channel(rt.address)
    initial = rt.engine.stats().free_blocks
    try:
        yield prefill_pb2_grpc.PrefillServiceStub(channel), rt, leases
        leases.close()
        # Every block back once the leases end (the engine frees on its step thread).
        await eventually(
            lambda: rt.engine.stats().free_blocks == initial, timeout=20, what=f"{initial} free blocks"
        )
    finally:
        leases.close()
        await channel.close()
        await rt.server.stop()
        await rt.shutdown()


def request(i: int, requester: str = "dec-a", agent: str = "dec-a-agent", tokens: int = 128, lease_ms=0):
    r = prefill_pb2.PrefillRequest(
        request_id=f"r{i}",
        prompt_token_ids=[(i * 31 + k) % 256 for k in range(tokens)],  # distinct: no shared prefix blocks
        requester_id=requester,
        requester_agent=agent,
        lease_ms=lease_ms,
    )
    r.sampling.max_tokens = 4
    return r


async def test_an_empty_requester_agent_is_invalid(prefill):
    stub, _, leases = prefill
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Prefill(request(0, agent=""), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requester_agent" in e.value.details()
    assert leases.held == 0


async def test_a_huge_lease_is_clamped_to_max_lease_ms(prefill):
    stub, _, leases = prefill
    before_ms = time.time() * 1000
    resp = await stub.Prefill(request(1, lease_ms=2**32 - 1), timeout=30)
    granted_ms = resp.handle.lease_expires_unix_ms - before_ms
    assert 0 < granted_ms <= CONFIG.max_lease_ms + 1_000  # not 49.7 days
    assert leases.get(resp.handle.handle_id).expires_at - time.monotonic() <= CONFIG.max_lease_ms / 1000


async def test_one_requester_holds_at_most_its_share_and_others_are_still_served(prefill):
    stub, _, leases = prefill
    granted = 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        for i in range(POOL):  # 8 blocks each: the fifth passes dec-a's 50% (32 blocks)
            await stub.Prefill(request(10 + i), timeout=30)
            granted += 1
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dec-a" in e.value.details()
    assert granted == 4 and leases.held_blocks_of("dec-a") == 32
    assert dict(e.value.trailing_metadata()).get("retry-after-ms")
    resp = await stub.Prefill(request(99, requester="dec-b", agent="dec-b-agent"), timeout=30)
    assert resp.handle.handle_id


async def test_new_prefills_are_shed_while_leases_hold_the_pool(prefill):
    stub, rt, leases = prefill
    handles = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        for i in range(POOL):  # requesters of 8 blocks each, beyond the 75% (48 blocks) mark
            who = f"dec-{i}"
            handles.append((await stub.Prefill(request(100 + i, who, f"{who}-agent"), timeout=30)).handle)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in e.value.details()
    retry_ms = int(dict(e.value.trailing_metadata())["retry-after-ms"])
    assert 0 < retry_ms <= CONFIG.max_lease_ms
    assert leases.held_blocks <= 0.75 * POOL and len(handles) == 6
    assert 'pdmesh_prefill_requests_total{outcome="shed"} 1.0' in generate_latest(rt.registry).decode()
    assert rt.engine.stats().free_blocks >= POOL - leases.held_blocks - 8  # nothing else was pinned
    for h in handles:  # the holders' requesters release them: service resumes
        await stub.Release(prefill_pb2.ReleaseRequest(handle_id=h.handle_id), timeout=10)
    assert (await stub.Prefill(request(500), timeout=30)).handle.handle_id
