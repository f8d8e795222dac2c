"""Estimates how long a new prefill would wait on this worker.

wait = prompt tokens queued ahead / prefill throughput, where throughput is
an exponentially weighted average of prompt tokens computed per second while
the engine had prefill work (idle time does not dilute it). Until the first
measurement the configured prior is used. Plain and clock-injected.

`PathRates` gathers everything the decode worker's time rule
(services/decode/disagg_policy.py) needs: local and remote prefill rates, KV
bytes per token and link bandwidth, the decode step now and unloaded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """What the decode worker has measured (PathRates.snapshot()); seconds and tokens."""

    local_tokens_per_s: float = 1000.0  # local prefill, while prefilling
    remote_tokens_per_s: float = 1000.0  # a prefill worker's compute, queue excluded
    kv_bytes_per_token: float = 0.0  # what one prompt token's KV pull moves
    link_bytes_per_s: float = math.inf  # KV pull bandwidth (LinkFit: the part per byte); inf: not measured
    link_latency_s: float = 0.0  # the fixed part of a KV pull (LinkFit)
    tpot_s: float = 0.0  # recent mean inter-token latency here, stalls included
    decode_step_s: float = 0.0  # recent median inter-token latency: the step when no prefill stalls it
    unloaded_tpot_s: float = 0.0  # decode step here unloaded (a low quantile of it)
    remote_measured: bool = True  # a remote prefill has been measured (False: its rates are priors)
    arrivals_per_s: float = 0.0  # requests reaching this worker's rule, recent rate (0: not measured)
    mean_output_tokens: float = 0.0  # their mean max_tokens (0: not measured)


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
        self.samples = 0

    def observe(self, prompt_tokens_computed: int, tokens_waiting: int) -> None:
        """Feed the engine's cumulative prompt-token counter and current backlog."""
        now = self._clock()
        if self._last is not None and self._was_busy:
            t0, c0 = self._last
            dt, dc = now - t0, prompt_tokens_computed - c0
            if dt > 0.05 and dc > 0:
                self.tokens_per_s += self._alpha * (dc / dt - self.tokens_per_s)
                self.samples += 1
        self._last = (now, prompt_tokens_computed)
        self._was_busy = tokens_waiting > 0

    def wait_s(self, tokens_waiting: int) -> float:
        return tokens_waiting / self.tokens_per_s

    def started(self) -> None:
        """A prefill was just queued here: the interval to the next observation is busy
        (the counters at the last observation showed no backlog, but now there is one)."""
        self._was_busy = True


class Ewma:
    """An exponentially weighted mean with a prior."""

    def __init__(self, prior: float, alpha: float = 0.3):
        self.value = prior
        self.alpha = alpha
        self.samples = 0

    def update(self, x: float) -> None:
        # The first sample replaces the prior: a prior is a guess, a sample is not.
        self.value = x if not self.samples else self.value + self.alpha * (x - self.value)
        self.samples += 1


# Transfers measured before a worker's link figure is used (by its own rules and in its load
# report): a first connection's setup is not the link, and a rule that took it for the link
# could stop using the link and never measure it again.
LINK_MIN_SAMPLES = 3


