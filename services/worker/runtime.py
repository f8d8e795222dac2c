"""Process bootstrap shared by decode and prefill workers.

`WorkerRuntime` owns, in start order: the engine (model loaded, step loop
running), the gRPC server (bound early so the worker knows its address), the
KV transport with its agent registered at the KV-transfer service, the
forward-progress health watch (services/worker/health.py) and the router
membership. Role-specific mains add their servicers between `setup()`
and `serve()`. Shutdown runs in reverse: drain the server (NOT_SERVING,
in-flight calls finish), leave the router, close the transport, close the
engine. With a `TlsConfig` the server and every client channel (router,
KV-transfer service, peers' KvSource) speak TLS/mTLS; with a `Tracing` the
server traces calls and the channels carry the trace context.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry

from kvtransfer.agents import AgentDirectory
from kvtransfer.factory import KINDS, create_transport
from kvtransfer.pool import PoolView
from kvtransfer.reporting import ServiceReporter
from kvtransfer.transport import KvTransport
from pdmesh.v1 import common_pb2, kvtransfer_pb2_grpc
from services.common.channels import ChannelCache
from services.common.config import require, setting
from services.common.router_registration import RouterMembership
from services.common.server import MeshServer, ServerConfig
from services.common.tls import TlsConfig
from services.common.tracing import Tracing, client_interceptors
from services.common.tracing import shutdown as shutdown_tracing
from services.engine.api import Engine
from services.engine.config import EngineConfig
from services.engine.factory import create_engine
from services.worker.hardware import accelerator_generation, memory_headroom_bytes
from services.worker.health import HealthWatch
from services.worker.metrics import EngineCollector
from services.worker.serving import default_worker_id
from services.worker.wire_kv import WIRE_SCHEMES, WireStage

log = structlog.get_logger()

_ROLES = {"decode": common_pb2.WORKER_ROLE_DECODE, "prefill": common_pb2.WORKER_ROLE_PREFILL}


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str = setting("", "unique worker id (default <role>-<host>-<port>)")
    advertise_host: str = setting("", "host other services use to reach this worker (default: --host)")
    kvtransfer_address: str = setting("", "host:port of the KV-transfer service ('' = no KV handoff)")
    kv_transport: str = setting("nixl", f"KV transport, one of {KINDS}")
    router_address: str = setting(
        "", "host:port of the router's internal port (--internal-port) to join at run time ('' = static only)"
    )
    router_lease_ms: int = setting(10_000, "lease of the runtime registration at the router")
    accelerator_generation: str = setting(
        "",
        "the generation this worker registers ('' = detected: the CUDA device's name, the CPU's "
        "vector extension, or 'sim'); the router ranks on measured speeds while the decode workers' "
        "generations differ (--speed-route auto)",
    )
    # 15 s, not less: one engine step on a shared CPU (a long prompt chunk, a cold first pass
    # under load) can take several seconds, and the router's own stream stall timeout is 10 s.
    stall_not_serving_s: float = setting(
        15.0,
        "readiness goes NOT_SERVING (reason no_progress) when the engine has requests and computes "
        "no token for this long, and comes back when tokens flow (0 = off)",
    )
    kv_wire_quant: str = setting(
        "none",
        f"KV handoffs in 1-byte blocks, one of {WIRE_SCHEMES}: the cache stays in full precision, "
        "blocks are quantized (per block, layer, K/V and head scales) on export and dequantized on "
        "import (services/worker/wire_kv.py); both sides must agree, or the handoff is refused and "
        "the prompt prefilled locally. Turns off serving and pulling prefixes (they move cache blocks)",
    )

    def __post_init__(self) -> None:
        require(self.kv_transport in KINDS, f"kv_transport must be one of {KINDS}, got {self.kv_transport!r}")
        require(
            self.kv_wire_quant in WIRE_SCHEMES,
            f"kv_wire_quant must be one of {WIRE_SCHEMES}, got {self.kv_wire_quant!r}",
        )
        require(self.router_lease_ms >= 500, "router_lease_ms must be >= 500")
        require(self.stall_not_serving_s >= 0, "stall_not_serving_s must be >= 0")


class WorkerRuntime:
    def __init__(
        self,
        role: str,
        service_name: str,
        server_config: ServerConfig,
        config: WorkerConfig,
        engine_config: EngineConfig,
        tls: TlsConfig | None = None,
        tracing: Tracing | None = None,
    ):
        self.role = role
        self.config = config
        self.engine_config = engine_config
        self.tls = tls
        self.tracing = tracing
        self.registry = CollectorRegistry()
        self.server = MeshServer(server_config, service_name, self.registry, tls=tls, tracing=tracing)
        # every client channel of this worker (with tracing on, they carry the trace context)
        self.channels = ChannelCache(tls=tls, interceptors=client_interceptors(tracing))
        self.engine: Engine = create_engine(engine_config)
        self.transport: KvTransport | None = None
        # --kv-wire-quant: the staging pool the transport is published over (None = the engine's pool)
        self.wire: WireStage | None = None
        self.directory: AgentDirectory | None = None
        self.reporter: ServiceReporter | None = None
        self.membership: RouterMembership | None = None
        # Readiness from forward progress; None when --stall-not-serving-s is 0.
        self.health: HealthWatch | None = (
            HealthWatch(self.engine, self.server, config.stall_not_serving_s)
            if config.stall_not_serving_s > 0
            else None
        )
        self.worker_id = ""
        self.address = ""
        self.link_port = 0  # a decode worker's raw token link, once listening (WorkerInfo.link_port)
        self.model_load_s = 0.0
        self.generation = ""  # WorkerInfo.accelerator_generation, read once the engine is up
        # Run first at shutdown, after the drain (a decode worker's raw link listener closes).
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []

    async def setup(self) -> None:
        """Load the engine, bind, bring up the KV transport (agent registered)."""
        started = time.monotonic()
        await self.engine.start()
        self.model_load_s = time.monotonic() - started  # WorkerInfo.model_load_s: measured, not declared
        e = self.engine.info
        self.generation = self.config.accelerator_generation or (
            "sim" if e.backend == "sim" else accelerator_generation(e.device)
        )
        port = self.server.bind()
        host = self.config.advertise_host or self.server.config.host
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: peers reach us by our name
            host = socket.gethostname()
        self.address = f"{host}:{port}"
        self.worker_id = self.config.worker_id or default_worker_id(self.role, port)
        self.registry.register(EngineCollector(self.engine.stats, self.role))
        if self.config.kvtransfer_address and self.engine.info.capabilities.exports_kv_pool:
            stub = kvtransfer_pb2_grpc.KvTransferServiceStub(
                self.channels.get(self.config.kvtransfer_address)
            )
            self.directory = AgentDirectory(stub)
            self.reporter = ServiceReporter(stub)
            pool = self.engine.kv_pool()
            assert pool is not None and self.engine.info.layout is not None
            view = PoolView(pool, self.engine.info.layout)
            if self.config.kv_wire_quant != "none":
                self.wire = make_wire_stage(self.engine, self.config.kv_wire_quant)
                view = self.wire.view
            self.transport = create_transport(
                self.config.kv_transport,
                agent_name=f"{self.worker_id}-{os.getpid()}",
                pool=view,
                worker_id=self.worker_id,
                directory=self.directory,
                reporter=self.reporter,
                channel_factory=self.channels.new_channel,
            )
            await self.transport.start(kv_source_address=self.address)
            self.reporter.start()
        log.info(
            "worker_setup",
            role=self.role,
            worker_id=self.worker_id,
            address=self.address,
            model=self.engine.info.model_id,
            kv_transport=self.transport.kind if self.transport else None,
        )

    def info(self) -> common_pb2.WorkerInfo:
        e = self.engine.info
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            role=_ROLES[self.role],
            model_id=e.model_id,
            block_size=e.block_size,
            accelerator=common_pb2.ACCELERATOR_KIND_CUDA
            if e.device.startswith("cuda")
            else common_pb2.ACCELERATOR_KIND_CPU,
            kv_capacity_blocks=e.num_blocks,
            free_blocks=self.engine.stats().free_blocks,
            engine_backend=e.backend,
            max_model_len=e.max_model_len,
            kv_agent_name=self.transport.agent_name if self.transport else "",
            link_port=self.link_port,
            # Heterogeneous fleets (issue 21 item 3; services/worker/hardware.py).
            accelerator_generation=self.generation,
            memory_headroom_bytes=memory_headroom_bytes(e.device),
            warm_models=[e.model_id],
            model_load_s=self.model_load_s,
        )

    async def serve(self, load: Callable[[], common_pb2.WorkerLoad]) -> None:
        """Start serving, become ready, join the router; return once drained."""
        await self.server.start()
        await self.server.set_ready(True)
        if self.health is not None:
            self.health.start()
        if self.config.router_address:
            self.membership = RouterMembership(
                self.channels.get(self.config.router_address), self.info, load, self.config.router_lease_ms
            )
            self.membership.start()
        self.server.install_signal_handlers()
        await self.server.wait_stopped()
        await self.shutdown()

    async def shutdown(self) -> None:
        """After the drain: leave the router, close KV and the engine."""
        for hook in self.on_shutdown:
            await hook()
        if self.health is not None:
            await self.health.stop()
        if self.membership is not None:
            await self.membership.stop()
        if self.reporter is not None:
            await self.reporter.stop()
        if self.transport is not None:
            await self.transport.close()
        if self.directory is not None:
            await self.directory.deregister()
        await self.channels.close()
        await self.engine.close()
        shutdown_tracing(self.tracing)  # export the spans still buffered
        log.info("worker_stopped", role=self.role, worker_id=self.worker_id)


def make_wire_stage(engine: Engine, scheme: str) -> WireStage:
    """The staging pool of `--kv-wire-quant scheme`; ValueError (a start-up error) when the engine's
    cache is quantized already or it cannot copy blocks in and out."""
    layout = engine.info.layout
    assert layout is not None
    if layout.quant != "none":
        raise ValueError(
            f"kv_wire_quant {scheme!r} needs a full-precision KV cache; the cache is {layout.quant!r} "
            "already and its blocks travel as they are"
        )
    if not (hasattr(engine, "export_blocks") and hasattr(engine, "import_blocks")):
        raise ValueError(f"kv_wire_quant: the {engine.info.backend} engine cannot copy KV blocks in and out")
    return WireStage(layout, scheme, engine.info.num_blocks)


def grpc_error_text(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name}: {e.details()}"
