"""RequestFlow driven directly with fake decode calls (no gRPC): coalescing, no
delay for lone tokens, cost accounting, cancellation."""

import asyncio

import pytest

from pdmesh.v1 import common_pb2, decode_pb2
from services.router.admission import AdmissionController
from services.router.admission_gate import AdmissionGate
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.cost import CostLedger
from services.router.generate import Cancelled, FlowFinal, FlowRequest, RequestFlow, RoutingContext
from services.router.migration import JourneyConfig
from services.router.policy import make_policy
from services.router.prefix_index import PrefixIndex
from services.router.registry import WorkerInfo, WorkerRegistry, WorkerRole, WorkerSource
from services.router.retry_budget import RetryBudget
from tests.unit.router.fakes import FakeClock


def tokens(*ids):
    return decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))


def final(computed):
    usage = common_pb2.Usage(computed_tokens=computed)
    return decode_pb2.DecodeServiceGenerateResponse(
        final=decode_pb2.DecodeFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage)
    )


class FakeCall:
    """Plays a script: messages, or asyncio.Events to wait on between them."""

    def __init__(self, *script):
        self.script = script
        self.cancelled = False

    async def _play(self):
        for item in self.script:
            if isinstance(item, asyncio.Event):
                await item.wait()
            else:
                yield item

    def __aiter__(self):
        return self._play()

    def cancel(self):
        self.cancelled = True
        return True


def make_flow(call, max_tokens=5):
    clock = FakeClock()
    cfg = RouterConfig(policy="round_robin")
    breakers = BreakerRegistry(clock=clock)
    registry = WorkerRegistry(cfg.registry_config(), clock, available=breakers.is_available)
    registry.join(WorkerInfo("w1", "w1:1", WorkerRole.DECODE, "builtin-tiny", 16), WorkerSource.STATIC)
    ledger = CostLedger()
    ctx = RoutingContext(
        config=cfg,
        registry=registry,
        index=PrefixIndex(),
        decode_policy=make_policy("round_robin"),
        prefill_policy=make_policy("round_robin"),
        breakers=breakers,
        budget=RetryBudget(clock=clock),
        ledger=ledger,
        gate=AdmissionGate(AdmissionController(clock=clock), clock),
        journey_config=JourneyConfig(),
        call_decode=lambda worker, request, timeout: call,
        clock=clock,
    )
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    return RequestFlow(ctx, FlowRequest("r1", (1, 2, 3), sampling)), ledger


async def test_tokens_ready_together_leave_as_one_message():
    flow, ledger = make_flow(FakeCall(tokens(1), tokens(2), tokens(3), tokens(4), tokens(5), final(8)))
    out = [item async for item in flow.run()]
    assert out[0] == [1, 2, 3, 4, 5]
    assert isinstance(out[1], FlowFinal) and out[1].computed_tokens == 8 and len(out) == 2
    assert ledger.stats().requests_succeeded == 1 and ledger.stats().computed_tokens == 8


async def test_a_lone_token_is_not_held_back_to_batch_it():
    later = asyncio.Event()
    flow, _ = make_flow(FakeCall(tokens(1), later, tokens(2), final(5)), max_tokens=2)
    gen = flow.run()
    assert await gen.__anext__() == [1]  # delivered while token 2 does not exist yet
    later.set()
    assert await gen.__anext__() == [2]
    assert isinstance(await gen.__anext__(), FlowFinal)


async def test_cancel_stops_the_downstream_call_at_once():
    never = asyncio.Event()
    call = FakeCall(tokens(1), never)
    flow, ledger = make_flow(call)
    gen = flow.run()
    assert await gen.__anext__() == [1]
    flow.cancel()
    assert call.cancelled
    with pytest.raises(Cancelled):
        await gen.__anext__()
    assert ledger.stats().requests_cancelled == 1
    assert flow.ctx.gate.controller.inflight == 0