class LinkFit:
    """A KV link as seconds = latency + bytes / bandwidth, fitted to the last `window` transfers.

    A transfer's time is a fixed part (RPCs, a first connection's setup) and a part per byte;
    bytes over seconds of one transfer mixes the two, so small transfers read as a slow link
    and one slow first connection read as a slow link for good (on NIXL here: the first 49 KB
    pull took 55-70 ms with the connection's setup, later ones ~5 ms). The fit is robust to
    such outliers: Theil-Sen (the median of the slopes between transfers whose sizes differ by
    at least `spread`, the median intercept), and while the sizes seen are too alike to tell
    the two parts apart, no fixed part and the median seconds per byte (what a transfer of the
    sizes seen costs; a larger one is then over-priced, never under-priced).
    """

    def __init__(self, window: int = 32, spread: float = 1.5):
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._spread = spread
        self._fit: tuple[float, float] | None = None  # (latency s, seconds per byte); None: refit

    @property
    def samples(self) -> int:
        return len(self._samples)

    def update(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._samples.append((float(nbytes), float(seconds)))
            self._fit = None

    def fit(self) -> tuple[float, float]:
        """(latency in seconds, seconds per byte); (0, 0) before any transfer."""
        if self._fit is None:
            self._fit = self._compute()
        return self._fit

    def _compute(self) -> tuple[float, float]:
        xs = list(self._samples)
        if not xs:
            return 0.0, 0.0
        slopes = [
            (yj - yi) / (xj - xi)
            for i, (xi, yi) in enumerate(xs)
            for xj, yj in xs[i + 1 :]
            if max(xi, xj) >= self._spread * min(xi, xj)
        ]
        slope = statistics.median(slopes) if slopes else 0.0
        if slope <= 0:  # sizes too alike (or noise): all of it per byte, at the median
            return 0.0, statistics.median(y / x for x, y in xs)
        latency = max(statistics.median(y - slope * x for x, y in xs), 0.0)
        return latency, slope

    def predict_s(self, nbytes: float) -> float:
        latency, per_byte = self.fit()
        return latency + nbytes * per_byte


class TimeAverage:
    """seconds / tokens over a window that decays in time (`tau_s`): the recent mean
    inter-token latency across every running request, stalls included, weighted by
    time rather than by sample (a pass that stalls 50 requests is one event, not 50)."""

    def __init__(self, tau_s: float, clock: Callable[[], float]):
        self._tau, self._clock = tau_s, clock
        self._num = self._den = 0.0
        self._at: float | None = None

    def update(self, seconds: float, tokens: int) -> None:
        self._decay()
        self._num += seconds
        self._den += tokens

    def _decay(self) -> None:
        now = self._clock()
        if self._at is not None and now > self._at:
            w = math.exp(-(now - self._at) / self._tau)
            self._num, self._den = self._num * w, self._den * w
        self._at = now

    @property
    def value(self) -> float:
        return self._num / self._den if self._den > 0 else 0.0


class LowQuantile:
    """A running low quantile: falls at once to a lower sample, rises toward a higher
    one only with time (`tau_up_s`), not with the number of samples (the unloaded
    decode step, from inter-token latencies seen under load: the fastest step seen,
    drifting up if the hardware slows). Per sample it would not hold: a loaded
    worker reports one interval per running request per pass, so 50 requests x a
    1% rise a sample took it to the loaded step within a few passes, and the TPOT
    SLO built on it (1.5x the unloaded step) with it (issue 19: 62 ms read for a
    44 ms SLO on the 70B profile, every decode's slack overstated)."""

    def __init__(self, tau_up_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.value: float | None = None
        self._tau, self._clock = tau_up_s, clock
        self._at = 0.0

    def update(self, x: float) -> None:
        now = self._clock()
        if self.value is None or x < self.value:
            self.value = x
        else:
            self.value += (1.0 - math.exp(-max(now - self._at, 0.0) / self._tau)) * (x - self.value)
        self._at = now


class RecentMedian:
    """The median of the samples of the last `window_s` seconds (at most `max_samples`):
    the decode step at the current batch with the stalls left out. A local prefill
    stalls one pass in many, so the median interval is a decode-only pass while the
    mean (TimeAverage) carries the stalls. The time rule projects a decode's
    remaining tokens at this pace: with the mean it projected the stalls it was
    deciding about as if they would go on whatever it chose, found every decode
    already past its SLO (so "lost either way", priced at nothing) and kept
    prefilling locally on a decode worker it had itself slowed (issue 19)."""

    def __init__(self, window_s: float, clock: Callable[[], float], max_samples: int = 512):
        self._window, self._clock = window_s, clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def update(self, x: float) -> None:
        self._samples.append((self._clock(), x))

    @property
    def value(self) -> float:
        now = self._clock()
        while self._samples and now - self._samples[0][0] > self._window:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        return statistics.median(x for _, x in self._samples)


class RecentRate:
    """Events per second over the last `window_s` (or since the first event, when younger)."""

    def __init__(self, window_s: float, clock: Callable[[], float], max_events: int = 4096):
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque(maxlen=max_events)

    def update(self) -> None:
        self._times.append(self._clock())

    @property
    def value(self) -> float:
        now = self._clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) < 2:
            return 0.0
        return (len(self._times) - 1) / max(now - self._times[0], 1e-3)


class PathRates:
    """The rates the decode worker's time rule runs on, fed continuously: every
    local prefill (`local_done`: its queue + compute less its predicted
    wait, per token computed), every remote prefill (`remote_done`: its queue + compute,
    less the wait that was predicted for it, per token computed), every KV pull
    (bytes, seconds, tokens), every decode interval (`decode_interval`).

    A rate not measured yet borrows its twin's (prefill and decode workers run
    the same engine): a decode worker that has only sent prompts away still
    knows roughly how fast it would prefill one itself, and the reverse.
    """

    def __init__(
        self,
        prior_tokens_per_s: float = 1000.0,
        alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.local = WaitEstimator(prior_tokens_per_s, alpha, clock)  # the token rule's
        self.local_rate = Ewma(prior_tokens_per_s, alpha)
        self.remote = Ewma(prior_tokens_per_s, alpha)
        self.link = LinkFit()  # KV transfers to here: latency + bytes / bandwidth
        self.kv_bytes_per_token = Ewma(0.0, alpha)
        self.tpot = TimeAverage(10.0, clock)
        self.unloaded_tpot = LowQuantile(clock=clock)
        self.decode_step = RecentMedian(10.0, clock)
        self.arrivals = RecentRate(10.0, clock)
        self.output_tokens = Ewma(0.0, alpha)

    def arrived(self, max_tokens: int) -> None:
        """A request reached the rule (its decision follows): the arrival rate and output length
        that price a local prefill's stall of the decodes that will start during it."""
        self.arrivals.update()
        if max_tokens > 0:
            self.output_tokens.update(float(max_tokens))

    def observe_local(self, prompt_tokens_computed: int, tokens_waiting: int) -> None:
        """The engine's counters (the token rule's wait estimate learns from them)."""
        self.local.observe(prompt_tokens_computed, tokens_waiting)

    def local_done(self, computed_tokens: int, queue_compute_s: float, predicted_wait_s: float) -> None:
        """A local prefill's first token came `queue_compute_s` after its decision,
        `predicted_wait_s` of which was its predicted queue. Per prefill, like the
        remote one, not from the engine's counters between two observations: a
        counter moves once a pass, and on a GPU a pass is longer than the gap
        between two requests, so counter rates alias. An over-predicted wait
        shortens the compute and raises the rate, which shortens the next
        prediction: the estimate settles where predictions match."""
        compute = queue_compute_s - predicted_wait_s
        if computed_tokens > 0 and queue_compute_s > 0:
            self.local_rate.update(computed_tokens / max(compute, 0.1 * queue_compute_s))

    def local_wait_s(self, tokens_waiting: int) -> float:
        return tokens_waiting / self.local_tokens_per_s

    def remote_done(self, computed_tokens: int, queue_compute_s: float, predicted_wait_s: float) -> None:
        """A remote prefill's first token arrived `queue_compute_s` after it was sent
        (its KV pull excluded), `predicted_wait_s` of which was its predicted queue."""
        compute = queue_compute_s - predicted_wait_s
        if computed_tokens > 0 and queue_compute_s > 0:
            # Floor the compute time at a tenth of the whole: a wait over-predicted
            # must not turn into an absurd rate.
            self.remote.update(computed_tokens / max(compute, 0.1 * queue_compute_s))

    def pulled(self, nbytes: int, seconds: float, tokens: int) -> None:
        self.link.update(nbytes, seconds)
        if nbytes > 0 and tokens > 0:
            self.kv_bytes_per_token.update(nbytes / tokens)

    def decode_interval(self, seconds: float, tokens: int) -> None:
        if seconds > 0 and tokens > 0:
            self.tpot.update(seconds, tokens)
            self.unloaded_tpot.update(seconds / tokens)
            self.decode_step.update(seconds / tokens)

    @property
    def local_tokens_per_s(self) -> float:
        if self.local_rate.samples or not self.remote.samples:
            return self.local_rate.value
        return self.remote.value

    @property
    def remote_tokens_per_s(self) -> float:
        return self.remote.value if self.remote.samples else self.local_tokens_per_s

    def link_ms(self, block_size: int) -> tuple[float, float]:
        """The measured link as (ms per transfer, ms per block of KV): (0, 0) before
        LINK_MIN_SAMPLES transfers."""
        per_token = self.kv_bytes_per_token.value
        if self.link.samples < LINK_MIN_SAMPLES or per_token <= 0:
            return 0.0, 0.0
        latency, per_byte = self.link.fit()
        return latency * 1000.0, per_token * block_size * per_byte * 1000.0

    def snapshot(self) -> Rates:
        measured = self.link.samples >= LINK_MIN_SAMPLES and self.link.fit()[1] > 0
        return Rates(
            local_tokens_per_s=self.local_tokens_per_s,
            remote_tokens_per_s=self.remote_tokens_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token.value,
            link_latency_s=self.link.fit()[0] if measured else 0.0,
            link_bytes_per_s=1.0 / self.link.fit()[1] if measured else math.inf,
            tpot_s=self.tpot.value,
            decode_step_s=self.decode_step.value,
            unloaded_tpot_s=self.unloaded_tpot.value or 0.0,
            remote_measured=bool(self.remote.samples),
            arrivals_per_s=self.arrivals.value,
            mean_output_tokens=self.output_tokens.value if self.output_tokens.samples else 0.0,
        )
