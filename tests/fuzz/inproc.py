"""The real mesh in this process, on port 0, for the fuzzers.

kvtransfer + one prefill worker (PrefillService and KvSourceService) + one
decode worker + a router in front of them, each a real servicer on its own
MeshServer, wired the way the mains wire them (tiny built-in model, one torch
thread, KV over the gRPC transport so KvSource is really read). They all run
on one asyncio loop in a background thread, so the tests can be plain
synchronous hypothesis tests with blocking gRPC clients and module-scoped
fixtures; the loop thread is this module's only owner of the servers.

`Snapshot` is what must come back after every fuzzed call: the engines'
free/running/waiting counts, the prefill worker's held leases and the
router's in-flight/queued counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.layout import layout_to_proto
from kvtransfer.leases import LeaseKeeper, LeaseManager
from kvtransfer.pool import PoolView
from pdmesh.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.decode.disagg_policy import Candidate, DisaggConfig, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import PrefillLoadProbe
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.engine.config import EngineConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME as KV_SERVICE
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.stats import TransferStatistics
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.router.config import ModelSpec, RouterConfig, RouterSettings
from services.router.listeners import RouterListeners, public_message_bytes
from services.router.router import Router
from services.router.servicer import SERVICE_NAME as ROUTER_SERVICE
from services.worker.runtime import WorkerConfig, WorkerRuntime

# Fuzzed requests may ask for up to this many tokens: enough to reach every
# check, small enough that a valid request finishes well inside its deadline.
LIMITS = RequestLimits(max_tokens_limit=64, max_prompt_tokens=1024)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
ENGINE = EngineConfig(preset="tiny", num_threads=1, num_blocks=256, max_model_len=1100)


@dataclass(frozen=True)
class Snapshot:
    decode_free: int
    decode_running: int
    decode_waiting: int
    prefill_free: int
    prefill_running: int
    prefill_waiting: int
    leases_held: int
    lease_blocks: int
    router_inflight: int
    router_queued: int
    decode_dispatched_tokens: int  # prompt tokens the decode worker counts as at a prefill worker


class InProcessMesh:
    """Owns the loop thread and every server on it; `close()` stops them all."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-mesh", daemon=True)
        self._thread.start()
        self._closers: list = []
        self.addresses: dict[str, str] = {}
        self.prefill_worker_id = "fuzz-prefill"
        self.decode_worker_id = "fuzz-decode"
        self.call(self._start())
        self.channels = {name: grpc.insecure_channel(addr) for name, addr in self.addresses.items()}

    def call(self, coro, timeout: float = 120.0):
        """Run `coro` on the mesh's loop and wait for its result."""
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def message_cap(self, server: str) -> int:
        """The largest message `server` accepts: the router's public port takes only what
        its request limits can need (issue 13 item 2), every other port MAX_MESSAGE_BYTES."""
        return public_message_bytes(LIMITS) if server == "router" else MAX_MESSAGE_BYTES

    def server_config(self) -> ServerConfig:
        return ServerConfig(port=0, drain_grace_s=1, max_message_bytes=MAX_MESSAGE_BYTES)

    async def _start(self) -> None:
        await self._start_kvtransfer()
        await self._start_prefill()
        await self._start_decode()
        await self._start_router()

    async def _start_kvtransfer(self) -> None:
        self.kv_servicer = KvTransferServicer(
            AgentRegistry(default_lease_s=10), TransferStatistics(), KvServiceMetrics(CollectorRegistry())
        )
        server = MeshServer(self.server_config(), KV_SERVICE)
        kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(self.kv_servicer, server.server)
        await server.start()
        await server.set_ready(True)
        self.addresses["kvtransfer"] = server.address
        self._closers.append(server.stop)

    def _worker_config(self, worker_id: str) -> WorkerConfig:
        return WorkerConfig(
            worker_id=worker_id, kvtransfer_address=self.addresses["kvtransfer"], kv_transport="grpc"
        )

    async def _start_prefill(self) -> None:
        rt = WorkerRuntime(
            "prefill",
            "pdmesh.v1.PrefillService",
            self.server_config(),
            self._worker_config(self.prefill_worker_id),
            ENGINE,
        )
        await rt.setup()
        self.leases = LeaseManager(default_ttl_s=30.0)
        keeper = LeaseKeeper(self.leases, rt.directory, interval_s=0.1)
        pool = rt.engine.kv_pool()
        assert pool is not None and rt.engine.info.layout is not None
        add_kv_source(rt.server.server, KvSourceServicer(PoolView(pool, rt.engine.info.layout), self.leases))
        servicer = PrefillServicer(
            engine=rt.engine,
            leases=self.leases,
            metrics=PrefillMetrics(rt.registry),
            limits=LIMITS,
            worker_info=rt.info(),
            kv_source_address=rt.address,
            agent_name=rt.transport.agent_name if rt.transport else "",
        )
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, rt.server.server)
        keeper.start()
        await rt.server.start()
        await rt.server.set_ready(True)
        self.prefill = rt
        self.addresses["prefill"] = rt.address

        async def close() -> None:
            await rt.server.stop()
            await keeper.stop()
            self.leases.close()
            await rt.shutdown()

        self._closers.append(close)

    async def _start_decode(self) -> None:
        rt = WorkerRuntime(
            "decode",
            "pdmesh.v1.DecodeService",
            self.server_config(),
            self._worker_config(self.decode_worker_id),
            ENGINE,
        )
        await rt.setup()
        assert rt.transport is not None
        prefill = self.addresses["prefill"]
        servicer = DecodeServicer(
            engine=rt.engine,
            policy=DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=32)),
            remote=RemotePrefill(rt.engine, rt.transport, rt.channels, rt.worker_id, 5_000),
            metrics=DecodeMetrics(rt.registry),
            limits=LIMITS,
            worker_info=rt.info(),
            static_candidates=[Candidate(self.prefill_worker_id, prefill)],
            prefill_timeout_s=5.0,
            probe=PrefillLoadProbe(rt.channels),
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, rt.server.server)
        await rt.server.start()
        await rt.server.set_ready(True)
        self.decode = rt
        self.decode_servicer = servicer
        self.addresses["decode"] = rt.address

        async def close() -> None:
            await rt.server.stop()
            await rt.shutdown()

        self._closers.append(close)

    async def _start_router(self) -> None:
        cfg = RouterConfig(
            decode_workers=(self.addresses["decode"],),
            prefill_workers=(self.addresses["prefill"],),
            health_interval_s=0.2,
            stats_interval_s=0.2,
            resubscribe_max_s=0.5,
            dns_refresh_s=0,
            seed=0,
        )
        settings = RouterSettings(server=self.server_config(), router=cfg, limits=LIMITS)
        self.router = Router(settings, ModelSpec.load(cfg), subscriber="fuzz-router")
        server = RouterListeners(self.router)
        await server.start()
        await self.router.start()
        await self.router.wait_until(
            lambda: len(self.router.registry) == 2 and all(r.healthy for r in self.router.registry.workers())
        )
        await server.set_ready(True)
        self.addresses["router"] = server.address
        self.addresses["router_internal"] = server.internal_address  # membership, ListWorkers, Stats

        async def close() -> None:
            await self.router.close()
            await server.stop()

        self._closers.append(close)

    # -- observation ----------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The counts every fuzzed call must leave as it found them (read over gRPC)."""
        d = decode_pb2_grpc.DecodeServiceStub(self.channels["decode"]).Stats(
            worker_pb2.StatsRequest(), timeout=5
        )
        p = prefill_pb2_grpc.PrefillServiceStub(self.channels["prefill"]).Stats(
            worker_pb2.StatsRequest(), timeout=5
        )
        r = router_pb2_grpc.RouterServiceStub(self.channels["router_internal"]).Stats(
            router_pb2.RouterServiceStatsRequest(), timeout=5
        )
        return Snapshot(
            decode_free=d.load.free_blocks,
            decode_running=d.load.running,
            decode_waiting=d.load.waiting,
            prefill_free=p.load.free_blocks,
            prefill_running=p.load.running,
            prefill_waiting=p.load.waiting,
            leases_held=p.leases.held,
            lease_blocks=p.leases.held_blocks,
            router_inflight=r.inflight,
            router_queued=r.queued,
            decode_dispatched_tokens=self.call(self._dispatched_tokens()),
        )

    async def _dispatched_tokens(self) -> int:
        return sum(self.decode_servicer.own_dispatches.tokens.values())

    def healthy(self) -> dict[str, str]:
        """Ready status of every server ("SERVING" when all is well)."""
        names = {
            "kvtransfer": KV_SERVICE,
            "prefill": "pdmesh.v1.PrefillService",
            "decode": "pdmesh.v1.DecodeService",
            "router": ROUTER_SERVICE,
            "router_internal": ROUTER_SERVICE,
        }
        out = {}
        for name, service in names.items():
            stub = health_pb2_grpc.HealthStub(self.channels[name])
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return out

    def release(self, handle_id: str) -> None:
        """What a well-behaved client does with a handle it will not read."""
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels["prefill"])
        stub.Release(prefill_pb2.ReleaseRequest(handle_id=handle_id), timeout=5)

    def decode_layout(self) -> common_pb2.KvLayout:
        layout = self.decode.engine.info.layout
        assert layout is not None
        return layout_to_proto(layout)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

        async def close_all() -> None:
            for close in reversed(self._closers):
                with contextlib.suppress(Exception):
                    await close()

        self.call(close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
