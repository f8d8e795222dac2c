"""Settings of a decode worker: its own section (`DecodeConfig`) and all of them
together (`DecodeSettings`, built by `parse_settings` from flags and environment)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.config import require, setting
from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.common.tracing import TracingConfig
from services.common.validation import RequestLimits
from services.decode.disagg_policy import DisaggConfig
from services.decode.prefix_pull import PullerConfig
from services.engine.config import EngineConfig
from services.worker import settings as worker_settings
from services.worker.prefix_source import PrefixSourceConfig
from services.worker.runtime import WorkerConfig
from services.worker.settings import Section, WorkerSettings


@dataclass(frozen=True)
class DecodeConfig:
    prefill_workers: tuple[str, ...] = setting(
        (), "static prefill workers (host:port, comma-separated) for requests that name no candidates"
    )
    prefill_timeout_s: float = setting(30.0, "longest a remote prefill (call + KV pull) may take")
    kv_lease_ms: int = setting(30_000, "lease the prefill worker holds the KV for us")
    max_request_s: float = setting(
        3600.0, "longest a Generate call may run: its deadline when the client set none, and a cap on one"
    )
    link_port: int = setting(
        0,
        "TCP port of the raw token link (DecodeService.Link's frames on a plain stream, TLS as the gRPC"
        " port; routers use it when offered): 0 = any free port, -1 = off (routers use Link over gRPC)",
    )

    def __post_init__(self) -> None:
        require(self.prefill_timeout_s > 0, "prefill_timeout_s must be > 0")
        require(self.kv_lease_ms >= 100, "kv_lease_ms must be >= 100")
        require(self.max_request_s > 0, "max_request_s must be > 0")
        require(-1 <= self.link_port <= 65535, "link_port must be -1 (off), 0 (any) or a port")


@dataclass(frozen=True)
class DecodeSettings(WorkerSettings):
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    # Issue 17: this worker's cached prefixes leased to peers, and its pulls of theirs.
    prefix_source: PrefixSourceConfig = field(default_factory=PrefixSourceConfig)
    prefix_pull: PullerConfig = field(default_factory=PullerConfig)


SECTIONS: tuple[Section, ...] = (
    ("server", ServerConfig, ""),
    ("worker", WorkerConfig, ""),
    ("decode", DecodeConfig, ""),
    ("disagg", DisaggConfig, ""),
    ("prefix_source", PrefixSourceConfig, ""),
    ("prefix_pull", PullerConfig, ""),
    ("limits", RequestLimits, "limits_"),
    ("engine", EngineConfig, "engine_"),
    ("tls", TlsConfig, "tls_"),
    ("tracing", TracingConfig, ""),
)


def make_parser() -> argparse.ArgumentParser:
    """The flags of a decode worker, one per field of SECTIONS (docs/CONFIG.md is made from them)."""
    return worker_settings.make_parser("pdmesh-decode", "pdmesh decode worker", SECTIONS)


def parse_settings(argv: Sequence[str] | None, env: Mapping[str, str]) -> DecodeSettings:
    """Flags win over `PDMESH_*` environment variables, which win over defaults."""
    return worker_settings.parse_settings(DecodeSettings, make_parser(), SECTIONS, argv, env)
