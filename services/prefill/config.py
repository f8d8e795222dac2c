"""Settings of a prefill worker: its own section (`PrefillConfig`) and all of them
together (`PrefillSettings`, built by `parse_settings` from flags and environment)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.config import require, setting
from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.common.tracing import TracingConfig
from services.common.validation import RequestLimits
from services.engine.config import EngineConfig
from services.worker import settings as worker_settings
from services.worker.runtime import WorkerConfig
from services.worker.settings import Section, WorkerSettings


@dataclass(frozen=True)
class PrefillConfig:
    lease_ttl_s: float = setting(30.0, "default lease on held KV when the requester names none")
    lease_check_s: float = setting(0.25, "how often expired leases are freed")
    # Bounds on what callers can pin (issue 13): a longer lease_ms is clamped,
    # not refused, since the requester cannot know this worker's limit and the
    # handle says when the granted lease ends.
    max_lease_ms: int = setting(60_000, "longest lease granted on held KV (longer asks are clamped)")
    max_requester_held_share: float = setting(
        0.5, "share of the KV pool one requester (decode worker) may hold under leases at once"
    )
    max_held_share: float = setting(
        0.85, "shed new Prefill calls (RESOURCE_EXHAUSTED) while leases hold this share of the pool"
    )

    def __post_init__(self) -> None:
        require(self.lease_ttl_s > 0, "lease_ttl_s must be > 0")
        require(self.lease_check_s > 0, "lease_check_s must be > 0")
        require(self.max_lease_ms >= 1, "max_lease_ms must be >= 1")
        require(self.lease_ttl_s * 1000 <= self.max_lease_ms, "lease_ttl_s must not exceed max_lease_ms")
        require(0 < self.max_requester_held_share <= 1, "max_requester_held_share must be in (0, 1]")
        require(0 < self.max_held_share <= 1, "max_held_share must be in (0, 1]")


@dataclass(frozen=True)
class PrefillSettings(WorkerSettings):
    prefill: PrefillConfig = field(default_factory=PrefillConfig)


SECTIONS: tuple[Section, ...] = (
    ("server", ServerConfig, ""),
    ("worker", WorkerConfig, ""),
    ("prefill", PrefillConfig, ""),
    ("limits", RequestLimits, "limits_"),
    ("engine", EngineConfig, "engine_"),
    ("tls", TlsConfig, "tls_"),
    ("tracing", TracingConfig, ""),
)


def make_parser() -> argparse.ArgumentParser:
    """The flags of a prefill worker, one per field of SECTIONS (docs/CONFIG.md is made from them)."""
    return worker_settings.make_parser("pdmesh-prefill", "pdmesh prefill worker", SECTIONS)


def parse_settings(argv: Sequence[str] | None, env: Mapping[str, str]) -> PrefillSettings:
    """Flags win over `PDMESH_*` environment variables, which win over defaults."""
    return worker_settings.parse_settings(PrefillSettings, make_parser(), SECTIONS, argv, env)
