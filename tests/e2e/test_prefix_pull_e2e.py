"""Prefix pulls when a process dies (issue 17 item 3): real processes on loopback.

kvtransfer and the decode workers holding the prefix are real processes
(`services.decode.main`, tiny built-in model, gRPC KV transport). Two faults:

- the holder is SIGKILLed mid-pull: after it leased the prefix blocks to the
  puller and before their bytes moved. The puller here is this test process
  (a real decode runtime wired by services.decode.main.wire, serving on port
  0), which is where the kill is timed from: its transport's pull is wrapped
  to kill the holder first. The request must fall back to a local prefill
  with token-exact output within its deadline, and the puller's pool return
  to its free count;
- the puller dies while holding a lease: the holder's blocks are pinned only
  for the pull, so they go back to its pool once the puller's agent is known
  dead (the lease keeper asks the KV-transfer service), long before the lease's
  TTL.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc, worker_pb2
from services.common.server import ServerConfig
from services.decode.config import DecodeSettings
from services.decode.main import wire
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.e2e.helpers import generate, start_mesh, wait_until

pytestmark = pytest.mark.e2e

ENGINE = EngineConfig(preset="tiny", num_threads=1)
SHARED = [(13 * i + 7) % 256 for i in range(96)]  # 6 blocks of 16
PROMPT = SHARED + [(5 * i + 2) % 256 for i in range(19)]
MAX_TOKENS = 8


def reference_tokens() -> list[int]:
    req = EngineRequest("ref", tuple(PROMPT), sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return LLMEngine(ENGINE).generate([req])["ref"]


def stats(address: str):
    with grpc.insecure_channel(address) as ch:
        return decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def warm_holder(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        generate(decode_pb2_grpc.DecodeServiceStub(ch), [*SHARED, 1, 2, 3], request_id="warm", max_tokens=2)


@pytest.fixture
def mesh(tmp_path):
    m = start_mesh(tmp_path, prefill=0, decode=2, kv_transport="grpc")
    yield m
    m.close()


async def test_holder_sigkilled_mid_pull_falls_back_token_exact(mesh):
    holder = mesh.decodes[0]
    warm_holder(holder.address)
    want = reference_tokens()
    rt = WorkerRuntime(
        "decode",
        "pdmesh.v1.DecodeService",
        ServerConfig(port=0, drain_grace_s=1),
        WorkerConfig(worker_id="puller", kvtransfer_address=mesh.kv.address, kv_transport="grpc"),
        ENGINE,
    )
    await rt.setup()
    parts = wire(rt, DecodeSettings(engine=ENGINE))
    parts.source.start()
    await rt.server.start()
    channel = grpc.aio.insecure_channel(rt.address)
    try:
        pull = rt.transport.pull
        killed = []

        async def kill_then_pull(*args, **kwargs):
            # The holder has leased the blocks (LeasePrefix answered); it dies before the read.
            await asyncio.to_thread(mesh.launcher.kill, holder.spec.name)
            killed.append(holder.proc.returncode)
            return await pull(*args, **kwargs)

        rt.transport.pull = kill_then_pull
        total = rt.engine.stats().total_blocks
        req = decode_pb2.DecodeServiceGenerateRequest(
            request_id="r1",
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            prefix_pull=decode_pb2.PrefixPullHint(
                worker_id="decode-0", address=holder.address, blocks=len(SHARED) // 16
            ),
        )
        t0 = time.monotonic()
        tokens, final = [], None
        async for msg in decode_pb2_grpc.DecodeServiceStub(channel).Generate(req, timeout=30):
            if msg.HasField("tokens"):
                tokens += msg.tokens.token_ids
            else:
                final = msg.final
        assert killed and killed[0] is not None, "the holder was not killed mid-pull"
        assert final is not None and tokens == want
        assert final.pulled_prefix_tokens == 0 and final.prefill_path == "local"
        assert time.monotonic() - t0 < 30
        assert parts.puller.metrics.counts["fallback"] == 1
        s = rt.engine.stats()
        assert (s.free_blocks, s.held_blocks) == (total, 0)
    finally:
        await channel.close()
        await rt.server.stop()
        await parts.source.stop()
        await rt.shutdown()


def test_puller_dead_while_holding_a_lease_frees_the_holders_blocks(mesh):
    holder, puller = mesh.decodes
    warm_holder(holder.address)
    total = stats(holder.address).info.kv_capacity_blocks
    agent = stats(puller.address).info.kv_agent_name
    assert agent and wait_until(lambda: stats(holder.address).load.free_blocks == total)
    with grpc.insecure_channel(holder.address) as ch:
        r = kvtransfer_pb2_grpc.PrefixSourceServiceStub(ch).LeasePrefix(
            kvtransfer_pb2.LeasePrefixRequest(
                request_id="x",
                prompt_token_ids=PROMPT,
                requester_id="decode-1",
                requester_agent=agent,
                lease_ms=30_000,  # the holder's cap: far longer than this test waits
            ),
            timeout=10,
        )
    assert len(r.handle.nixl_blocks.block_ids) == len(SHARED) // 16
    assert stats(holder.address).load.free_blocks == total - len(SHARED) // 16
    t0 = time.monotonic()
    mesh.launcher.kill(puller.spec.name)  # SIGKILL: no release, no deregistration
    wait_until(
        lambda: stats(holder.address).load.free_blocks == total,
        timeout=25,
        what="the holder's leased prefix blocks back in its pool",
    )
    assert time.monotonic() - t0 < 28  # the dead agent ended it, not the 30 s TTL
