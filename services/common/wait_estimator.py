"""Estimates how long a new prefill would wait on this worker.

wait = prompt tokens queued ahead / prefill throughput, where throughput is
an exponentially weighted average of prompt tokens computed per second while
the engine had prefill work (idle time does not dilute it). Until the first
measurement the configured prior is used. Plain and clock-injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WaitEstimator:
    def __init__(
        self,
        prior_tokens_per_s: float = 1000.0,
        alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ):
        if prior_tokens_per_s <= 0:
            raise ValueError("prior_tokens_per_s must be positive")
        self.tokens_per_s = prior_tokens_per_s
        self._alpha = alpha
        self._clock = clock
        self._last: tuple[float, int] | None = None
        self._was_busy = False

    def observe(self, prompt_tokens_computed: int, tokens_waiting: int) -> None:
        """Feed the engine's cumulative prompt-token counter and current backlog."""
        now = self._clock()
        if self._last is not None and self._was_busy:
            t0, c0 = self._last
            dt, dc = now - t0, prompt_tokens_computed - c0
            if dt > 0.05 and dc > 0:
                self.tokens_per_s += self._alpha * (dc / dt - self.tokens_per_s)
        self._last = (now, prompt_tokens_computed)
        self._was_busy = tokens_waiting > 0

    def wait_s(self, tokens_waiting: int) -> float:
        return tokens_waiting / self.tokens_per_s
