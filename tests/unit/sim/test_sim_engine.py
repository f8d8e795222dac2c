"""The sim engine through the async `Engine` protocol: generate, prefill-only + external KV, abort."""

from __future__ import annotations

import asyncio

import pytest

from services.engine.api import Engine, EngineRequest, FinishReason, SamplingParams
from services.engine.config import EngineConfig
from services.engine.factory import create_engine
from services.engine.sim.engine import SimEngine
from tests.unit.engine.conftest import prompt_of, request
from tests.unit.sim.conftest import sim_config

FAST = 1e6  # speedup: modeled milliseconds become nanoseconds of wall time


async def started(**overrides) -> SimEngine:
    engine = create_engine(sim_config(**{"sim_speedup": FAST, **overrides}))
    assert isinstance(engine, SimEngine) and isinstance(engine, Engine)
    await engine.start()
    return engine


async def collect(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


async def settled(engine: SimEngine) -> None:
    """Every queued clean-up applied, then the pool is whole again."""
    await engine.sync()
    s = engine.stats()
    assert (s.running, s.waiting, s.held_blocks) == (0, 0, 0)
    assert s.free_blocks == s.total_blocks == engine.info.num_blocks


async def test_generate_reports_sim_backend_and_restores_the_pool():
    engine = await started()
    assert engine.info.backend == "sim" and engine.info.layout.bytes_per_token() == 4
    outs = [o async for o in engine.generate(request("g", prompt_of(300, 1), max_tokens=12))]
    assert sum(len(o.token_ids) for o in outs) == 12
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.runner.modeled_s > 0
    await settled(engine)
    await engine.close()


async def test_prefill_handover_matches_local_generate_and_frees_both_pools():
    prefill, decode, local = await started(), await started(), await started()
    shared = prompt_of(64, 2)
    await collect(decode.generate(request("warm", shared + prompt_of(20, 3), max_tokens=2)))
    req = request("h", shared + prompt_of(77, 4), max_tokens=16)
    want = await collect(local.generate(req))

    result = await prefill.prefill(req)
    assert result.held is not None and result.computed_tokens == 141
    res = await decode.reserve_external(req)
    assert res.num_cached_tokens == 64  # the decode worker's own prefix: not transferred
    src = result.held.block_ids[res.first_transfer_block : len(res.block_ids)]
    blocks = await prefill.export_blocks(src)
    await decode.import_blocks(res.transfer_block_ids, blocks, result.held.layout)
    assert prefill.release("h")
    got = await collect(decode.generate_external("h", result.first_token_id))
    assert got == want
    assert decode.stats().prompt_tokens_transferred == 141 - 64
    for engine in (prefill, decode, local):
        await settled(engine)
        await engine.close()


async def test_handover_waits_the_modeled_transfer_time(monkeypatch):
    waits: list[float] = []

    async def record(self, delay: float) -> None:
        waits.append(delay)

    monkeypatch.setattr(SimEngine, "_model_transfer", record)
    decode = await started(sim_speedup=2.0, sim_profile="dynamo-mocker")
    req = request("t", prompt_of(200, 5), max_tokens=3)
    await decode.reserve_external(req)
    assert len(await collect(decode.generate_external("t", 7))) == 3
    prof = decode.profile
    assert waits == [pytest.approx(200 * prof.kv_bytes_per_token / (prof.kv_bandwidth_gbps * 1e9) / 2.0)]
    await settled(decode)
    await decode.close()


async def test_closing_during_the_transfer_frees_the_reservation():
    decode = await started(sim_speedup=1e-9)  # a transfer of ~2 days: only closing ends it
    req = request("c", prompt_of(100, 6), max_tokens=3)
    await decode.reserve_external(req)
    assert decode.stats().free_blocks < decode.info.num_blocks
    stream = decode.generate_external("c", 1)
    task = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # let the stream start its modeled transfer
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settled(decode)
    await decode.close()


async def test_abort_mid_stream_and_prefill_only_finishing_early():
    # Real-time steps (speedup 1): at FAST speed the engine thread can run this request to the
    # pool's length limit between the first token and the abort, and the test would race.
    engine = await started(sim_speedup=1.0)
    stream = engine.generate(request("a", prompt_of(50, 7), max_tokens=10_000))
    first = await anext(stream)
    assert first.token_ids
    assert engine.abort("a")
    rest = [o async for o in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    # A prefill whose first token is also the last holds nothing.
    done = await engine.prefill(request("p", prompt_of(40, 8), max_tokens=1))
    assert done.finished and done.held is None
    await settled(engine)
    await engine.close()


async def test_migration_resume_continues_the_same_tokens():
    a, b = await started(), await started()
    prompt = prompt_of(90, 9)
    full = await collect(a.generate(request("m", prompt, max_tokens=20)))
    resumed = EngineRequest("m2", prompt, SamplingParams(max_tokens=20, ignore_eos=True), tuple(full[:8]))
    assert await collect(b.generate(resumed)) == full[8:]
    for engine in (a, b):
        await settled(engine)
        await engine.close()


def test_config_validates_sim_settings_and_profile_defaults():
    with pytest.raises(ValueError, match="sim_profile"):
        EngineConfig(backend="sim", sim_profile="nope")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sim_speedup"):
            EngineConfig(backend="sim", sim_speedup=bad)
    engine = create_engine(EngineConfig(backend="sim", sim_profile="splitwise-h100-llama70b"))
    assert engine.info.num_blocks == engine.profile.num_blocks == 16384
    assert engine.profile.name == "splitwise-h100-llama70b"
