"""Settings of the KV-transfer service (flags `--...`, env `PDMESH_...`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting


@dataclass(frozen=True)
class KvTransferConfig:
    default_agent_lease_ms: int = setting(10_000, "agent liveness lease when the agent asks for none")
    max_agent_lease_ms: int = setting(300_000, "longest agent liveness lease granted")
    expiry_interval_s: float = setting(0.5, "seconds between sweeps of expired agents")
    latency_window: int = setting(4096, "recent transfers the latency percentiles are computed over")

    def __post_init__(self) -> None:
        require(self.default_agent_lease_ms > 0, "default_agent_lease_ms must be > 0")
        require(
            self.max_agent_lease_ms >= self.default_agent_lease_ms,
            "max_agent_lease_ms must be >= default_agent_lease_ms",
        )
        require(self.expiry_interval_s > 0, "expiry_interval_s must be > 0")
        require(self.latency_window >= 1, "latency_window must be >= 1")
