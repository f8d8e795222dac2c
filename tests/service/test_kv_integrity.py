"""KV integrity of the remote path, over both transports (issue 13, item 1).

kvtransfer + a prefill worker + a decode worker in this process, each a real
servicer on its own MeshServer on port 0, wired as the mains wire them, KV over
real NIXL (both agents in this process) or the gRPC KvSource stream. The
holder's bytes are changed after it computed the handle's digests (what a
hostile agent record pointing the READ elsewhere, or a holder reusing the
blocks, amounts to for the receiver): the pull must fail with
KvTransferFailed(INTEGRITY) before anything is committed, the request must
fall back to a local prefill with token-exact output, the mismatch must be
counted, nothing pulled may reach the decode worker's prefix cache, and both
pools return to their free counts. Before the fix the decode worker answered
OK with tokens computed from the wrong KV.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.leases import LeaseKeeper, LeaseManager
from kvtransfer.pool import PoolView
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvtransfer_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.decode.disagg_policy import Candidate, DisaggConfig, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import PrefillLoadProbe
from services.decode.remote_prefill import RemotePrefill, RemotePrefillFailed
from services.decode.servicer import DecodeServicer
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME as KV_SERVICE
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.worker.runtime import WorkerConfig, WorkerRuntime

ENGINE = EngineConfig(preset="tiny", num_threads=1, num_blocks=128, max_model_len=512)
LIMITS = RequestLimits(max_tokens_limit=64, max_prompt_tokens=400)
PROMPT = [(7 * i + 3) % 256 for i in range(150)]  # > 32 tokens: remote in conditional mode
MAX_TOKENS = 12


def reference_tokens(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of a fresh engine of the same (seeded) tiny model, no mesh involved."""
    engine = LLMEngine(ENGINE)
    req = EngineRequest("ref", tuple(prompt), sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return engine.generate([req])["ref"]


class Corrupter:
    """Flips one byte of the first block of every lease the holder issues, after
    the handle's digests were computed; `restore` flips them back."""

    def __init__(self, pool: PoolView):
        self.pool = pool
        self.on = False
        self.flipped: list[int] = []

    def __call__(self, lease) -> None:
        if self.on:
            b = lease.block_ids[0]
            self._bytes()[b * self.pool.block_bytes + 5] ^= 0xFF
            self.flipped.append(b)

    def restore(self) -> None:
        for b in self.flipped:
            self._bytes()[b * self.pool.block_bytes + 5] ^= 0xFF
        self.flipped.clear()

    def _bytes(self):
        """The pool's bytes as a flat uint8 array (no copy, CPU pool)."""
        import torch

        return self.pool.pool.view(torch.uint8).reshape(-1).numpy()


class Mesh:
    """`wire` = WorkerConfig.kv_wire_quant on both workers (tests/service/test_wire_quant.py):
    the handles then point into the holder's wire staging pool, which `prefill_pool` views."""

    def __init__(self, transport: str, wire: str = "none"):
        self.transport = transport
        self.wire = wire
        self.closers: list = []

    async def start(self) -> None:
        self.kv_servicer = KvTransferServicer(
            AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
        )
        kv = MeshServer(ServerConfig(port=0, drain_grace_s=1), KV_SERVICE)
        kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(self.kv_servicer, kv.server)
        await kv.start()
        self.closers.append(kv.stop)
        cfg = {"kvtransfer_address": kv.address, "kv_transport": self.transport, "kv_wire_quant": self.wire}
        # prefill worker
        p = WorkerRuntime(
            "prefill",
            "pdmesh.v1.PrefillService",
            ServerConfig(port=0, drain_grace_s=1),
            WorkerConfig(worker_id="prefill-0", **cfg),
            ENGINE,
        )
        await p.setup()
        self.leases = LeaseManager(default_ttl_s=30.0)
        keeper = LeaseKeeper(self.leases, p.directory, interval_s=0.05)
        if p.transport is not None:
            p.transport.attach_source(self.leases)
        self.prefill_pool = (
            p.wire.view if p.wire is not None else PoolView(p.engine.kv_pool(), p.engine.info.layout)
        )
        self.corrupter = Corrupter(self.prefill_pool)
        self.leases.add_issue_listener(self.corrupter)
        add_kv_source(p.server.server, KvSourceServicer(self.prefill_pool, self.leases))
        from pdmesh.v1 import prefill_pb2_grpc

        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(
                engine=p.engine,
                leases=self.leases,
                metrics=PrefillMetrics(p.registry),
                limits=LIMITS,
                worker_info=p.info(),
                kv_source_address=p.address,
                agent_name=p.transport.agent_name if p.transport else "",
                wire=p.wire,
            ),
            p.server.server,
        )
        keeper.start()
        await p.server.start()
        self.prefill = p

        async def close_prefill() -> None:
            await p.server.stop()
            await keeper.stop()
            self.leases.close()
            await p.shutdown()

        self.closers.append(close_prefill)
        # decode worker
        d = WorkerRuntime(
            "decode",
            "pdmesh.v1.DecodeService",
            ServerConfig(port=0, drain_grace_s=1),
            WorkerConfig(worker_id="decode-0", **cfg),
            ENGINE,
        )
        await d.setup()
        assert d.transport is not None and d.transport.kind == self.transport
        self.remote = RemotePrefill(d.engine, d.transport, d.channels, d.worker_id, 10_000, wire=d.wire)
        self.candidate = Candidate("prefill-0", p.address)
        self.decode_servicer = DecodeServicer(
            engine=d.engine,
            policy=DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=32)),
            remote=self.remote,
            metrics=DecodeMetrics(d.registry),
            limits=LIMITS,
            worker_info=d.info(),
            static_candidates=[self.candidate],
            prefill_timeout_s=10.0,
            probe=PrefillLoadProbe(d.channels),
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.decode_servicer, d.server.server)
        await d.server.start()
        self.decode = d

        async def close_decode() -> None:
            await d.server.stop()
            await d.shutdown()

        self.closers.append(close_decode)
        self.channel = grpc.aio.insecure_channel(d.address)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)

    async def close(self) -> None:
        if hasattr(self, "channel"):
            await self.channel.close()
        for close in reversed(self.closers):
            await close()

    def free(self) -> tuple[int, int, int]:
        return (
            self.decode.engine.stats().free_blocks,
            self.prefill.engine.stats().free_blocks,
            self.leases.held_blocks,
        )

    async def settled(self, want: tuple[int, int, int]) -> None:
        deadline = time.monotonic() + 20
        while self.free() != want:
            assert time.monotonic() < deadline, f"pools {self.free()} != {want}"
            await asyncio.sleep(0.02)  # polling the engines' counters, with a deadline

    async def generate(self, rid: str, mode: int) -> tuple[list[int], decode_pb2.DecodeFinal]:
        req = decode_pb2.DecodeServiceGenerateRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            disagg_mode=mode,
        )
        tokens: list[int] = []
        final = None
        async for msg in self.stub.Generate(req, timeout=60):
            if msg.HasField("tokens"):
                tokens += msg.tokens.token_ids
            else:
                final = msg.final
        assert final is not None
        return tokens, final

    def fallbacks(self, reason: str) -> float:
        for line in generate_latest(self.decode.registry).decode().splitlines():
            if line.startswith("pdmesh_disagg_fallbacks_total{") and f'reason="{reason}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(params=["nixl", "grpc"])
