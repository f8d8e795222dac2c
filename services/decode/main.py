"""Entry point of a decode worker: `python -m services.decode.main [flags]`.

Flags (and PDMESH_* environment variables) come from the config dataclasses:
ServerConfig, WorkerConfig, DecodeConfig, DisaggConfig, RequestLimits,
EngineConfig (with the `--engine-` prefix, e.g. `--engine-preset small`),
TlsConfig (`--tls-cert-file`, ...) and TracingConfig (`--otlp-endpoint`, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pdmesh.v1 import decode_pb2_grpc
from services.common.config import add_arguments, build
from services.common.logging import configure_logging
from services.common.server import ServerConfig, run
from services.common.tls import TlsConfig
from services.common.tracing import Tracing, TracingConfig
from services.common.validation import RequestLimits
from services.decode.config import DecodeConfig
from services.decode.disagg_policy import Candidate, DisaggConfig, DisaggregationPolicy
from services.decode.metrics import DecodeMetrics
from services.decode.prefill_load import PrefillLoadProbe
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.engine.config import EngineConfig
from services.worker.runtime import WorkerConfig, WorkerRuntime

SERVICE_NAME = "pdmesh.v1.DecodeService"
CONFIGS = (
    (ServerConfig, ""),
    (WorkerConfig, ""),
    (DecodeConfig, ""),
    (DisaggConfig, ""),
    (RequestLimits, "limits_"),
    (EngineConfig, "engine_"),
    (TlsConfig, "tls_"),
    (TracingConfig, ""),
)


def make_parser() -> argparse.ArgumentParser:
    """The flags of this service, one per field of CONFIGS (docs/CONFIG.md is made from them)."""
    parser = argparse.ArgumentParser(prog="pdmesh-decode", description="pdmesh decode worker")
    for cls, prefix in CONFIGS:
        add_arguments(parser, cls, prefix)
    return parser


def parse(argv: Sequence[str] | None, env: dict[str, str]) -> dict[type, object]:
    args = make_parser().parse_args(argv)
    return {cls: build(cls, args, env, prefix) for cls, prefix in CONFIGS}


async def serve(cfg: dict[type, object]) -> None:
    server_cfg: ServerConfig = cfg[ServerConfig]  # type: ignore[assignment]
    decode_cfg: DecodeConfig = cfg[DecodeConfig]  # type: ignore[assignment]
    configure_logging("decode", server_cfg.log_level)
    rt = WorkerRuntime(
        "decode",
        SERVICE_NAME,
        server_cfg,
        cfg[WorkerConfig],  # type: ignore[arg-type]
        cfg[EngineConfig],  # type: ignore[arg-type]
        tls=cfg[TlsConfig],  # type: ignore[arg-type]
        tracing=Tracing.start(cfg[TracingConfig], "decode"),  # type: ignore[arg-type]
    )
    await rt.setup()
    metrics = DecodeMetrics(rt.registry)
    remote = None
    if rt.transport is not None or rt.engine.info.capabilities.moves_kv_itself:
        remote = RemotePrefill(rt.engine, rt.transport, rt.channels, rt.worker_id, decode_cfg.kv_lease_ms)
    servicer = DecodeServicer(
        engine=rt.engine,
        policy=DisaggregationPolicy(cfg[DisaggConfig]),  # type: ignore[arg-type]
        remote=remote,
        metrics=metrics,
        limits=cfg[RequestLimits],  # type: ignore[arg-type]
        worker_info=rt.info(),
        static_candidates=[Candidate(a, a) for a in decode_cfg.prefill_workers],
        prefill_timeout_s=decode_cfg.prefill_timeout_s,
        probe=PrefillLoadProbe(rt.channels) if remote is not None else None,
    )
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, rt.server.server)
    await rt.serve(servicer.load)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse(argv, dict(os.environ))
    run(lambda: serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
