"""TorchEngine: the Engine protocol over the step thread."""

from __future__ import annotations

import asyncio

import pytest

from services.engine.api import (
    Engine,
    EngineError,
    FinishReason,
    InvalidRequestError,
    KvEventKind,
    UnknownRequestError,
)
from services.engine.async_engine import TorchEngine
from services.engine.config import EngineConfig
from services.engine.factory import create_engine
from services.engine.llm_engine import LLMEngine
from tests.unit.engine.conftest import prompt_of, request, tiny_config


@pytest.fixture
async def make_async():
    engines: list[TorchEngine] = []

    async def make(**overrides) -> TorchEngine:
        engine = create_engine(tiny_config(**overrides))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if not engine._closed:
            await engine.sync()
            stats = engine.stats()
            assert (stats.running, stats.waiting, stats.held_blocks) == (0, 0, 0)
            assert stats.free_blocks == stats.total_blocks
            await engine.close()


async def collect(stream) -> tuple[list[int], list]:
    outs = [o async for o in stream]
    return [t for o in outs for t in o.token_ids], outs


def reference(reqs) -> dict[str, list[int]]:
    return LLMEngine(tiny_config(enable_prefix_caching=False)).generate(reqs)


async def test_concurrent_streams_equal_the_sync_core(make_async):
    engine = await make_async()
    assert isinstance(engine, Engine) and engine.info.backend == "torch"
    reqs = [
        request(f"g{i}", prompt_of(10 + 13 * i, seed=i), max_tokens=10 + i, temperature=0.7, seed=i)
        for i in range(6)
    ]
    results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
    assert {r.request_id: tokens for r, (tokens, _) in zip(reqs, results, strict=True)} == reference(reqs)
    for _, outs in results:
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert outs[0].num_prompt_tokens > 0


async def test_abort_mid_stream_frees_every_block(make_async):
    engine = await make_async()
    total = engine.stats().total_blocks
    stream = engine.generate(request("a", prompt_of(60, seed=1), max_tokens=500))
    first = await anext(stream)
    assert first.token_ids and engine.stats().free_blocks < total
    assert engine.abort("a") and not engine.abort("nope")
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
    await engine.sync()
    assert engine.stats().free_blocks == total
    assert not engine.abort("a")


async def test_closing_or_cancelling_the_consumer_aborts(make_async):
    engine = await make_async()
    stream = engine.generate(request("closed", prompt_of(30, seed=2), max_tokens=500))
    await anext(stream)
    await stream.aclose()

    streaming = asyncio.Event()

    async def consume():
        async for _ in engine.generate(request("cancelled", prompt_of(30, seed=3), max_tokens=500)):
            streaming.set()

    task = asyncio.create_task(consume())
    await streaming.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.sync()
    assert engine.stats().free_blocks == engine.stats().total_blocks


async def test_remote_prefill_handover_between_two_engines(make_async):
    prefill, decode = await make_async(), await make_async()
    req = request("h", prompt_of(45, seed=4), max_tokens=18, temperature=0.8, seed=9)
    result = await prefill.prefill(req)
    assert not result.finished and result.held.num_tokens == 45 and result.computed_tokens == 45
    res = await decode.reserve_external(req)
    kv = await prefill.export_blocks(result.held.block_ids[res.first_transfer_block :])
    await decode.import_blocks(res.transfer_block_ids, kv, result.held.layout)
    assert prefill.release("h") and not prefill.release("h")
    tokens, outs = await collect(decode.generate_external("h", result.first_token_id))
    assert tokens == reference([req])["h"]
    assert outs[0].token_ids[0] == result.first_token_id
    assert decode.stats().prompt_tokens_transferred == 45


async def test_cancelled_prefill_and_reservation_free_everything(make_async):
    engine = await make_async()
    task = asyncio.create_task(engine.prefill(request("p", prompt_of(200, seed=5), max_tokens=4)))
    await asyncio.sleep(0)  # let the task submit the request and await its result
    assert "p" in engine._prefills
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    res = await engine.reserve_external(request("r", prompt_of(40, seed=6), max_tokens=4))
    assert len(res.block_ids) == 3
    engine.cancel_external("r")
    with pytest.raises(UnknownRequestError):
        engine.generate_external("r", 1)


async def test_prefill_whose_first_token_finishes_holds_nothing(make_async):
    engine = await make_async()
    result = await engine.prefill(request("one", prompt_of(20, seed=7), max_tokens=1))
    assert result.finished and result.held is None and not engine.release("one")


async def test_bad_requests_raise_at_the_call(make_async):
    engine = await make_async()
    with pytest.raises(InvalidRequestError):
        engine.generate(request("bad", [1] * 5000))
    with pytest.raises(InvalidRequestError):
        await engine.prefill(request("bad", [1], temperature=5.0))
    stream = engine.generate(request("dup", prompt_of(8, seed=1), max_tokens=3))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.generate(request("dup", [1]))
    await collect(stream)


