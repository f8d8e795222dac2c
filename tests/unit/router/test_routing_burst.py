"""A burst of same-prefix requests through RequestFlow (fake decode calls, fake clock):
with the router's own load view it spreads by cost; with heartbeat load alone a
stale report makes every request of the burst pile onto the worker holding the
prefix. Entries leave the load view on first token / finish / failure / cancel."""

import asyncio
from collections import Counter

import grpc
import pytest

from pdmesh.v1 import common_pb2, decode_pb2
from services.common.errors import InvalidArgument
from services.model.hashing import block_hashes
from services.router.admission import AdmissionController
from services.router.admission_gate import AdmissionGate
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.cost import CostLedger
from services.router.generate import Cancelled, FlowRequest, RequestFlow, RoutingContext
from services.router.load_view import LoadView
from services.router.migration import JourneyConfig
from services.router.policy import WorkerLoad, make_policy
from services.router.prefix_index import PrefixIndex
from services.router.registry import WorkerInfo, WorkerRegistry, WorkerRole, WorkerSource
from services.router.retry_budget import RetryBudget
from tests.unit.router.fakes import FakeClock

BS = 16
WORKERS = ["w0", "w1", "w2", "w3"]
SHARED = list(range(1, 8 * BS + 1))  # 8 blocks every request of the burst shares


class HeldCall:
    """A decode call that sends what it is told to, when it is told to."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    async def _play(self):
        while True:
            item = await self.queue.get()
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            yield item
            if item.WhichOneof("chunk") == "final":
                return

    def __aiter__(self):
        return self._play()

    def cancel(self):
        self.cancelled = True
        return True


def tokens(*ids):
    return decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))


def final():
    return decode_pb2.DecodeServiceGenerateResponse(
        final=decode_pb2.DecodeFinal(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    )


class Mesh:
    def __init__(self, load_view: bool, ttl_s: float, decode_weight: float = 1.0):
        self.clock = FakeClock()
        # decode_weight 1 (Dynamo's) unless a test asks: the costs worked out below assume it.
        cfg = RouterConfig(
            policy="kv_aware",
            block_size=BS,
            optimistic_prefix_ttl_s=ttl_s,
            load_view=load_view,
            decode_weight=decode_weight,
        )
        breakers = BreakerRegistry(clock=self.clock)
        self.registry = WorkerRegistry(cfg.registry_config(), self.clock, available=breakers.is_available)
        for w in WORKERS:
            self.registry.join(
                WorkerInfo(w, f"{w}:1", WorkerRole.DECODE, "builtin-tiny", BS), WorkerSource.STATIC
            )
        self.index = PrefixIndex()
        # w0 already caches the shared prefix (a KV event said so).
        self.index.apply_stored("w0", None, block_hashes(SHARED, BS))
        self.view = LoadView() if load_view else None
        self.calls: list[HeldCall] = []
        self.ctx = RoutingContext(
            config=cfg,
            registry=self.registry,
            index=self.index,
            decode_policy=make_policy("kv_aware", cfg.policy_config()),
            prefill_policy=make_policy("kv_aware", cfg.policy_config()),
            breakers=breakers,
            budget=RetryBudget(clock=self.clock),
            ledger=CostLedger(),
            gate=AdmissionGate(AdmissionController(clock=self.clock), self.clock),
            journey_config=JourneyConfig(),
            call_decode=self._call,
            clock=self.clock,
            load_view=self.view,
        )
        self.tasks: list[asyncio.Task] = []
        self.flows: list[RequestFlow] = []

    def _call(self, worker, request, timeout):
        call = HeldCall()
        self.calls.append(call)
        return call

    def stale_reports(self):
        """Every worker reports idle load (as measured before the burst reached it)."""
        for w in WORKERS:
            self.registry.update_load(w, WorkerLoad())

    async def route(self, i: int) -> str:
        """Start request i (the shared prefix + 4 blocks of its own) until it is routed."""
        prompt = tuple(SHARED + [1000 + 100 * i + k for k in range(4 * BS)])
        flow = RequestFlow(self.ctx, FlowRequest(f"r{i}", prompt, common_pb2.SamplingParams(max_tokens=BS)))
        self.flows.append(flow)

        async def drain():
            async for _ in flow.run():
                pass

        self.tasks.append(asyncio.create_task(drain()))
        for _ in range(1000):
            if flow.worker_id:
                return flow.worker_id
            await asyncio.sleep(0)
        raise AssertionError("request was never routed")

    async def burst(self, n=8) -> Counter:
        placed = Counter()
        for i in range(n):
            placed[await self.route(i)] += 1
            self.stale_reports()
        return placed

    async def cancel_all(self):
        for f in self.flows:
            f.cancel()
        for t in self.tasks:
            with pytest.raises(Cancelled):
                await t


async def test_without_the_load_view_a_stale_report_piles_the_burst_onto_one_worker():
    """The cause, shown: the registry's pending blocks reset at every report."""
    mesh = Mesh(load_view=False, ttl_s=0)
    placed = await mesh.burst()
    assert placed == Counter({"w0": 8})
    await mesh.cancel_all()


