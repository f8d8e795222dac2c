"""A cached prefix held on one engine and pulled into another's prefix cache (issue 17 item 3),
in-process: hold_prefix on the holder, reserve_external + import + commit_prefix on the puller."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from services.engine.api import EngineRequest, SamplingParams
from services.engine.async_engine import TorchEngine
from services.engine.model_runner import ModelRunner
from tests.unit.engine.conftest import prompt_of, request, tiny_config


def prefix_req(rid: str, tokens) -> EngineRequest:
    return EngineRequest(rid, list(tokens), SamplingParams(max_tokens=1))


def test_holder_holds_only_cached_blocks_and_release_frees_them(make_engine):
    holder = make_engine()
    shared = prompt_of(80, seed=1)  # 5 blocks of 16
    holder.generate([request("warm", shared + prompt_of(7, seed=2), max_tokens=2)])
    computed = holder.stats().prompt_tokens_computed
    # Ask for 7 blocks: only the 5 cached come back, and nothing is computed.
    held = holder.hold_prefix(prefix_req("p", shared + prompt_of(40, seed=3)))
    assert held is not None and held.num_tokens == 80 and len(held.block_ids) == 5
    assert holder.stats().held_blocks == 5
    assert holder.stats().prompt_tokens_computed == computed
    # Held blocks are out of the free queue: a pool-filling request cannot evict them.
    assert holder.stats().free_blocks == holder.info.num_blocks - 5
    assert holder.release("p") and not holder.release("p")
    assert holder.prefix_lookup(shared) == 80  # still cached after the release


def test_nothing_cached_holds_nothing(make_engine):
    holder = make_engine()
    assert holder.hold_prefix(prefix_req("p", prompt_of(64, seed=9))) is None
    assert holder.stats().held_blocks == 0


def test_pulled_prefix_becomes_a_cache_hit_with_the_same_tokens(make_engine):
    shared = prompt_of(96, seed=4)
    req = request("r", shared + prompt_of(13, seed=5), max_tokens=12)
    want = make_engine().generate([req])["r"]
    holder, puller = make_engine(), make_engine()
    holder.generate([request("warm", shared + prompt_of(3, seed=6), max_tokens=2)])
    held = holder.hold_prefix(prefix_req("lease", req.prompt_token_ids))
    assert held is not None and held.num_tokens == 96
    res = puller.reserve_external(prefix_req("r/pull", req.prompt_token_ids[: held.num_tokens]))
    puller.import_blocks(res.transfer_block_ids, holder.export_blocks(held.block_ids), held.layout)
    holder.release("lease")
    assert puller.commit_prefix("r/pull") == 96
    assert puller.prefix_lookup(req.prompt_token_ids) == 96
    assert puller.stats().prompt_tokens_transferred == 96
    computed = puller.stats().prompt_tokens_computed
    assert puller.generate([req])["r"] == want
    # Only the 13 uncached tokens were prefilled (plus 11 decode steps).
    assert puller.stats().prompt_tokens_computed - computed == 13


class GatedRunner(ModelRunner):
    """A ModelRunner whose forward pass waits for `gate` once `closed` is set (a long step)."""

    closed = threading.Event()
    entered = threading.Event()
    gate = threading.Event()

    @classmethod
    def reset(cls) -> None:
        """Open, not entered, gate shut: each test starts from here (the events are shared)."""
        cls.closed.clear()
        cls.entered.clear()
        cls.gate.clear()

    def run(self, scheduled):
        if GatedRunner.closed.is_set():
            GatedRunner.entered.set()
            GatedRunner.gate.wait(60)
        return super().run(scheduled)


@contextlib.asynccontextmanager
async def mid_pass(warm_prefix=None):
    """A started engine whose step thread is stuck in a forward pass (a long step) for the body;
    afterwards the pass ends, the busy request finishes and every block must be free."""
    GatedRunner.reset()
    engine = TorchEngine(tiny_config(), runner_factory=GatedRunner)
    await engine.start()
    try:
        if warm_prefix is not None:
            async for _ in engine.generate(request("warm", [*warm_prefix, 1], max_tokens=1)):
                pass
        GatedRunner.closed.set()
        stream = engine.generate(request("busy", prompt_of(40, seed=8), max_tokens=4))
        step = asyncio.ensure_future(anext(stream))
        await asyncio.to_thread(GatedRunner.entered.wait, 30)  # the step thread is mid-pass
        yield engine
        GatedRunner.closed.clear()
        GatedRunner.gate.set()
        await step
        async for _ in stream:
            pass
        await engine.sync()
        assert engine.stats().held_blocks == 0 and engine.stats().free_blocks == engine.info.num_blocks
    finally:
        GatedRunner.gate.set()
        await engine.close()


async def test_a_busy_holder_leases_without_waiting_for_its_step_to_end():
    shared = prompt_of(64, seed=7)
    async with mid_pass(warm_prefix=shared) as engine:
        # Before the fix the hold was a step-thread command: it waited for the pass (the gate).
        held = await asyncio.wait_for(engine.hold_prefix(prefix_req("lease", shared)), 30)
        assert held is not None and held.num_tokens == 64
        assert engine.release("lease")


async def test_a_busy_puller_reserves_without_waiting_for_its_step_to_end():
    """The puller's reservation (and a remote prefill's) was a step-thread command: on a loaded
    worker it waited for the pass in progress, time the router's pull price never counted."""
    async with mid_pass() as engine:
        res = await asyncio.wait_for(engine.reserve_external(prefix_req("pull", prompt_of(64, seed=9))), 30)
        assert len(res.block_ids) == 4 and res.num_cached_tokens == 0
        engine.cancel_external("pull")


async def test_a_reservation_cancelled_while_its_thread_runs_is_undone():
    async with mid_pass() as engine:
        with engine._started().mutex:  # the reservation's thread waits for it: cancel meanwhile
            job = asyncio.ensure_future(engine.reserve_external(prefix_req("pull", prompt_of(64, seed=9))))
            await asyncio.sleep(0)
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
    # mid_pass checked every block free: the late reservation was cancelled once made
