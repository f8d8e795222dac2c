"""Entry point of a decode worker: `python -m services.decode.main [flags]`.

Flags (and PDMESH_* environment variables) come from the config dataclasses:
ServerConfig, WorkerConfig, DecodeConfig, DisaggConfig, RequestLimits,
EngineConfig (with the `--engine-` prefix, e.g. `--engine-preset small`),
TlsConfig (`--tls-cert-file`, ...) and TracingConfig (`--otlp-endpoint`, ...).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdmesh.v1 import decode_pb2_grpc
from services.decode.config import SECTIONS, DecodeSettings, make_parser, parse_settings
from services.decode.disagg_policy import Candidate, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import PrefillLoadProbe
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.worker.settings import configs, run_worker, start_runtime

SERVICE_NAME = "pdmesh.v1.DecodeService"
# What docs/CONFIG.md and `--help` are made from (the same sections parse_settings builds).
CONFIGS = configs(SECTIONS)
__all__ = ["CONFIGS", "SERVICE_NAME", "main", "make_parser", "serve"]


async def serve(settings: DecodeSettings) -> None:
    rt = await start_runtime("decode", SERVICE_NAME, settings)
    decode_cfg = settings.decode
    metrics = DecodeMetrics(rt.registry)
    remote = None
    if rt.transport is not None or rt.engine.info.capabilities.moves_kv_itself:
        remote = RemotePrefill(rt.engine, rt.transport, rt.channels, rt.worker_id, decode_cfg.kv_lease_ms)
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
    )
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, rt.server.server)
    await rt.serve(servicer.load)


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(parse_settings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