async def test_with_the_load_view_the_burst_spreads_by_cost():
    mesh = Mesh(load_view=True, ttl_s=0)
    placed = await mesh.burst()
    # Cost (prefill_weight 1) = blocks to prefill + own queued prefill blocks + own decode
    # blocks. A request adds 4 prefill + 5 new blocks on w0 (prefix cached), 12 + 13 on
    # another worker. k-th on w0: 4 + 9 (k - 1); j-th elsewhere: 12 + 25 (j - 1). So
    # w0 takes requests 1, 5, 6, 7 (costs 4, 13, 22, 31 against 37), the others one each.
    assert placed["w0"] == 4 and len(placed) == 4 and sum(placed.values()) == 8
    await mesh.cancel_all()
    assert len(mesh.view) == 0
    assert all(mesh.view.own(w) == (0, 0) for w in WORKERS)
    assert all(mesh.registry.get(w).inflight == 0 for w in WORKERS)


async def test_with_the_routers_default_weights_the_burst_still_spreads():
    """decode_weight 0.1 (RouterConfig's default): the k-th request on w0 costs 4 + 4.5 (k - 1),
    the j-th elsewhere 12 + 13.3 (j - 1): w0 takes 1, 2, 6, 7, 8 and each other worker one."""
    assert RouterConfig().decode_weight == 0.1 and RouterConfig().load_view
    mesh = Mesh(load_view=True, ttl_s=0, decode_weight=RouterConfig().decode_weight)
    placed = await mesh.burst()
    assert placed == Counter({"w0": 5, "w1": 1, "w2": 1, "w3": 1})
    await mesh.cancel_all()
    assert len(mesh.view) == 0


async def test_with_optimistic_prefixes_later_requests_follow_the_routed_copies():
    mesh = Mesh(load_view=True, ttl_s=5.0)
    placed = await mesh.burst()
    assert len(placed) == 4 and max(placed.values()) < 8
    # Each worker a request was routed to now holds the shared prefix provisionally.
    overlaps = mesh.index.match(block_hashes(SHARED, BS))
    assert set(overlaps) == set(WORKERS)
    mesh.clock.advance(5.0)
    mesh.index.expire(mesh.clock())
    assert set(mesh.index.match(block_hashes(SHARED, BS))) == {"w0"}  # nobody confirmed
    await mesh.cancel_all()
    assert len(mesh.view) == 0


async def test_entries_end_on_first_token_finish_and_failure():
    mesh = Mesh(load_view=True, ttl_s=0)
    w_a = await mesh.route(0)
    w_b = await mesh.route(1)
    a, b = mesh.calls
    assert mesh.view.own(w_a)[0] == 4 * BS  # 4 uncached blocks on w0
    a.queue.put_nowait(tokens(7))
    for _ in range(1000):
        if mesh.view.own(w_a)[0] == 0:
            break
        await asyncio.sleep(0)
    assert mesh.view.own(w_a)[0] == 0 and mesh.view.own(w_a)[1] > 0  # prefill done, decode goes on
    a.queue.put_nowait(final())
    await mesh.tasks[0]
    assert mesh.view.own(w_a) == (0, 0) or w_a == w_b
    # b fails with a client-fault status: no retry, the request ends.
    b.queue.put_nowait(
        grpc.aio.AioRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "bad"
        )
    )
    with pytest.raises(InvalidArgument):
        await mesh.tasks[1]
    assert len(mesh.view) == 0
    assert all(mesh.view.own(w) == (0, 0) for w in WORKERS)
