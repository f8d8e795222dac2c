"""Entry point of a prefill worker: `python -m services.prefill.main [flags]`.

Flags (and PDMESH_* environment variables) come from ServerConfig,
WorkerConfig, PrefillConfig, RequestLimits, EngineConfig (`--engine-`
prefix), TlsConfig (`--tls-` prefix) and TracingConfig (`--otlp-endpoint`).
The worker serves PrefillService and KvSourceService (the gRPC transport's
byte stream) on one port.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import structlog

from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.leases import LeaseKeeper, LeaseManager
from kvtransfer.metrics import LeaseCollector
from kvtransfer.pool import PoolView
from pdmesh.v1 import prefill_pb2_grpc
from services.common.tls import certified_worker
from services.prefill.config import SECTIONS, PrefillSettings, make_parser, parse_settings
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer
from services.worker.settings import configs, run_worker, start_runtime

log = structlog.get_logger()

SERVICE_NAME = "pdmesh.v1.PrefillService"
# Calls a draining prefill worker still serves: they end the leases its drain waits for.
DRAIN_SERVED = ("/pdmesh.v1.KvSourceService/", f"/{SERVICE_NAME}/Release")
# What docs/CONFIG.md and `--help` are made from (the same sections parse_settings builds).
CONFIGS = configs(SECTIONS)
__all__ = ["CONFIGS", "SERVICE_NAME", "main", "make_parser", "serve"]


async def serve(settings: PrefillSettings) -> None:
    rt = await start_runtime("prefill", SERVICE_NAME, settings)
    prefill_cfg = settings.prefill
    leases = LeaseManager(default_ttl_s=prefill_cfg.lease_ttl_s)
    rt.registry.register(LeaseCollector(leases))
    keeper = LeaseKeeper(leases, rt.directory, interval_s=prefill_cfg.lease_check_s)
    if rt.transport is not None:
        rt.transport.attach_source(leases)
    pool = rt.engine.kv_pool()
    if pool is not None and rt.engine.info.layout is not None:
        # gRPC reads serve the pool the handles point into: the wire staging pool with --kv-wire-quant
        view = rt.wire.view if rt.wire is not None else PoolView(pool, rt.engine.info.layout)
        source = KvSourceServicer(view, leases, caller_worker=certified_worker)
        add_kv_source(rt.server.server, source)
    servicer = PrefillServicer(
        engine=rt.engine,
        leases=leases,
        metrics=PrefillMetrics(rt.registry),
        limits=settings.limits,
        worker_info=rt.info(),
        kv_source_address=rt.address,
        agent_name=rt.transport.agent_name if rt.transport else "",
        config=prefill_cfg,
        health=rt.health,
        wire=rt.wire,
    )
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, rt.server.server)
    rt.server.serve_during_drain(DRAIN_SERVED, lambda: leases_settled(leases, prefill_cfg.max_lease_ms))
    keeper.start()
    try:
        await rt.serve(servicer.load)
    finally:
        await keeper.stop()
        leases.close()


async def leases_settled(leases: LeaseManager, max_lease_ms: int, poll_s: float = 0.05) -> bool:
    """Wait until every handle this worker gave out has ended: pulled and released (NIXL's done
    notification, a gRPC read with release_after, Release), or expired, or its requester died.
    A drain waits for this before the server and the KV transport stop, so a decode worker that
    holds a handle from before the drain still pulls it (Dynamo's planner fails those decodes on
    scale-down). The lease keeper keeps expiring leases meanwhile, so no lease outlives
    `max_lease_ms`; the bound here is that plus a margin, for a clock that did not move."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_lease_ms / 1000.0 + 5.0
    if leases.held_blocks:
        log.info("drain_waits_for_leases", leases=leases.held, blocks=leases.held_blocks)
    while leases.held_blocks and loop.time() < deadline:
        await asyncio.sleep(poll_s)  # a periodic check of the lease table (no event to wait on)
    return leases.held_blocks == 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(parse_settings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
