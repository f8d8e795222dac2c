"""Entry point of a decode worker: `python -m services.decode.main [flags]`.

Flags (and PDMESH_* environment variables) come from the config dataclasses:
ServerConfig, WorkerConfig, DecodeConfig, DisaggConfig, RequestLimits,
EngineConfig (with the `--engine-` prefix, e.g. `--engine-preset small`),
TlsConfig (`--tls-cert-file`, ...) and TracingConfig (`--otlp-endpoint`, ...).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh.v1 import decode_pb2_grpc
from services.common.gc_tuning import tune_gc
from services.decode.config import SECTIONS, DecodeSettings, make_parser, parse_settings
from services.decode.disagg_policy import Candidate, DisaggregationPolicy
from services.decode.link_server import LinkServer
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import PrefillLoadProbe
from services.decode.prefix_pull import PrefixPuller, PrefixPullMetrics
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.engine.api import PrefixCacheEngine
from services.worker.prefix_source import PrefixSource
from services.worker.runtime import WorkerRuntime
from services.worker.settings import configs, run_worker, start_runtime

SERVICE_NAME = "pdmesh.v1.DecodeService"
# What docs/CONFIG.md and `--help` are made from (the same sections parse_settings builds).
CONFIGS = configs(SECTIONS)
__all__ = ["CONFIGS", "SERVICE_NAME", "DecodeParts", "main", "make_parser", "serve", "wire"]


@dataclass
class DecodeParts:
    """What `wire` mounted on a decode worker's runtime."""

    servicer: DecodeServicer
    source: PrefixSource | None  # serves our cached prefixes to peers
    puller: PrefixPuller | None  # follows the router's prefix-pull hints


def wire(rt: WorkerRuntime, settings: DecodeSettings) -> DecodeParts:
    """Mount the decode worker's servicers on a set-up runtime (tests wire in-process with it)."""
    decode_cfg = settings.decode
    metrics = DecodeMetrics(rt.registry)
    remote = None
    if rt.transport is not None or rt.engine.info.capabilities.moves_kv_itself:
        remote = RemotePrefill(
            rt.engine, rt.transport, rt.channels, rt.worker_id, decode_cfg.kv_lease_ms, wire=rt.wire
        )
    # Issue 17: serve our cached prefixes to peers and pull theirs (over the KV transport).
    # Not with --kv-wire-quant: the transport is published over the wire staging pool, and
    # prefix handles name the engine's own blocks.
    source = puller = None
    if rt.transport is not None and rt.wire is None and isinstance(rt.engine, PrefixCacheEngine):
        source = PrefixSource(
            rt.server.server,
            rt.engine,
            rt.transport,
            settings.limits,
            address=rt.address,
            liveness=rt.directory,
            config=settings.prefix_source,
        )
        if settings.prefix_pull.prefix_pull:
            puller = PrefixPuller(
                rt.engine,
                rt.transport,
                rt.channels,
                rt.worker_id,
                PrefixPullMetrics(rt.registry),
                settings.prefix_pull,
            )
    servicer = DecodeServicer(
        engine=rt.engine,
        policy=DisaggregationPolicy(settings.disagg),
        remote=remote,
        metrics=metrics,
        limits=settings.limits,
        worker_info=rt.info(),
        static_candidates=[Candidate(a, a) for a in decode_cfg.prefill_workers],
        prefill_timeout_s=decode_cfg.prefill_timeout_s,
        probe=PrefillLoadProbe(rt.channels) if remote is not None else None,
        max_request_s=decode_cfg.max_request_s,
        draining=rt.server.drain_started,
        health=rt.health,
        puller=puller,
    )
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, rt.server.server)
    return DecodeParts(servicer, source, puller)


async def serve(settings: DecodeSettings) -> None:
    rt = await start_runtime("decode", SERVICE_NAME, settings)
    parts = wire(rt, settings)
    if settings.decode.link_port >= 0:  # before serving: the port goes into our WorkerInfo
        link = LinkServer(
            parts.servicer.link_session,
            rt.server,
            settings.server.host,
            settings.decode.link_port,
            settings.tls,
            settings.server.max_message_bytes,
        )
        rt.link_port = parts.servicer.info.link_port = await link.start()
        rt.on_shutdown.append(link.close)
    if parts.source is not None:
        parts.source.start()
    tune_gc()  # start-up's heap frozen, collections rarer (services/common/gc_tuning.py)
    try:
        await rt.serve(parts.servicer.load)
    finally:
        if parts.source is not None:
            await parts.source.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(parse_settings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
