"""Forecasters: the next interval's value of a load signal from its past intervals.

One protocol, `Forecaster` (observe one value per interval, predict `steps`
intervals ahead), two implementations and one factory:

- `moving_average`: the mean of the last `window` observations (flat forecast);
- `holt`: Holt's linear trend (double exponential smoothing),
      level_t = a*x_t + (1-a)*(level_{t-1} + trend_{t-1})
      trend_t = b*(level_t - level_{t-1}) + (1-b)*trend_{t-1}
      forecast(h) = level_t + h*trend_t, floored at 0 (loads are not negative).

The planner keeps one forecaster per signal (arrival rate, mean ISL, mean OSL,
prefix hit rate) and asks for `steps` = the intervals a new worker needs to
become ready, so scale-up lands before the load does.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Forecaster(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self, steps: int = 1) -> float:
        """The value expected `steps` intervals after the last observation (0 before any)."""
        ...


class MovingAverage:
    def __init__(self, window: int = 6):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(float(value))

    def predict(self, steps: int = 1) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


class Holt:
    def __init__(self, alpha: float = 0.5, beta: float = 0.3):
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= beta <= 1, got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        x = float(value)
        if self._level is None:
            self._level = x
            return
        prev = self._level
        self._level = self.alpha * x + (1 - self.alpha) * (prev + self._trend)
        self._trend = self.beta * (self._level - prev) + (1 - self.beta) * self._trend

    def predict(self, steps: int = 1) -> float:
        if self._level is None:
            return 0.0
        return max(self._level + max(steps, 0) * self._trend, 0.0)


FORECASTERS = ("moving_average", "holt")


def make_forecaster(name: str, **kwargs: float) -> Forecaster:
    if name == "moving_average":
        return MovingAverage(int(kwargs.get("window", 6)))
    if name == "holt":
        return Holt(kwargs.get("alpha", 0.5), kwargs.get("beta", 0.3))
    raise ValueError(f"unknown forecaster {name!r}; one of {FORECASTERS}")
