"""A bucketed sliding-window counter, shared by the circuit breaker and the retry budget.

Owns a fixed ring of `buckets` buckets, each `window_s / buckets` seconds wide,
holding a few named counts. Totals cover the buckets whose time slot lies within
the last `window_s` seconds (the current, partly elapsed slot included), so a
count leaves the window between `window_s - bucket width` and `window_s` after
it was added: the usual bucketed approximation (Finagle, Envoy, Hystrix), with
memory fixed at `buckets x fields` numbers however many events arrive.

Time is passed in by the owner (which reads its injected clock), so this class
has no clock of its own.
"""

from __future__ import annotations

import math


class SlidingWindow:
    """Counts of `fields` events over the last `window_s` seconds, in buckets."""

    def __init__(self, window_s: float, buckets: int, fields: int = 1):
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be positive and finite, got {window_s}")
        if buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {buckets}")
        if fields < 1:
            raise ValueError(f"fields must be >= 1, got {fields}")
        self.window_s = window_s
        self._n = buckets
        self._width = window_s / buckets
        # _slots[i] is the time slot (floor(now / width)) bucket i last counted for.
        self._slots: list[int] = [-1] * buckets
        self._counts: list[list[float]] = [[0.0] * fields for _ in range(buckets)]
        self._fields = fields

    def _slot(self, now: float) -> int:
        return math.floor(now / self._width)

    def add(self, now: float, field: int = 0, amount: float = 1.0) -> None:
        slot = self._slot(now)
        i = slot % self._n
        if self._slots[i] != slot:
            self._slots[i] = slot
            self._counts[i] = [0.0] * self._fields
        self._counts[i][field] += amount

    def totals(self, now: float) -> list[float]:
        """Sum of each field over the buckets still inside the window."""
        oldest = self._slot(now) - self._n + 1
        out = [0.0] * self._fields
        for slot, counts in zip(self._slots, self._counts, strict=True):
            if slot >= oldest:
                for f in range(self._fields):
                    out[f] += counts[f]
        return out

    def total(self, now: float, field: int = 0) -> float:
        return self.totals(now)[field]

    def reset(self) -> None:
        self._slots = [-1] * self._n
        self._counts = [[0.0] * self._fields for _ in range(self._n)]
