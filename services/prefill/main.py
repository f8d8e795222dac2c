"""Entry point of a prefill worker: `python -m services.prefill.main [flags]`.

Flags (and PDMESH_* environment variables) come from ServerConfig,
WorkerConfig, PrefillConfig, RequestLimits, EngineConfig (`--engine-`
prefix), TlsConfig (`--tls-` prefix) and TracingConfig (`--otlp-endpoint`).
The worker serves PrefillService and KvSourceService (the gRPC transport's
byte stream) on one port.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
from kvtransfer.leases import LeaseKeeper, LeaseManager
from kvtransfer.metrics import LeaseCollector
from kvtransfer.pool import PoolView
from pdmesh.v1 import prefill_pb2_grpc
from services.common.config import add_arguments, build
from services.common.logging import configure_logging
from services.common.server import ServerConfig, run
from services.common.tls import TlsConfig, certified_worker
from services.common.tracing import Tracing, TracingConfig
from services.common.validation import RequestLimits
from services.common.worker_runtime import WorkerConfig, WorkerRuntime
from services.engine.config import EngineConfig
from services.prefill.config import PrefillConfig
from services.prefill.metrics import PrefillMetrics
from services.prefill.servicer import PrefillServicer

SERVICE_NAME = "pdmesh.v1.PrefillService"
CONFIGS = (
    (ServerConfig, ""),
    (WorkerConfig, ""),
    (PrefillConfig, ""),
    (RequestLimits, "limits_"),
    (EngineConfig, "engine_"),
    (TlsConfig, "tls_"),
    (TracingConfig, ""),
)


def make_parser() -> argparse.ArgumentParser:
    """The flags of this service, one per field of CONFIGS (docs/CONFIG.md is made from them)."""
    parser = argparse.ArgumentParser(prog="pdmesh-prefill", description="pdmesh prefill worker")
    for cls, prefix in CONFIGS:
        add_arguments(parser, cls, prefix)
    return parser


def parse(argv: Sequence[str] | None, env: dict[str, str]) -> dict[type, object]:
    args = make_parser().parse_args(argv)
    return {cls: build(cls, args, env, prefix) for cls, prefix in CONFIGS}


async def serve(cfg: dict[type, object]) -> None:
    server_cfg: ServerConfig = cfg[ServerConfig]  # type: ignore[assignment]
    prefill_cfg: PrefillConfig = cfg[PrefillConfig]  # type: ignore[assignment]
    configure_logging("prefill", server_cfg.log_level)
    rt = WorkerRuntime(
        "prefill",
        SERVICE_NAME,
        server_cfg,
        cfg[WorkerConfig],  # type: ignore[arg-type]
        cfg[EngineConfig],  # type: ignore[arg-type]
        tls=cfg[TlsConfig],  # type: ignore[arg-type]
        tracing=Tracing.start(cfg[TracingConfig], "prefill"),  # type: ignore[arg-type]
    )
    await rt.setup()
    leases = LeaseManager(default_ttl_s=prefill_cfg.lease_ttl_s)
    rt.registry.register(LeaseCollector(leases))
    keeper = LeaseKeeper(leases, rt.directory, interval_s=prefill_cfg.lease_check_s)
    if rt.transport is not None:
        rt.transport.attach_source(leases)
    pool = rt.engine.kv_pool()
    if pool is not None and rt.engine.info.layout is not None:
        source = KvSourceServicer(
            PoolView(pool, rt.engine.info.layout), leases, caller_worker=certified_worker
        )
        add_kv_source(rt.server.server, source)
    servicer = PrefillServicer(
        engine=rt.engine,
        leases=leases,
        metrics=PrefillMetrics(rt.registry),
        limits=cfg[RequestLimits],  # type: ignore[arg-type]
        worker_info=rt.info(),
        kv_source_address=rt.address,
        agent_name=rt.transport.agent_name if rt.transport else "",
        config=prefill_cfg,
    )
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, rt.server.server)
    keeper.start()
    try:
        await rt.serve(servicer.load)
    finally:
        await keeper.stop()
        leases.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse(argv, dict(os.environ))
    run(lambda: serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
