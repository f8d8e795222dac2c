"""The DecodeWorker core in-process: every way the remote path can end, and the pools after it.

The decode and prefill engines are real tiny TorchEngines; the prefill service
and the KV transport are the fakes of tests/unit/decode/fakes.py (a real gRPC
server on loopback port 0, an in-process block copy). Each test checks that the
decode engine's pool is whole again and that the prefill side holds nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.channels import ChannelCache
from services.common.errors import DeadlineExceeded
from services.decode.disagg_policy import Candidate, DisaggConfig, DisaggregationPolicy, Mode, Path, Reason
from services.decode.metrics import DecodeMetrics
from services.decode.remote_prefill import RemotePrefill
from services.decode.worker import DecodeJob, DecodeWorker, Finished, Tokens
from services.engine.api import EngineRequest, FinishReason, SamplingParams
from services.engine.factory import create_engine
from services.engine.llm_engine import LLMEngine
from tests.unit.decode.fakes import FakePrefill, FakeTransport
from tests.unit.engine.conftest import prompt_of, tiny_config

DECODE_BLOCKS = 8  # small, so a leaked reservation shows and the pool can be filled
PROMPT = prompt_of(48, seed=11)  # exactly 3 blocks of 16


@dataclass
class Mesh:
    decode: object
    prefill: object
    fake: FakePrefill
    transport: FakeTransport
    channels: ChannelCache
    metrics: DecodeMetrics
    address: str

    def worker(self, prefill_timeout_s: float = 30.0, max_request_s: float = 600.0) -> DecodeWorker:
        remote = RemotePrefill(self.decode, self.transport, self.channels, "decode-0", lease_ms=30_000)
        return DecodeWorker(
            self.decode,
            DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=0)),
            remote,
            self.metrics,
            static_candidates=[Candidate("prefill-0", self.address)],
            prefill_timeout_s=prefill_timeout_s,
            max_request_s=max_request_s,
        )

    def fallbacks(self, stage: str, reason: str) -> float:
        return (
            self.metrics.registry.get_sample_value(
                "pdmesh_disagg_fallbacks_total", {"stage": stage, "reason": reason}
            )
            or 0.0
        )

    async def assert_both_pools_back(self) -> None:
        """Every decode block free, nothing reserved or running; the prefill side
        (its held handles and its engine's pool) empty. Release is sent in the
        background, so the prefill side is polled with a deadline."""
        await self.decode.sync()
        s = self.decode.stats()
        assert (s.running, s.waiting, s.held_blocks) == (0, 0, 0)
        assert s.free_blocks == s.total_blocks == DECODE_BLOCKS
        limit = time.monotonic() + 10.0
        while not self.fake.holds_nothing() and time.monotonic() < limit:
            await asyncio.sleep(0.01)
            await self.prefill.sync()
        assert self.fake.holds_nothing(), (self.fake.held, self.prefill.stats())


@pytest.fixture
async def mesh():
    decode = create_engine(tiny_config(num_blocks=DECODE_BLOCKS))
    prefill = create_engine(tiny_config())
    await decode.start()
    await prefill.start()
    fake = FakePrefill(prefill)
    address = await fake.start()
    channels = ChannelCache()
    m = Mesh(
        decode,
        prefill,
        fake,
        FakeTransport(fake, decode),
        channels,
        DecodeMetrics(CollectorRegistry()),
        address,
    )
    try:
        yield m
    finally:
        await channels.close()
        await fake.stop()
        await decode.close()
        await prefill.close()


def job(rid: str = "r", prompt=PROMPT, max_tokens: int = 8, timeout_s: float | None = None, mode=Mode.REMOTE):
    req = EngineRequest(f"{rid}@0", tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return DecodeJob(request=req, client_request_id=rid, mode=mode, timeout_s=timeout_s)


def reference(j: DecodeJob) -> list[int]:
    return LLMEngine(tiny_config()).generate([j.request])[j.request.request_id]


async def run(worker: DecodeWorker, j: DecodeJob) -> tuple[list[int], Finished]:
    events = [e async for e in worker.generate(j)]
    *deltas, final = events
    assert all(isinstance(e, Tokens) for e in deltas) and isinstance(final, Finished)
    return [t for e in deltas for t in e.token_ids], final


def assert_fell_back(tokens: list[int], final: Finished, j: DecodeJob) -> None:
    assert tokens == reference(j)
    assert (final.path, final.reason) == (Path.LOCAL, Reason.FALLBACK)
    assert final.finish_reason is FinishReason.LENGTH and final.completion_tokens == 8
    assert final.kv_bytes_transferred == 0


async def test_the_remote_path_gives_the_local_tokens_and_gives_every_block_back(mesh):
    j = job()
    tokens, final = await run(mesh.worker(), j)
    assert tokens == reference(j)
    assert (final.path, final.reason, final.prefill_worker_id) == (
        Path.REMOTE,
        Reason.FORCED_REMOTE,
        "prefill-0",
    )
    assert final.kv_bytes_transferred > 0 and mesh.transport.pulls == 1
    assert final.computed_tokens == 48 + 7  # the prefill worker's prompt, then 7 decode steps here
    await mesh.assert_both_pools_back()


async def test_a_first_token_that_finishes_the_request_needs_no_pull(mesh):
    j = job(max_tokens=1)
    tokens, final = await run(mesh.worker(), j)
    assert tokens == reference(j) and final.completion_tokens == 1 and mesh.transport.pulls == 0
    assert final.path is Path.REMOTE
    await mesh.assert_both_pools_back()


async def test_prefill_failing_before_the_handle_falls_back_once(mesh):
    mesh.fake.fail_with = grpc.StatusCode.UNAVAILABLE
    j = job()
    tokens, final = await run(mesh.worker(), j)
    assert_fell_back(tokens, final, j)
    assert mesh.fallbacks("prefill", "unavailable") == 1 and mesh.transport.pulls == 0
    await mesh.assert_both_pools_back()


async def test_a_handle_that_does_not_cover_the_request_is_released_before_the_fallback(mesh):
    mesh.fake.wrong_handle = True
    j = job()
    tokens, final = await run(mesh.worker(), j)
    assert_fell_back(tokens, final, j)
    assert mesh.fallbacks("handle", "invalid") == 1 and mesh.transport.pulls == 0
    await mesh.assert_both_pools_back()
    assert len(mesh.fake.releases) == 1  # asked back, not left to a lease


@pytest.mark.parametrize("blocks_before", [0, 1, 2])
async def test_the_holder_dying_during_the_pull_frees_the_half_written_reservation(mesh, blocks_before):
    mesh.transport.fail_after_blocks = blocks_before  # 0: gone right after handing out the handle
    j = job()
    tokens, final = await run(mesh.worker(), j)
    # The same tokens as locally: the half-written blocks were freed, never cached.
    assert_fell_back(tokens, final, j)
    assert mesh.fallbacks("transfer", "peer_dead") == 1 and mesh.transport.failures == 1
    await mesh.assert_both_pools_back()
    assert len(mesh.fake.releases) == 1


async def test_a_pull_that_outlasts_the_prefill_timeout_falls_back(mesh):
    mesh.transport.hang = True
    j = job(timeout_s=120.0)
    tokens, final = await run(mesh.worker(prefill_timeout_s=0.5), j)
    assert_fell_back(tokens, final, j)
    assert mesh.fallbacks("transfer", "timeout") == 1
    await mesh.assert_both_pools_back()
    assert len(mesh.fake.releases) == 1


async def test_the_deadline_passing_during_the_pull_leaves_no_time_for_a_fallback(mesh):
    mesh.transport.hang = True
    with pytest.raises(DeadlineExceeded, match="failed remote prefill"):
        await run(mesh.worker(prefill_timeout_s=30.0), job(timeout_s=1.0))
    assert mesh.fallbacks("transfer", "timeout") == 1
    assert mesh.metrics.decision_counts().get("local/fallback", 0) == 0  # not started
    await mesh.assert_both_pools_back()
    assert len(mesh.fake.releases) == 1


async def test_the_client_cancelling_during_the_pull_frees_both_sides(mesh):
    mesh.transport.hang = True
    worker = mesh.worker()
    task = asyncio.create_task(run(worker, job()))
    await mesh.transport.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await mesh.assert_both_pools_back()
    assert len(mesh.fake.releases) == 1 and mesh.transport.failures == 1
    assert mesh.metrics.count("cancelled") == 1 and mesh.fallbacks("transfer", "cancelled") == 0


async def test_the_deadline_passing_during_the_local_fallback_ends_it_and_frees_its_blocks(mesh):
    # While the prefill worker "works", the rest of the decode pool fills up, so
    # the fallback gets its first token from the 3 blocks the freed reservation
    # left, and then waits for a 4th block that never comes, until the deadline.
    filler = EngineRequest("filler", tuple(prompt_of(16 * (DECODE_BLOCKS - 3), seed=12)), SamplingParams())

    async def fill_the_decode_pool() -> None:
        await mesh.decode.reserve_external(filler)

    mesh.fake.before_answer = fill_the_decode_pool
    mesh.fake.fail_with = grpc.StatusCode.UNAVAILABLE
    events = []
    with pytest.raises(DeadlineExceeded, match="local"):
        async for e in mesh.worker().generate(job(timeout_s=3.0)):
            events.append(e)
    assert [type(e) for e in events] == [Tokens]  # the fallback ran: its first token came out
    assert mesh.fallbacks("prefill", "unavailable") == 1
    mesh.decode.cancel_external("filler")
    await mesh.assert_both_pools_back()


async def test_no_client_deadline_means_the_configured_maximum(mesh):
    filler = EngineRequest("filler", tuple(prompt_of(16 * (DECODE_BLOCKS - 1), seed=13)), SamplingParams())
    await mesh.decode.reserve_external(filler)  # the request's 3 blocks do not fit: it waits
    with pytest.raises(DeadlineExceeded):
        await run(mesh.worker(max_request_s=0.5), job(timeout_s=None, mode=Mode.LOCAL))
    mesh.decode.cancel_external("filler")
    await mesh.assert_both_pools_back()


async def test_local_accounting_counts_the_prefix_cache_hit_of_a_repeat(mesh):
    worker = mesh.worker()
    tokens, first = await run(worker, job("a", mode=Mode.LOCAL))
    assert tokens == reference(job("a"))
    assert (first.path, first.reason, first.cached_prompt_tokens) == (Path.LOCAL, Reason.FORCED_LOCAL, 0)
    assert first.computed_tokens == 48 + 7 and mesh.transport.pulls == 0
    _, again = await run(worker, job("b", mode=Mode.LOCAL))
    # Two full blocks come from the cache; the last prompt block is recomputed
    # (the last token is always computed: its logits give the first sample).
    assert again.cached_prompt_tokens == 32 and again.computed_tokens == 16 + 7
    assert mesh.metrics.count("ok") == 2
    await mesh.assert_both_pools_back()


class DivertSpy:
    """Counts the engine streams the worker diverted to its sink (Engine.divert)."""

    def __init__(self, engine):
        self.engine, self.diverted = engine, 0
        self._divert = engine.divert
        engine.divert = self

    def __call__(self, request_id, sink):
        ok = self._divert(request_id, sink)
        self.diverted += ok
        return ok


async def run_sunk(worker: DecodeWorker, j: DecodeJob) -> tuple[list[int], Finished]:
    sunk: list[int] = []
    events = [e async for e in worker.generate(j, sink=sunk.extend)]
    assert len(events) == 1 and isinstance(events[0], Finished)  # the tokens went to the sink
    return sunk, events[0]


@pytest.mark.parametrize("mode", [Mode.LOCAL, Mode.REMOTE])
async def test_a_sink_gets_the_same_tokens_and_accounting_as_the_events(mesh, mode):
    spy = DivertSpy(mesh.decode)
    worker = mesh.worker()
    a, b = job("a", max_tokens=12, mode=mode), job("b", prompt_of(48, seed=21), max_tokens=12, mode=mode)
    pulled, pulled_final = await run(worker, a)
    assert spy.diverted == 0  # no sink: nothing to divert to
    sunk, sunk_final = await run_sunk(worker, b)
    assert spy.diverted == 1
    assert pulled == reference(a) and sunk == reference(b)
    assert sunk_final == pulled_final  # the same accounting (two uncached prompts of one length)
    itl = mesh.metrics.registry.get_sample_value("pdmesh_decode_itl_seconds_count")
    assert itl == 2 * 11  # every interval after the first token, diverted or not
    await mesh.assert_both_pools_back()


async def test_cancelling_a_diverted_request_aborts_it_and_frees_its_blocks(mesh):
    spy = DivertSpy(mesh.decode)
    decoding = asyncio.Event()
    sunk: list[int] = []

    def sink(ids):
        sunk.extend(ids)
        if spy.diverted:
            decoding.set()

    async def consume():
        async for _ in mesh.worker().generate(job(max_tokens=70, mode=Mode.LOCAL), sink=sink):
            pass

    task = asyncio.create_task(consume())
    await decoding.wait()  # tokens arrive through the engine's callback now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    n = len(sunk)
    assert 1 < n < 70
    await mesh.assert_both_pools_back()
    assert len(sunk) == n  # nothing after the abort
    assert mesh.metrics.count("cancelled") == 1


async def test_the_deadline_ends_a_diverted_request_waiting_for_a_block(mesh):
    # The rest of the pool is taken: the request's first token fits its 3 blocks, then
    # it waits (diverted) for a 4th that never comes, until its deadline.
    filler = EngineRequest("filler", tuple(prompt_of(16 * (DECODE_BLOCKS - 3), seed=12)), SamplingParams())
    await mesh.decode.reserve_external(filler)
    spy = DivertSpy(mesh.decode)
    sunk: list[int] = []
    with pytest.raises(DeadlineExceeded, match="local"):
        async for _ in mesh.worker().generate(job(timeout_s=1.0, mode=Mode.LOCAL), sink=sunk.extend):
            pass
    assert len(sunk) == 1 and spy.diverted == 1
    mesh.decode.cancel_external("filler")
    await mesh.assert_both_pools_back()
