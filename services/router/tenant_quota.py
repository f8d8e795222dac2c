"""A tenant's quota (`TenantLimits`) and the token buckets that enforce its rates.

`AdmissionController` owns one `TenantBuckets` per active tenant: requests/s
and tokens/s (tokens = prompt + max_tokens) buckets, plus the limits they were
made from, so that a quota that changes (a reloaded API-keys file) gets fresh
buckets. `max_inflight` caps the tenant's open requests (running + queued).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import require
from services.router.token_bucket import TokenBucket


@dataclass(frozen=True)
class TenantLimits:
    """Quota of one tenant; a rate of None means unlimited, max_inflight None = the default cap."""

    requests_per_s: float | None = None
    request_burst: float = 10.0
    tokens_per_s: float | None = None
    token_burst: float = 100_000.0
    max_inflight: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s"):
            rate = getattr(self, name)
            require(rate is None or (rate > 0 and math.isfinite(rate)), f"{name} must be > 0 or None")
        require(self.request_burst >= 1, "request_burst must be >= 1")
        require(self.token_burst >= 1, "token_burst must be >= 1")
        require(self.max_inflight is None or self.max_inflight >= 1, "max_inflight must be >= 1 or None")


class TenantBuckets:
    def __init__(self, limits: TenantLimits, now: float):
        self.limits = limits
        self.requests = (
            TokenBucket(limits.requests_per_s, limits.request_burst, now) if limits.requests_per_s else None
        )
        self.tokens = (
            TokenBucket(limits.tokens_per_s, limits.token_burst, now) if limits.tokens_per_s else None
        )

    def wait_s(self, cost: int, now: float) -> float:
        wait = self.requests.wait_s(1, now) if self.requests else 0.0
        return max(wait, self.tokens.wait_s(cost, now)) if self.tokens else wait

    def take(self, cost: int, now: float) -> None:
        if self.requests:
            self.requests.take(1, now)
        if self.tokens:
            self.tokens.take(cost, now)

    def refund(self, cost: int, now: float) -> None:
        if self.requests:
            self.requests.refund(1, now)
        if self.tokens:
            self.tokens.refund(cost, now)

    def idle(self, now: float) -> bool:
        return all(b is None or b.is_full(now) for b in (self.requests, self.tokens))
