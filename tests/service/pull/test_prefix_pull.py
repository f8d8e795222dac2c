"""Prefixes pulled instead of recomputed (issue 17 item 3), over both KV transports.

kvtransfer + two decode workers in this process, each a real runtime on its own
MeshServer on port 0 wired by services.decode.main.wire (as the main wires
it), KV over real NIXL (both agents in this process) or the gRPC KvSource
stream. The holder has a prompt's prefix cached; the puller gets the request
with a PrefixPullHint naming the holder. Checked: the output is token-exact,
the puller prefilled only the uncached remainder, the holder's lease ended, the
metrics counted it, and both pools return to their free counts; and every
failure (nothing cached there, digest mismatch, a lease too short to READ
safely, the holder's limits) falls back to a local prefill with the same
tokens. The holder SIGKILLed mid-pull is tests/e2e/test_prefix_pull_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer.pool import PoolView
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc, worker_pb2
from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.decode.config import DecodeSettings
from services.decode.main import wire
from services.decode.prefix_pull import PullerConfig
from services.engine.config import EngineConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME as KV_SERVICE
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from services.worker.prefix_source import PrefixSourceConfig
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.service.test_kv_integrity import ENGINE as INTEGRITY_ENGINE
from tests.service.test_kv_integrity import Corrupter
from tests.service.test_kv_integrity import reference_tokens as integrity_reference

ENGINE = INTEGRITY_ENGINE  # one tiny engine config for both suites (reference_tokens builds it)
LIMITS = RequestLimits(max_tokens_limit=64, max_prompt_tokens=400)
SHARED = [(11 * i + 5) % 256 for i in range(96)]  # 6 blocks of 16
PROMPT = SHARED + [(3 * i + 1) % 256 for i in range(21)]
MAX_TOKENS = 10


def reference_tokens(prompt: list[int]) -> list[int]:
    return integrity_reference(prompt, MAX_TOKENS)  # same ENGINE, no mesh


class Worker:
    def __init__(self, rt: WorkerRuntime, parts):
        self.rt, self.parts = rt, parts
        self.channel = grpc.aio.insecure_channel(rt.address)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.source_stub = kvtransfer_pb2_grpc.PrefixSourceServiceStub(self.channel)

    @property
    def engine(self):
        return self.rt.engine

    def free(self) -> tuple[int, int, int]:
        s = self.engine.stats()
        return s.free_blocks, s.held_blocks, self.parts.source.leases.held

    def metric(self, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in generate_latest(self.rt.registry).decode().splitlines():
            head, _, value = line.rpartition(" ")
            if head == (f"{name}{{{want}}}" if want else name):
                return float(value)
        return 0.0

    async def generate(
        self, rid: str, prompt: list[int], hint=None
    ) -> tuple[list[int], decode_pb2.DecodeFinal]:
        req = decode_pb2.DecodeServiceGenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            disagg_mode=decode_pb2.DISAGG_MODE_LOCAL,
        )
        if hint is not None:
            req.prefix_pull.CopyFrom(hint)
        tokens: list[int] = []
        final = None
        async for msg in self.stub.Generate(req, timeout=60):
            if msg.HasField("tokens"):
                tokens += msg.tokens.token_ids
            else:
                final = msg.final
        assert final is not None
        return tokens, final


class PullMesh:
    def __init__(self, transport: str):
        self.transport = transport
        self.closers: list = []

    async def start(
        self,
        pull: PullerConfig | None = None,
        source: PrefixSourceConfig | None = None,
        holder_engine: EngineConfig = ENGINE,
    ):
        kv_servicer = KvTransferServicer(
            AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
        )
        kv = MeshServer(ServerConfig(port=0, drain_grace_s=1), KV_SERVICE)
        kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(kv_servicer, kv.server)
        await kv.start()
        self.closers.append(kv.stop)
        self.kv_address = kv.address
        self.holder = await self._worker("holder", pull, source, holder_engine)
        self.puller = await self._worker("puller", pull, source, ENGINE)

    async def _worker(self, name, pull, source, engine: EngineConfig) -> Worker:
        settings = DecodeSettings(
            engine=engine,
            limits=LIMITS,
            prefix_pull=pull or PullerConfig(),
            prefix_source=source or PrefixSourceConfig(prefix_lease_check_s=0.05),
        )
        rt = WorkerRuntime(
            "decode",
            "pdmesh.v1.DecodeService",
            ServerConfig(port=0, drain_grace_s=1),
            WorkerConfig(worker_id=name, kvtransfer_address=self.kv_address, kv_transport=self.transport),
            engine,
        )
        await rt.setup()
        assert rt.transport is not None and rt.transport.kind == self.transport
        parts = wire(rt, settings)
        parts.source.start()
        await rt.server.start()
        w = Worker(rt, parts)

        async def close() -> None:
            await w.channel.close()
            await rt.server.stop()
            await parts.source.stop()
            await rt.shutdown()

        self.closers.append(close)
        return w

    def hint(self, blocks: int = 6) -> decode_pb2.PrefixPullHint:
        return decode_pb2.PrefixPullHint(
            worker_id="holder",
            address=self.holder.rt.address,
            kv_agent_name=self.holder.rt.transport.agent_name,
            blocks=blocks,
        )

    async def close(self) -> None:
        for close in reversed(self.closers):
            await close()


async def settled(*workers: Worker) -> None:
    """Every pool back to all blocks free, nothing held, no lease (polled, with a deadline)."""
    deadline = time.monotonic() + 20
    want = (ENGINE.num_blocks, 0, 0)
    while any(w.free() != want for w in workers):
        assert time.monotonic() < deadline, f"pools {[w.free() for w in workers]} != {want}"
        await asyncio.sleep(0.02)  # polling counters with a deadline


@pytest.fixture(params=["nixl", "grpc"])
async def mesh(request):
    m = PullMesh(request.param)
    try:
        await m.start()
        yield m
    finally:
        await m.close()


async def warm(mesh: PullMesh) -> None:
    await mesh.holder.generate("warm", [*SHARED, 9, 9, 9])
    assert mesh.holder.engine.prefix_lookup(PROMPT) == len(SHARED)


async def test_pulled_prefix_is_token_exact_and_only_the_rest_is_prefilled(mesh):
    want = reference_tokens(PROMPT)
    await warm(mesh)
    before = mesh.puller.engine.stats().prompt_tokens_computed
    tokens, final = await mesh.puller.generate("r1", PROMPT, mesh.hint())
    assert tokens == want
    assert final.pulled_prefix_tokens == len(SHARED)
    assert final.usage.cached_prompt_tokens == len(SHARED)
    # Only the 21 tokens past the pulled 6 blocks were prefilled here.
    assert mesh.puller.engine.stats().prompt_tokens_computed - before == len(PROMPT) - len(SHARED)
    assert mesh.puller.engine.stats().prompt_tokens_transferred == len(SHARED)
    assert mesh.puller.metric("pdmesh_prefix_pulls_total", outcome="ok") == 1
    assert mesh.puller.metric("pdmesh_prefix_pull_tokens_saved_total") == len(SHARED)
    await settled(mesh.holder, mesh.puller)
    c = mesh.holder.parts.source.leases.counters
    assert (c.issued, c.released, c.expired) == (1, 1, 0)  # ended by the pull, not by its TTL
    # The pulled blocks joined the puller's prefix cache like its own.
    assert mesh.puller.engine.prefix_lookup(PROMPT) >= len(SHARED)


async def test_nothing_cached_on_the_holder_falls_back_to_local(mesh):
    want = reference_tokens(PROMPT)
    tokens, final = await mesh.puller.generate("r1", PROMPT, mesh.hint())
    assert tokens == want and final.pulled_prefix_tokens == 0
    assert mesh.puller.metric("pdmesh_prefix_pulls_total", outcome="fallback") == 1
    await settled(mesh.holder, mesh.puller)


async def test_digest_mismatch_is_refused_and_the_request_prefills_locally(mesh):
    want = reference_tokens(PROMPT)
    await warm(mesh)
    corrupter = Corrupter(PoolView(mesh.holder.engine.kv_pool(), mesh.holder.engine.info.layout))
    mesh.holder.parts.source.leases.add_issue_listener(corrupter)
    corrupter.on = True
    before = mesh.puller.engine.stats().prompt_tokens_computed
    try:
        tokens, final = await mesh.puller.generate("r1", PROMPT, mesh.hint())
    finally:
        corrupter.on = False
        corrupter.restore()
    assert tokens == want and final.pulled_prefix_tokens == 0
    assert mesh.puller.rt.transport.integrity.failures == 1
    # Nothing pulled reached the puller's cache: it computed the whole prompt itself.
    assert mesh.puller.engine.stats().prompt_tokens_computed - before == len(PROMPT)
    assert mesh.puller.metric("pdmesh_prefix_pulls_total", outcome="fallback") == 1
    await settled(mesh.holder, mesh.puller)


async def test_a_prefix_cached_here_already_is_not_pulled(mesh):
    await warm(mesh)
    await mesh.puller.generate("w", [*SHARED, 1, 2])
    _tokens, final = await mesh.puller.generate("r1", PROMPT, mesh.hint())
    assert final.pulled_prefix_tokens == 0
    assert mesh.puller.metric("pdmesh_prefix_pulls_total", outcome="skipped") == 1
    assert mesh.holder.parts.source.leases.counters.issued == 0  # not even asked
    await settled(mesh.holder, mesh.puller)


async def test_the_holder_bounds_what_a_peer_may_pin_and_checks_its_input(mesh):
    await warm(mesh)
    stub = mesh.puller.source_stub
    base = dict(request_id="x", prompt_token_ids=PROMPT, requester_id="puller", requester_agent="a")
    # No requester agent: the lease could not end with the puller.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await mesh.holder.source_stub.LeasePrefix(
            kvtransfer_pb2.LeasePrefixRequest(**{**base, "requester_agent": ""})
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Tokens outside the vocabulary.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await mesh.holder.source_stub.LeasePrefix(
            kvtransfer_pb2.LeasePrefixRequest(**{**base, "prompt_token_ids": [9999] * 32})
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Leases up to one requester's share (25% of 128 blocks = 32): 6 blocks at a time.
    handles = []
    for i in range(5):
        r = await mesh.holder.source_stub.LeasePrefix(
            kvtransfer_pb2.LeasePrefixRequest(**{**base, "request_id": f"x{i}"})
        )
        assert len(r.handle.nixl_blocks.block_ids) == 6 and r.handle.issued_to == "puller"
        handles.append(r.handle.handle_id)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await mesh.holder.source_stub.LeasePrefix(
            kvtransfer_pb2.LeasePrefixRequest(**{**base, "request_id": "x9"})
        )
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for h in handles:
        r = await stub.ReleasePrefix(
            kvtransfer_pb2.ReleasePrefixRequest(handle_id=h)
        )  # wrong server: unknown
        assert not r.released
        r = await mesh.holder.source_stub.ReleasePrefix(kvtransfer_pb2.ReleasePrefixRequest(handle_id=h))
        assert r.released
    await settled(mesh.holder, mesh.puller)


@pytest.mark.parametrize("transport", ["nixl"])
async def test_a_lease_too_short_to_read_safely_falls_back(transport):
    # NIXL READs cannot be pinned on the holder: a handle whose lease ends within the
    # margin (0.25 s) is refused before any byte moves, and the holder is released at once.
    m = PullMesh(transport)
    try:
        await m.start(pull=PullerConfig(prefix_pull_lease_ms=100))
        want = reference_tokens(PROMPT)
        await warm(m)
        tokens, final = await m.puller.generate("r1", PROMPT, m.hint())
        assert tokens == want and final.pulled_prefix_tokens == 0
        assert m.puller.metric("pdmesh_prefix_pulls_total", outcome="fallback") == 1
        await settled(m.holder, m.puller)
    finally:
        await m.close()


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
async def test_a_holder_with_another_kv_layout_is_refused_and_the_request_prefills_locally(transport):
    # Same model, int8 KV blocks on the holder: the bytes would be garbage here.
    m = PullMesh(transport)
    try:
        await m.start(holder_engine=dataclasses.replace(ENGINE, kv_cache_quant="int8"))
        want = reference_tokens(PROMPT)
        await warm(m)
        before = m.puller.engine.stats().prompt_tokens_computed
        tokens, final = await m.puller.generate("r1", PROMPT, m.hint())
        assert tokens == want and final.pulled_prefix_tokens == 0
        assert m.puller.engine.stats().prompt_tokens_computed - before == len(PROMPT)
        assert m.puller.metric("pdmesh_prefix_pulls_total", outcome="fallback") == 1
        await settled(m.holder, m.puller)
    finally:
        await m.close()


async def test_the_load_reports_the_link_once_three_pulls_measured_it(mesh):
    """The puller fits its link to its transfers and its load report gives the router the price
    (WorkerLoad.link_ms_per_block / link_latency_ms); one transfer is not enough (a first
    connection's setup is not the link), so the router's configured link is used until three."""
    for i in range(3):
        prefix = [(7 * j + 13 * i + 1) % 256 for j in range(96)]
        await mesh.holder.generate(f"warm{i}", [*prefix, 9, 9, 9])
        stats = await mesh.puller.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        assert (stats.load.link_ms_per_block, stats.load.link_latency_ms) == (0.0, 0.0)
        _, final = await mesh.puller.generate(f"r{i}", [*prefix, 1, 2, 3], mesh.hint())
        assert final.pulled_prefix_tokens == len(prefix)
    stats = await mesh.puller.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    assert stats.load.link_ms_per_block > 0.0 and stats.load.link_latency_ms >= 0.0
    assert stats.load.link_ms_per_block * 6 + stats.load.link_latency_ms < 10_000.0  # a 6-block pull
    await settled(mesh.holder, mesh.puller)
