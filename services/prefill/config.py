"""Settings of a prefill worker beyond the shared worker, engine and server ones."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting


@dataclass(frozen=True)
class PrefillConfig:
    lease_ttl_s: float = setting(30.0, "default lease on held KV when the requester names none")
    lease_check_s: float = setting(0.25, "how often expired leases are freed")

    def __post_init__(self) -> None:
        require(self.lease_ttl_s > 0, "lease_ttl_s must be > 0")
        require(self.lease_check_s > 0, "lease_check_s must be > 0")