async def test_kv_events_wake_subscribers(make_async):
    engine = await make_async()
    seq, pairs = engine.kv_snapshot()
    assert (seq, pairs) == (0, [])
    waiter = asyncio.create_task(engine.wait_kv_events(seq))
    await asyncio.sleep(0)
    assert not waiter.done()
    await collect(engine.generate(request("e", prompt_of(40, seed=8), max_tokens=2)))
    await asyncio.wait_for(waiter, timeout=30)
    events = engine.kv_events_since(seq)
    assert events[0].kind is KvEventKind.STORED and len(events[0].block_hashes) == 2
    assert engine.prefix_lookup(prompt_of(40, seed=8)) == 32


async def test_close_ends_streams_with_abort():
    engine = create_engine(tiny_config())
    with pytest.raises(EngineError, match="not started"):
        engine.stats()
    await engine.start()
    stream = engine.generate(request("c", prompt_of(20, seed=9), max_tokens=1000))
    await anext(stream)
    await engine.close()
    rest = [o async for o in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    with pytest.raises(EngineError):
        engine.generate(request("after", [1]))
    assert engine.kv_pool() is None


def test_factory_and_config_validation():
    assert isinstance(create_engine(EngineConfig()), TorchEngine)
    with pytest.raises(ValueError, match="model-path"):  # sim: tests/unit/sim; trtllm: tests/unit/trtllm
        create_engine(EngineConfig(backend="trtllm"))
    for bad in (
        {"backend": "x"},
        {"dtype": "int8"},
        {"preset": "huge"},
        {"block_size": 0},
        {"num_blocks": -1},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="context"):
        TorchEngine(EngineConfig(max_model_len=10**6))


async def test_a_request_blocked_by_held_kv_runs_once_released(make_async):
    engine = await make_async(num_blocks=8)  # 128 tokens of KV
    held = await engine.prefill(request("held", prompt_of(100, seed=1), max_tokens=4))
    assert engine.stats().held_blocks == 7
    req = request("late", prompt_of(40, seed=2), max_tokens=6)
    task = asyncio.create_task(collect(engine.generate(req)))
    await engine.sync()
    assert engine.stats().waiting == 1 and not task.done()  # the step thread waits for a change
    assert held.held is not None and engine.release("held")
    tokens, _ = await task
    assert tokens == reference([req])["late"]


async def test_a_bug_in_the_step_fails_every_caller_instead_of_hanging():
    engine = create_engine(tiny_config())
    await engine.start()

    def broken_step():
        raise RuntimeError("boom")

    engine._core.step = broken_step
    with pytest.raises(EngineError, match="step loop failed") as err:
        await collect(engine.generate(request("x", [1, 2, 3], max_tokens=3)))
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(EngineError, match="step loop failed"):
        engine.generate(request("y", [1]))
    assert not engine.release("x") and not engine.abort("x")
    await engine.close()


async def test_a_diverted_stream_hands_its_outputs_to_the_sink_and_ends_on_its_iterator(make_async):
    engine = await make_async()
    reqs = [
        request(f"d{i}", prompt_of(12 + 7 * i, seed=i), max_tokens=12, temperature=0.7, seed=i)
        for i in range(3)
    ]
    assert not engine.divert("nobody", lambda out: None)

    async def diverted(req):
        stream = engine.generate(req)
        first = await anext(stream)
        sunk: list = []
        while not engine.divert(req.request_id, sunk.append):  # outputs not taken yet: take one
            first_more = await anext(stream)
            first.token_ids.extend(first_more.token_ids)
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished  # only the last output comes through the iterator
        assert sunk and not any(o.finished for o in sunk)
        return [*first.token_ids, *(t for o in sunk for t in o.token_ids), *rest[0].token_ids]

    got = await asyncio.gather(*(diverted(r) for r in reqs))
    assert {r.request_id: tokens for r, tokens in zip(reqs, got, strict=True)} == reference(reqs)


async def test_a_sink_that_raises_ends_its_stream_and_frees_its_blocks(make_async):
    engine = await make_async()
    other = engine.generate(request("other", prompt_of(20, seed=5), max_tokens=30))
    stream = engine.generate(request("bad", prompt_of(20, seed=4), max_tokens=300))
    await anext(stream)

    def sink(out):
        raise RuntimeError("a consumer's bug")

    while not engine.divert("bad", sink):
        await anext(stream)
    with pytest.raises(EngineError, match="sink failed") as e:
        async for _ in stream:
            pass
    assert isinstance(e.value.__cause__, RuntimeError)
    tokens, outs = await collect(other)  # the delivery went on for the others
    assert outs[-1].finished and len(tokens) == 30
