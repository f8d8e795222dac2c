"""The KV-transfer service process: `python -m services.kvtransfer.main --port 0 --port-file F`.

Builds its config from flags and environment, serves `KvTransferService` on a
`MeshServer` (health, reflection, metrics, drain on SIGTERM), marks itself
ready once serving, and sweeps expired agents every `expiry_interval_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from prometheus_client import CollectorRegistry

from pdmesh.v1 import kvtransfer_pb2_grpc
from services.common.config import ConfigError, add_arguments, build
from services.common.logging import configure_logging
from services.common.server import MeshServer, ServerConfig, run
from services.common.tls import TlsConfig
from services.common.tracing import Tracing, TracingConfig
from services.common.tracing import shutdown as shutdown_tracing
from services.kvtransfer.config import KvTransferConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME, KvTransferServicer
from services.kvtransfer.stats import TransferStatistics


def build_servicer(config: KvTransferConfig, registry: CollectorRegistry) -> KvTransferServicer:
    return KvTransferServicer(
        AgentRegistry(
            default_lease_s=config.default_agent_lease_ms / 1000.0,
            max_lease_s=config.max_agent_lease_ms / 1000.0,
        ),
        TransferStatistics(window=config.latency_window),
        KvServiceMetrics(registry),
    )


async def _expire_forever(servicer: KvTransferServicer, interval_s: float) -> None:
    while True:
        servicer.expire()
        await asyncio.sleep(interval_s)  # a periodic sweep, not synchronisation


async def serve(
    server_config: ServerConfig,
    config: KvTransferConfig,
    tls: TlsConfig | None = None,
    tracing: TracingConfig | None = None,
) -> None:
    configure_logging("kvtransfer", server_config.log_level)
    metrics_registry = CollectorRegistry()
    servicer = build_servicer(config, metrics_registry)
    tracer = Tracing.start(tracing, "kvtransfer") if tracing is not None else None
    server = MeshServer(server_config, SERVICE_NAME, registry=metrics_registry, tls=tls, tracing=tracer)
    kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(servicer, server.server)
    await server.start()
    server.install_signal_handlers()
    sweeper = asyncio.create_task(_expire_forever(servicer, config.expiry_interval_s))
    await server.set_ready(True)
    try:
        await server.wait_stopped()
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        shutdown_tracing(tracer)


CONFIGS: tuple[tuple[type, str], ...] = (
    (ServerConfig, ""),
    (KvTransferConfig, ""),
    (TlsConfig, "tls_"),
    (TracingConfig, ""),
)


def make_parser() -> argparse.ArgumentParser:
    """The flags of this service, one per field of CONFIGS (docs/CONFIG.md is made from them)."""
    parser = argparse.ArgumentParser(
        prog="pdmesh-kvtransfer",
        description="pdmesh KV-transfer service (agent registry, transfer statistics)",
    )
    for cls, prefix in CONFIGS:
        add_arguments(parser, cls, prefix)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        cfg = {cls: build(cls, args, os.environ, prefix) for cls, prefix in CONFIGS}
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    run(lambda: serve(cfg[ServerConfig], cfg[KvTransferConfig], cfg[TlsConfig], cfg[TracingConfig]))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
