"""A token bucket: the rate limiter behind per-tenant admission quotas.

Owns one bucket's level. The level refills at `rate` per second up to `burst`;
a take of n needs min(n, burst) available and may drive the level negative, so
a request larger than the burst is admitted once the bucket is full and its
excess is paid back by waiting, instead of being refused forever. Time is
passed in by the owner (the admission controller reads its injected clock).
"""

from __future__ import annotations

import math


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float):
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be positive and finite, got {rate}")
        if not (burst > 0 and math.isfinite(burst)):
            raise ValueError(f"burst must be positive and finite, got {burst}")
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._level = min(self.burst, self._level + (now - self._updated) * self.rate)
            self._updated = now

    def level(self, now: float) -> float:
        self._refill(now)
        return self._level

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until a take of `n` would succeed (0: now)."""
        self._refill(now)
        need = min(n, self.burst)
        return 0.0 if self._level >= need else (need - self._level) / self.rate

    def take(self, n: float, now: float) -> None:
        """Take `n` (call after `wait_s` returned 0)."""
        self._refill(now)
        self._level -= n

    def refund(self, n: float, now: float) -> None:
        """Give back `n` taken for work that never ran."""
        self._refill(now)
        self._level = min(self.burst, self._level + n)

    def is_full(self, now: float) -> bool:
        """A full bucket is indistinguishable from a new one, so it can be dropped."""
        return self.level(now) >= self.burst