async def mesh(request):
    m = Mesh(request.param)
    try:
        await m.start()
        yield m
    finally:
        await m.close()


async def test_corrupted_kv_is_refused_and_the_request_falls_back_token_exact(mesh):
    want = reference_tokens(PROMPT)
    initial = mesh.free()
    mesh.corrupter.on = True
    # 1. The remote path alone: the pull fails on the digests and nothing is cached or held here.
    req = EngineRequest(
        "direct", tuple(PROMPT), sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    with pytest.raises(RemotePrefillFailed) as e:
        await mesh.remote.run(req, mesh.candidate, time.monotonic() + 20)
    assert (e.value.stage, e.value.reason) == ("transfer", "integrity")
    assert mesh.decode.transport.integrity.failures == 1
    assert mesh.decode.engine.prefix_lookup(PROMPT) == 0  # no pulled block was offered to the cache
    await mesh.settled(initial)
    # 2. Through the decode servicer: the remote path fails the same way, the local fallback answers.
    tokens, final = await mesh.generate("r1", decode_pb2.DISAGG_MODE_REMOTE)
    assert tokens == want
    assert final.prefill_path == "local"
    assert mesh.fallbacks("integrity") == 1
    assert mesh.decode.transport.integrity.failures == 2
    await mesh.settled((initial[0], initial[1], 0))
    # 3. What the decode worker cached is its own, correct KV: a later local request hits it and agrees.
    mesh.corrupter.on = False
    mesh.corrupter.restore()
    cached = mesh.decode.engine.prefix_lookup(PROMPT)
    assert cached > 0
    tokens, final = await mesh.generate("r2", decode_pb2.DISAGG_MODE_LOCAL)
    assert tokens == want
    await mesh.settled((initial[0], initial[1], 0))


async def test_an_intact_handoff_passes_the_check(mesh):
    """The control: with nothing corrupted the remote path is taken and verified."""
    want = reference_tokens(PROMPT)
    initial = mesh.free()
    tokens, final = await mesh.generate("ok", decode_pb2.DISAGG_MODE_REMOTE)
    assert tokens == want and final.prefill_path == "remote"
    assert mesh.decode.transport.integrity.failures == 0
    await mesh.settled((initial[0], initial[1], 0))


async def test_a_misdirected_nixl_read_is_refused(mesh):
    """The attack of the issue on the NIXL path, past the registry: the prefill
    worker's agent record points one block further into its pool (as if its owner
    secret had leaked), so the READ fetches the neighbouring blocks. The digests
    catch it; the answer is the local prefill's."""
    if mesh.transport != "nixl":
        pytest.skip("the agent record's region is what a NIXL READ follows; gRPC reads by handle")
    from dataclasses import replace

    from services.kvtransfer.registry import Owner

    want = reference_tokens(PROMPT)
    initial = mesh.free()
    holder = mesh.prefill.directory
    holder._heartbeat.cancel()  # its next heartbeat would re-register the true record
    own = holder.own
    bb = mesh.prefill_pool.block_bytes
    hostile = replace(own, address=own.address + bb, num_blocks=own.num_blocks - 1, incarnation=0)
    mesh.kv_servicer.registry.register(hostile, owner=Owner.of("", holder.owner_secret))
    tokens, final = await mesh.generate("misdirected", decode_pb2.DISAGG_MODE_REMOTE)
    assert tokens == want and final.prefill_path == "local"
    assert mesh.fallbacks("integrity") == 1 and mesh.decode.transport.integrity.failures == 1
    assert mesh.decode.engine.prefix_lookup(PROMPT) > 0  # cached: the local prefill's own blocks
    tokens, _ = await mesh.generate("after", decode_pb2.DISAGG_MODE_LOCAL)
    assert tokens == want
    await mesh.settled((initial[0], initial[1], 0))
