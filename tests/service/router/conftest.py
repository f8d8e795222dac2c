"""A mesh of fake workers and an in-process router on port 0 (see fakes.py).

The router serves its two listeners (services/router/listeners.py): `h.stub` is a
client of the public port (Generate, Cancel), `h.internal` of the internal one
(membership, ListWorkers, Stats)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from services.router.admission import AdmissionConfig
from services.router.circuit_breaker import BreakerConfig
from services.router.config import ModelSpec, RouterConfig, RouterSettings
from services.router.hedge import HedgeConfig
from services.router.listeners import RouterListeners
from services.router.migration import JourneyConfig
from services.router.outlier import OutlierConfig
from services.router.registry import WorkerRole
from services.router.retries import RetryAttachConfig
from services.router.retry_budget import RetryBudgetConfig
from services.router.router import Router
from services.router.worker_profile import WorkerProfileConfig
from tests.service.router.fakes import FakeDecode, FakePrefill

FAST = dict(
    health_interval_s=0.1,
    stats_interval_s=0.1,
    health_timeout_s=2.0,
    resubscribe_initial_s=0.01,
    resubscribe_max_s=0.1,
    dns_refresh_s=0,
    housekeeping_interval_s=3600,
    seed=0,
)


@dataclass
class RouterHandle:
    router: Router
    server: MeshServer  # the public listener
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterServiceStub
    listeners: RouterListeners
    internal_channel: grpc.aio.Channel
    internal: router_pb2_grpc.RouterServiceStub

    async def close(self) -> None:
        await self.channel.close()
        await self.internal_channel.close()
        await self.router.close()
        await self.listeners.stop()

    async def generate(self, prompt="hello", max_tokens=8, timeout=30, metadata=None, **fields: Any):
        """(deltas, final, call) of one Generate; raises AioRpcError on failure."""
        call = self.stub.Generate(request(prompt, max_tokens, **fields), timeout=timeout, metadata=metadata)
        deltas, final = [], None
        async for msg in call:
            if msg.HasField("delta"):
                deltas.append(msg.delta)
            else:
                final = msg.final
        return deltas, final, call

    def healthy_decode(self) -> int:
        return sum(r.healthy for r in self.router.registry.workers(WorkerRole.DECODE))


def connect(router: Router, listeners: RouterListeners, channel_to=grpc.aio.insecure_channel) -> RouterHandle:
    """A handle with a client channel to each of the router's listeners."""
    channel = channel_to(listeners.address)
    internal = channel_to(listeners.internal_address)
    return RouterHandle(
        router,
        listeners.public,
        channel,
        router_pb2_grpc.RouterServiceStub(channel),
        listeners,
        internal,
        router_pb2_grpc.RouterServiceStub(internal),
    )


def request(prompt="hello", max_tokens=8, **fields: Any) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **fields)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


async def read_all(call) -> list:
    """Read a stream started with `read()` to its end (iterators and read() may not mix)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


class Mesh:
    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.handles: list[RouterHandle] = []

    async def decode(self, worker_id: str, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> FakeDecode:
        w = FakeDecode(worker_id, **kw)
        await w.start(host, port)
        self.workers.append(w)
        return w

    async def prefill(self, worker_id: str, **kw: Any) -> FakePrefill:
        w = FakePrefill(worker_id, **kw)
        await w.start()
        self.workers.append(w)
        return w

    async def router(
        self,
        decode=(),
        prefill=(),
        *,
        clock=None,
        admission: AdmissionConfig | None = None,
        breaker: BreakerConfig | None = None,
        retry_budget: RetryBudgetConfig | None = None,
        journey: JourneyConfig | None = None,
        outlier: OutlierConfig | None = None,
        hedge: HedgeConfig | None = None,
        retry_attach: RetryAttachConfig | None = None,
        speed: WorkerProfileConfig | None = None,
        wait: bool = True,
        resolver=None,
        static=None,
        **router_kw: Any,
    ) -> RouterHandle:
        cfg = RouterConfig(
            decode_workers=tuple(static or (w.address for w in decode)),
            prefill_workers=tuple(w.address for w in prefill),
            **{**FAST, **router_kw},
        )
        settings = RouterSettings(
            server=ServerConfig(port=0, drain_grace_s=1),
            router=cfg,
            admission=admission or AdmissionConfig(),
            breaker=breaker or BreakerConfig(),
            retry_budget=retry_budget or RetryBudgetConfig(),
            journey=journey or JourneyConfig(),
            outlier=outlier or OutlierConfig(),
            hedge=hedge or HedgeConfig(),
            retry_attach=retry_attach or RetryAttachConfig(),
            speed=speed or WorkerProfileConfig(),
        )
        kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
        if resolver is not None:
            kwargs["resolver"] = resolver
        router = Router(settings, ModelSpec.load(cfg), **kwargs)
        listeners = RouterListeners(router)
        await listeners.start()
        await router.start()
        handle = connect(router, listeners)
        self.handles.append(handle)
        if wait:
            n = len(decode) + len(prefill)
            await router.wait_until(
                lambda: len(router.registry) == n and all(r.healthy for r in router.registry.workers())
            )
        return handle

    async def close(self) -> None:
        for h in self.handles:
            await h.close()
        for w in self.workers:
            await w.stop()


@pytest.fixture
async def mesh():
    m = Mesh()
    yield m
    await m.close()


def replace(cfg, **kw):
    return dataclasses.replace(cfg, **kw)
