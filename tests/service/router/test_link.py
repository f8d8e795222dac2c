"""DecodeService.Link, the multiplexed token path (issue 16 item 3), with its faults.

Real parts: decode workers are the real DecodeServicer on the sim engine (the
torch engine's scheduler, block pool and step thread with a modeled forward
pass; tokens a pure function of prompt and position), each on its own gRPC
server on loopback port 0, and the in-process router reaches them over real
gRPC. Every test checks each worker's pool is back to its free count.

- a worker whose server dies mid-stream: every request on its link migrates,
  token for token equal to an undisturbed run, and the request on the other
  worker is not disturbed (no migration, same tokens);
- a consumer that stops reading: its request is cancelled once its bounded
  buffer is full (RESOURCE_EXHAUSTED, the reason in the message), its blocks
  are freed, and the other request on the same link keeps streaming, both
  after the cut-off and while the stalled one is still buffering;
- cancel of one request on a shared link frees its blocks at once (Stats),
  the other continues;
- malformed frames: the worker ends only that link with INVALID_ARGUMENT, and
  the router drops only the link whose worker broke the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import aclosing

import grpc
import pytest

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2
from services.common.server import ServerConfig
from services.common.validation import RequestLimits
from services.decode.disagg_policy import DisaggConfig, DisaggregationPolicy
from services.decode.link_server import LinkServer
from services.decode.metrics import DecodeMetrics
from services.decode.servicer import DecodeServicer
from services.engine.config import EngineConfig
from services.router.attempt import DecodeAttempt
from services.router.generate import FlowFinal, FlowRequest, RequestFlow
from services.router.link import DecodeLink, LinkCall, RawDecodeLink
from services.worker.runtime import WorkerConfig, WorkerRuntime
from tests.support.cycles import CycleWatch
from tests.support.poll import eventually

BLOCKS = 512
LIMITS = RequestLimits(max_tokens_limit=100_000, max_prompt_tokens=1024)


class SimDecode:
    """A real decode worker (sim engine) on loopback; `kill()` drops its connections."""

    def __init__(
        self, worker_id: str, speedup: float = 20.0, raw: bool = False, generation: str = "", **engine_kw
    ):
        self.worker_id = worker_id
        self.raw = raw  # also serve the raw link port (WorkerInfo.link_port), as `pdmesh up` does
        self.link_server: LinkServer | None = None
        engine = EngineConfig(
            backend="sim", sim_speedup=speedup, num_blocks=BLOCKS, max_model_len=200_000, **engine_kw
        )
        self.rt = WorkerRuntime(
            "decode",
            "pdmesh.v1.DecodeService",
            ServerConfig(port=0, drain_grace_s=0),
            # accelerator_generation: what it registers ("" = the runtime's own: "sim")
            WorkerConfig(worker_id=worker_id, accelerator_generation=generation),
            engine,
        )
        self.address = ""
        self.alive = False

    async def start(self) -> SimDecode:
        await self.rt.setup()
        self.servicer = DecodeServicer(
            engine=self.rt.engine,
            policy=DisaggregationPolicy(DisaggConfig()),
            remote=None,
            metrics=DecodeMetrics(self.rt.registry),
            limits=LIMITS,
            worker_info=self.rt.info(),
            static_candidates=[],
            draining=self.rt.server.drain_started,
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, self.rt.server.server)
        if self.raw:
            self.link_server = LinkServer(self.servicer.link_session, self.rt.server, "127.0.0.1", 0)
            self.rt.link_port = self.servicer.info.link_port = await self.link_server.start()
            self.rt.on_shutdown.append(self.link_server.close)
        await self.rt.server.start()
        await self.rt.server.set_ready(True)
        self.address = self.rt.address
        self.alive = True
        return self

    def free(self) -> int:
        return self.rt.engine.stats().free_blocks

    def running(self) -> int:
        s = self.rt.engine.stats()
        return s.running + s.waiting

    async def kill(self) -> None:
        """The server goes away at once (grace 0): every connection breaks."""
        self.alive = False
        if self.link_server is not None:
            await self.link_server.close()
        await self.rt.server.server.stop(0)

    async def close(self) -> None:
        if self.alive:
            await self.rt.server.stop()
        await self.rt.shutdown()


@pytest.fixture(params=["grpc", "raw"])
async def sims(request):
    """Workers whose link is Link over gRPC, or the raw link port (the default of a real worker)."""
    made: list[SimDecode] = []
    raw = request.param == "raw"

    async def make(worker_id: str, **kw) -> SimDecode:
        w = await SimDecode(worker_id, raw=raw, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.close()


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=1)


def prompt(i: int) -> tuple[int, ...]:
    return tuple(40 + (i * 37 + k * 11) % 200 for k in range(24 + i))


async def run_flow(
    router, rid: str, p, max_tokens: int, out: list[int] | None = None
) -> tuple[list[int], FlowFinal]:
    flow = RequestFlow(router.ctx, FlowRequest(rid, p, greedy(max_tokens), timeout_s=60))
    router.flows[rid] = flow
    got = [] if out is None else out
    final = None
    try:
        async with aclosing(flow.run()) as items:
            async for item in items:
                if isinstance(item, FlowFinal):
                    final = item
                else:
                    got.extend(item)
    finally:
        router.flows.pop(rid, None)
    assert final is not None
    return got, final


def links_of(router) -> dict[str, DecodeLink]:
    out = {}
    for conn in router.pool.connections():
        link = conn._link
        if link is not None and conn.worker_id is not None:
            out[conn.worker_id] = link
    return out


async def test_the_router_uses_one_link_per_worker_for_concurrent_requests(mesh, sims):
    w = await sims("d0")
    h = await mesh.router(decode=[w], policy="round_robin")
    free = w.free()
    results = await asyncio.gather(*(run_flow(h.router, f"r{i}", prompt(i), 40) for i in range(6)))
    assert all(len(toks) == 40 and f.migrations == 0 for toks, f in results)
    links = links_of(h.router)
    assert list(links) == ["d0"] and links["d0"].alive and links["d0"].open_requests == 0
    assert isinstance(links["d0"], RawDecodeLink) is w.raw  # the worker's offer was taken
    assert not h.router.pool.connections()[0].link_unsupported
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_dead_worker_migrates_every_request_on_its_link_token_exact(mesh, sims):
    a, b = await sims("a"), await sims("b")
    h = await mesh.router(decode=[a, b], policy="round_robin")
    free_b = b.free()
    n = 200
    # The undisturbed runs (the sim's tokens depend on prompt and position only).
    want = {i: (await run_flow(h.router, f"ref{i}", prompt(i), n))[0] for i in range(5)}
    partial: dict[int, list[int]] = {i: [] for i in range(5)}
    tasks = {i: asyncio.create_task(run_flow(h.router, f"r{i}", prompt(i), n, partial[i])) for i in range(5)}
    await eventually(
        lambda: all(len(v) >= 5 for v in partial.values()), what="every stream under way", timeout=30
    )
    on_a = [rid for rid, f in h.router.flows.items() if f.worker_id == "a"]
    on_b = [rid for rid, f in h.router.flows.items() if f.worker_id == "b"]
    assert on_a and on_b
    await a.kill()
    done = {i: await t for i, t in tasks.items()}
    for i, (toks, final) in done.items():
        assert toks == want[i], f"request {i}"
        if f"r{i}" in on_a:
            assert final.migrations == 1 and final.worker_id == "b"
        else:
            assert final.migrations == 0 and final.worker_id == "b"  # undisturbed
    await eventually(lambda: b.free() == free_b, what="b's pool back to its free count", timeout=30)


async def test_a_consumer_that_stops_reading_is_cancelled_and_the_link_keeps_streaming(mesh, sims):
    w = await sims("d0")
    h = await mesh.router(decode=[w], max_buffered_tokens=64)
    free = w.free()
    slow = RequestFlow(h.router.ctx, FlowRequest("slow", prompt(1), greedy(5_000), timeout_s=60))
    items = slow.run()
    first = await anext(items)  # then stop reading: the flow waits at its yield
    assert isinstance(first, list)
    await eventually(
        lambda: slow._attempt is None or slow._attempt.done, what="the slow request cut off", timeout=30
    )
    await eventually(lambda: w.running() == 0, what="its request ended on the worker", timeout=30)
    toks, final = await run_flow(h.router, "fast", prompt(2), 300)  # the same link
    assert len(toks) == 300 and final.migrations == 0
    with pytest.raises(Exception) as err:
        async for _ in items:
            pass
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "stopped reading" in str(err.value) and "limit 64" in str(err.value)
    await items.aclose()
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_stalled_consumer_does_not_hold_back_the_other_request_on_its_link(mesh, sims):
    # Both requests share the link and the engine batch (one token each per step), so
    # the fast one's 200 tokens are all out while the stalled one has buffered about as
    # many, far under its bound: the link delivered to one while the other's buffer filled.
    w = await sims("d0")
    h = await mesh.router(decode=[w], max_buffered_tokens=5_000)
    free = w.free()
    slow = RequestFlow(h.router.ctx, FlowRequest("slow", prompt(1), greedy(6_000), timeout_s=60))
    items = slow.run()
    first = await anext(items)  # then stop reading
    assert isinstance(first, list)
    toks, final = await run_flow(h.router, "fast", prompt(2), 200)
    assert len(toks) == 200 and final.migrations == 0
    attempt = slow._attempt
    assert attempt is not None and not attempt.done, "the stalled request was cut off before the other ended"
    assert 0 < len(attempt._tokens) < 5_000  # it was buffering meanwhile
    assert list(links_of(h.router)) == ["d0"]  # one link carried both
    await eventually(
        lambda: slow._attempt is None or slow._attempt.done, what="the stalled request cut off", timeout=60
    )
    with pytest.raises(Exception) as err:
        async for _ in items:
            pass
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 5000" in str(err.value)
    await items.aclose()
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_cancel_on_a_shared_link_frees_the_blocks_at_once(mesh, sims):
    w = await sims("d0", speedup=5.0)
    h = await mesh.router(decode=[w])
    free = w.free()
    stub = decode_pb2_grpc.DecodeServiceStub(h.router.pool.connections()[0].channel)
    keep: list[int] = []
    other = asyncio.create_task(run_flow(h.router, "keep", prompt(3), 400, keep))
    got: list[int] = []
    victim = asyncio.create_task(run_flow(h.router, "victim", prompt(4), 5_000, got))
    await eventually(lambda: len(got) >= 3 and len(keep) >= 3, what="both streaming", timeout=30)
    assert links_of(h.router)["d0"].open_requests == 2
    used = (await stub.Stats(worker_pb2.StatsRequest())).info.free_blocks
    h.router.cancel("victim")
    with pytest.raises(Exception) as err:
        await victim
    assert err.value.code is grpc.StatusCode.CANCELLED

    async def freed() -> bool:
        s = await stub.Stats(worker_pb2.StatsRequest())
        return s.load.running == 1 and s.info.free_blocks > used

    await eventually(freed, what="the cancelled request's blocks freed while the other runs", timeout=30)
    assert not other.done()
    toks, final = await other
    assert len(toks) == 400 and final.migrations == 0
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_draining_worker_finishes_the_requests_on_its_link_then_ends_it(mesh, sims):
    w = await sims("d0", speedup=5.0)
    h = await mesh.router(decode=[w])
    free = w.free()
    got: list[int] = []
    req = asyncio.create_task(run_flow(h.router, "r", prompt(5), 300, got))
    await eventually(lambda: len(got) >= 3, what="the request streaming", timeout=30)
    drain = asyncio.create_task(w.rt.server.drain(grace_s=60))
    toks, final = await req
    assert len(toks) == 300 and final.migrations == 0  # finished where it ran, not moved
    await asyncio.wait_for(
        drain, 30
    )  # the link ended once its request did: the drain did not wait out its grace
    w.alive = False
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_the_worker_ends_only_a_link_with_a_malformed_frame(sims):
    w = await sims("d0")
    free = w.free()
    ch = grpc.aio.insecure_channel(w.address)
    stub = decode_pb2_grpc.DecodeServiceStub(ch)
    try:
        good = stub.Link()
        await good.write(
            decode_pb2.DecodeServiceLinkRequest(
                open=decode_pb2.LinkOpen(
                    link_id=1,
                    request=decode_pb2.DecodeServiceGenerateRequest(
                        request_id="g", prompt_token_ids=prompt(1), sampling=greedy(5_000)
                    ),
                )
            )
        )
        assert (await good.read()).tokens[0].link_id == 1
        open1 = decode_pb2.DecodeServiceLinkRequest(
            open=decode_pb2.LinkOpen(
                link_id=7,
                request=decode_pb2.DecodeServiceGenerateRequest(
                    request_id="m", prompt_token_ids=prompt(2), sampling=greedy(5_000)
                ),
            )
        )
        for bad in (
            [decode_pb2.DecodeServiceLinkRequest()],  # no frame kind
            [decode_pb2.DecodeServiceLinkRequest(open=decode_pb2.LinkOpen(link_id=0))],
            [open1, open1],  # an id already open
        ):
            call = stub.Link()
            for f in bad:
                await call.write(f)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        # A bad request (not a bad frame) ends only that request, with its status.
        await good.write(
            decode_pb2.DecodeServiceLinkRequest(
                open=decode_pb2.LinkOpen(
                    link_id=2,
                    request=decode_pb2.DecodeServiceGenerateRequest(request_id="e", sampling=greedy(4)),
                )
            )
        )
        while True:
            frame = await good.read()
            ends = [e for e in frame.ends if e.link_id == 2]
            if ends:
                break
        assert ends[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        # The good link streams on through all of that.
        n = sum(len(t.token_ids) for t in (await good.read()).tokens if t.link_id == 1)
        assert n >= 1
        await good.write(decode_pb2.DecodeServiceLinkRequest(cancel=decode_pb2.LinkCancel(link_id=1)))
        await good.done_writing()
        while await good.read() is not grpc.aio.EOF:
            pass
        assert await good.code() is grpc.StatusCode.OK
    finally:
        await ch.close()
    await eventually(
        lambda: w.free() == free and w.running() == 0, what="the pool back to its free count", timeout=30
    )


class Sink:
    """What a LinkCall feeds (services/router/link.py `Sink`), recording it."""

    def __init__(self):
        self.tokens, self.final, self.error = [], None, None
        self.done = asyncio.Event()

    def push_tokens(self, ids):
        self.tokens.extend(ids)

    def push_final(self, final):
        self.final = final
        self.done.set()

    def push_error(self, error):
        self.error = error
        self.done.set()


async def only_the_bad_link_breaks(bad_link: DecodeLink, good_link: DecodeLink) -> None:
    """Open the same request on both links: the one whose worker broke the protocol fails it
    over (UNAVAILABLE, retryable) and is dropped; the other serves it whole and stays up."""
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id="q", prompt_token_ids=prompt(1), sampling=greedy(20)
    )
    bad, good = Sink(), Sink()
    bad_link.open(req, 30).attach(bad)
    good_link.open(req, 30).attach(good)
    await asyncio.wait_for(asyncio.gather(bad.done.wait(), good.done.wait()), 30)
    assert bad.error is not None and bad.error.code is grpc.StatusCode.UNAVAILABLE and bad.error.retryable
    assert "broke the link protocol" in bad.error.details and not bad_link.alive
    assert good.final is not None and len(good.tokens) == 20 and good_link.alive


class BadLinkDecode(decode_pb2_grpc.DecodeServiceServicer):
    """A STAND-IN worker that breaks the protocol: an end for an id it was never given."""

    async def Link(self, request_iterator, context):
        async for _ in request_iterator:
            yield decode_pb2.DecodeServiceLinkResponse(
                ends=[decode_pb2.LinkEnd(link_id=999, error=decode_pb2.LinkStatus(code=2))]
            )


async def test_the_router_drops_only_the_link_whose_worker_broke_the_protocol(sims):
    from services.common.server import MeshServer

    w = await sims("d0")
    free = w.free()
    server = MeshServer(ServerConfig(port=0, drain_grace_s=0), "pdmesh.v1.DecodeService")
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(BadLinkDecode(), server.server)
    await server.start()
    chans = [grpc.aio.insecure_channel(a) for a in (server.address, w.address)]
    try:
        links = []
        for ch in chans:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)
            links.append(DecodeLink("x", stub.Link, lambda r, t, s=stub: s.Generate(r, timeout=t)))
        await only_the_bad_link_breaks(*links)
        for link in links:
            await link.close()
    finally:
        for ch in chans:
            await ch.close()
        await server.stop()
    await eventually(lambda: w.free() == free, what="the pool back to its free count", timeout=30)


async def test_a_finished_request_leaves_nothing_in_a_cycle(mesh, sims):
    """The attempt, its link call and its flow are freed by reference counting, not left
    for the garbage collector (tests/support/cycles.py): done, cancelled and migrated."""
    a = await sims("a")
    h = await mesh.router(decode=[a], policy="round_robin")
    free = a.free()
    await run_flow(h.router, "warm", prompt(1), 4)
    with CycleWatch() as watch:
        for i in range(5):
            await run_flow(h.router, f"r{i}", prompt(i), 8)
        task = asyncio.create_task(run_flow(h.router, "cut", prompt(7), 4000))
        await eventually(lambda: "cut" in h.router.flows, what="the long request running", timeout=30)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(lambda: not h.router.flows, what="every flow ended", timeout=30)
        h.router.outliers.evaluate()  # its live view lets go of the ended attempts
    assert watch.left(RequestFlow, DecodeAttempt, LinkCall) == []
    await eventually(lambda: a.free() == free, what="the pool back to its free count", timeout=30)
