"""The planner's core: one `tick` per interval turns observed load into pool sizes.

Owns the forecasters (one per signal), the sizing rule, the hysteresis and the
log of decisions. It is plain Python with the clock passed in; the service
around it collects `Observation`s from the router's and workers' Stats and hands
`Decision`s to an actuator.

Each tick:
1. feed the interval's observed arrival rate, mean ISL/OSL and prefix hit rate
   to their forecasters and read them `lead` intervals ahead, where `lead`
   covers a new worker's measured start-up time (so capacity is ready first);
   the forecast rate is never below what was just observed (less `rate_floor_z`
   of its count's Poisson standard errors, when set), and in a bursty
   window (its busiest interval > `burst_ratio` x its median) never below the
   busiest interval (a burst shorter than a worker's start-up cannot be caught
   by scaling up when it comes, only by keeping its capacity);
2. size both pools jointly from that forecast (`sizing.size_pools`, prefill
   as one pooled queue by default: `queue_model`), for `headroom` x the SLOs
   (the model is a model);
3. refit the sizing's queueing coefficient from the TTFT measured at the
   utilisation the pool had (not in a bursty window: a burst's backlog is a
   transient, and learning from it sized 3x the pools the bursts need; not
   where the pooled model sees no queueing: the TTFT there is the prompts'
   own prefill), then correct with what was measured: a role whose measured
   latency quantile broke its SLO last interval gets at least one more worker
   than it has, whatever the model says (the model may be wrong; the SLO is
   not), unless workers of that role are still starting (the capacity is on
   its way; one more over-shoots and is kept through the scale-down streak);
4. apply the hysteresis per role, and record the decision with its inputs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from services.common.config import require, setting
from services.planner.capacity import WorkerModel
from services.planner.capacity_table import CapacityTable
from services.planner.forecast import FORECASTERS, Forecaster, make_forecaster
from services.planner.hysteresis import Hysteresis, HysteresisConfig
from services.planner.sizing import (
    POOLED_PRIOR,
    Budget,
    Load,
    Sizing,
    Slo,
    default_wait_coeff,
    fit_budget,
    pooled_wait_q,
    prefill_shape,
    size_pools,
)
from services.planner.split_table import Split, SplitTable

QUEUE_MODELS = ("pooled", "single")
LENGTH_RULES = ("fast_up", "long_run", "recent")
DECODE_MARGINS = ("quantile", "headroom")


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = setting(10.0, "planner: seconds between two decisions")
    forecaster: str = setting("holt", f"planner: load forecaster, one of {FORECASTERS}")
    ttft_slo_s: float = setting(2.0, "planner: TTFT SLO (seconds) at the SLO quantile")
    itl_slo_s: float = setting(0.05, "planner: ITL SLO (seconds)")
    slo_quantile: float = setting(0.9, "planner: the share of requests the SLOs are for")
    headroom: float = setting(0.85, "planner: size for this share of the SLOs (model error and noise)")
    min_prefill: int = setting(1, "planner: fewest prefill workers (0 = decode workers may prefill alone)")
    min_decode: int = setting(1, "planner: fewest decode workers")
    max_workers: int = setting(8, "planner: most workers of both roles together (the budget)")
    max_prefill: int = setting(
        -1, "planner: most prefill workers (-1 = the budget's; 0 = decode prefills alone)"
    )
    max_decode: int = setting(-1, "planner: most decode workers (-1 = the budget's)")
    startup_s: float = setting(30.0, "planner: a new worker's start-up time until it first measures one")
    peak_window_s: float = setting(300.0, "planner: window in which bursts are recognised")
    burst_ratio: float = setting(
        2.5, "planner: a window whose busiest interval exceeds this x its median is bursty: keep its peak"
    )
    queue_model: str = setting(
        "pooled", f"planner: prefill queueing model, one of {QUEUE_MODELS} (services/planner/sizing.py)"
    )
    error_window: int = setting(
        0,
        "planner: intervals of forecast error kept; each role's demand is sized x the SLO quantile of "
        "(actual / forecast) over them (0 = no forecast-error margin)",
    )
    length_window: int = setting(
        60,
        "planner: intervals of the long-run mean ISL/OSL (lengths are sized for the longer of it and the recent mean)",
    )
    length_last: bool = setting(
        True,
        "planner: lengths are also sized for at least the last interval's mean (a jump is sized for at once)",
    )
    recent_window: int = setting(6, "planner: intervals of the recent mean ISL/OSL and prefix hit rate")
    isl_rule: str = setting(
        "fast_up",
        f"planner: the prompt length prefill is sized for, one of {LENGTH_RULES}: the longest of the recent "
        "mean, the long-run mean (and the last interval's, with length_last), or the long-run mean alone",
    )
    osl_rule: str = setting(
        "fast_up", f"planner: the output length decode is sized for, one of {LENGTH_RULES}"
    )
    error_quantile: float = setting(0.5, "planner: the quantile of the forecast-error window sized for")
    rate_floor_z: float = setting(
        0.0,
        "planner: the rate forecast is never below the last interval's rate less this many of its Poisson "
        "standard errors, (n - z sqrt(n)) / interval for n arrivals (0 = never below the rate observed: one "
        "interval's count over-reads the rate half the time, and the floor then sizes for the noise)",
    )
    length_last_z: float = setting(
        0.0,
        "planner: with length_last, the last interval's mean lengths count less this many standard errors "
        "of a mean of n requests, x (1 - z / sqrt(n)) (a per-request coefficient of variation of 1; 0 = the "
        "mean as measured): a jump is sized for at once, one interval's sampling noise is not",
    )
    capacity_table: str = setting(
        "",
        "planner: JSON file of measured pool capacities per size (services/planner/capacity_table.py; "
        "bench/planner.py writes one); sizes from it instead of the queueing formulas when set",
    )
    table_margin: float = setting(
        0.98,
        "planner: with a capacity table, size so the forecast demand is at most this share of the measured capacity",
    )
    down_margin: float = setting(
        0.9,
        "planner: with a capacity table, a pool shrinks only to a size whose capacity x this covers the "
        "forecast demand (a band below table_margin: the load must fall clearly below the smaller pool's "
        "capacity, not just dip under the larger one's; 0 = table_margin both ways)",
    )
    falling_down_after: int = setting(
        1,
        "planner: while the rate forecast falls (its value a start-up ahead at least falling_ratio below "
        "its level), a scale-down needs only this many intervals wanting it (0 = the hysteresis' down_after "
        "always): the streak filters noise on a flat or rising load, and on a steady fall it only delays",
    )
    falling_ratio: float = setting(
        0.05, "planner: how far below its level the forecast is to count as falling"
    )
    local_prefill_share: float = setting(
        0.0,
        "planner: with a capacity table and decode workers that prefill locally when their batch has "
        "ITL slack (conditional disaggregation), each decode worker is counted as this share of one "
        "prefill worker's capacity, times its pool's spare decode capacity (0 = no decode-local prefill)",
    )
    table_margin_decode: float = setting(
        0.0, "planner: table_margin for the decode pool alone (0 = table_margin)"
    )
    split_prior: str = setting(
        "",
        "planner: profile/link/workload of the disaggregation study's best P:D split "
        "(services/planner/split_table.json) to split the budget by when both pools' wishes exceed it "
        'and no rates are measured yet ("" = in proportion to the wishes)',
    )
    decode_margin: str = setting(
        "quantile",
        f"planner: decode's margin, one of {DECODE_MARGINS}: the batch at the SLO quantile within the ITL "
        "SLO (quantile) or `headroom` x the ITL SLO (headroom)",
    )

    hysteresis: HysteresisConfig = field(default_factory=HysteresisConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        require(self.interval_s > 0, "interval_s must be > 0")
        require(self.forecaster in FORECASTERS, f"forecaster must be one of {FORECASTERS}")
        require(self.queue_model in QUEUE_MODELS, f"queue_model must be one of {QUEUE_MODELS}")
        require(self.recent_window >= 1, "recent_window must be >= 1")
        require(self.isl_rule in LENGTH_RULES, f"isl_rule must be one of {LENGTH_RULES}")
        require(self.osl_rule in LENGTH_RULES, f"osl_rule must be one of {LENGTH_RULES}")
        require(self.decode_margin in DECODE_MARGINS, f"decode_margin must be one of {DECODE_MARGINS}")
        require(self.startup_s >= 0, "startup_s must be >= 0")
        require(self.error_window >= 0, "error_window must be >= 0")
        require(0 < self.table_margin <= 1, "table_margin must be in (0, 1]")
        require(0 <= self.table_margin_decode <= 1, "table_margin_decode must be in [0, 1]")
        require(0 <= self.down_margin <= 1, "down_margin must be in [0, 1]")
        require(self.falling_down_after >= 0, "falling_down_after must be >= 0")
        require(0 < self.falling_ratio < 1, "falling_ratio must be in (0, 1)")
        require(self.local_prefill_share >= 0, "local_prefill_share must be >= 0")
        require(
            not self.split_prior or self.split_prior.count("/") == 2,
            f"split_prior must be profile/link/workload, got {self.split_prior!r}",
        )
        require(0 < self.error_quantile < 1, "error_quantile must be in (0, 1)")
        require(self.rate_floor_z >= 0, "rate_floor_z must be >= 0")
        require(self.length_last_z >= 0, "length_last_z must be >= 0")
        require(0 < self.headroom <= 1, "headroom must be in (0, 1]")
        require(self.max_prefill >= -1 and self.max_decode >= -1, "max_prefill/max_decode must be >= -1")
        require(self.max_decode != 0, "max_decode must not be 0 (at least one decode worker)")
        require(self.max_prefill == -1 or self.max_prefill >= self.min_prefill, "max_prefill < min_prefill")
        require(self.max_decode == -1 or self.max_decode >= self.min_decode, "max_decode < min_decode")


@dataclass(frozen=True)
class Observation:
    """What one interval looked like (from Stats), and the pools as they are now."""

    requests: int
    mean_isl: float
    mean_osl: float
    hit_rate: float
    prefill_workers: int
    decode_workers: int
    ttft_q_s: float | None = None  # measured TTFT at the SLO quantile (None = no data)
    itl_q_s: float | None = None
    ready_prefill_workers: int | None = None  # serving through the interval (None = prefill_workers)
    ready_decode_workers: int | None = None  # (None = decode_workers)


@dataclass(frozen=True)
class Decision:
    at_s: float
    prefill: int
    decode: int
    changed: bool
    reason: str
    sizing: Sizing
    forecast: Load


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        model: WorkerModel,
        *,
        history: int = 256,
        capacity: CapacityTable | None = None,
    ):
        self.config = config
        self.model = model
        if capacity is None and config.capacity_table:
            capacity = CapacityTable.load(config.capacity_table)
        self.capacity = capacity
        self.split: Split | None = None
        if config.split_prior:
            profile, link, workload = config.split_prior.split("/")
            self.split = SplitTable.load().best(profile, link, workload)
        self.slo = Slo(config.ttft_slo_s, config.itl_slo_s, config.slo_quantile)
        h = config.headroom
        self._target = Slo(config.ttft_slo_s * h, config.itl_slo_s * h, config.slo_quantile)
        self._pooled = config.queue_model == "pooled"
        self._decode_slo = self.slo if config.decode_margin == "quantile" else None
        self.budget = Budget(config.max_workers, config.min_prefill, config.min_decode)
        self.hysteresis = Hysteresis(config.hysteresis)
        # the arrival rate trends (the configured forecaster); lengths and hit rate only drift (averaged)
        self._signals: dict[str, Forecaster] = {"rate": make_forecaster(config.forecaster)}
        self._signals.update(
            {k: make_forecaster("moving_average", window=config.recent_window) for k in ("isl", "osl", "hit")}
        )
        # Lengths drift along a trace (the Azure conversations' mean output length moves 130 <-> 270
        # over minutes) faster than a worker starts: size for the longer of the recent and the
        # long-run mean, so a stretch of short requests does not shed the workers the next long
        # stretch needs (fast up, slow down).
        n_long = max(1, config.length_window)
        self._long = {k: make_forecaster("moving_average", window=n_long) for k in ("isl", "osl")}
        self._last_len = (0.0, 0.0)  # the last interval's mean lengths: a jump is sized for at once
        self.wait_coeff: float | None = None  # refit from measured TTFT (sizing's A); None = its prior
        self.startup_s = config.startup_s
        self.decisions: deque[Decision] = deque(maxlen=history)
        self._recent_rates: deque[float] = deque(
            maxlen=max(1, math.ceil(config.peak_window_s / config.interval_s))
        )
        # Forecast error per role: each tick's demand forecast (requests/s x tokens) is kept until the
        # interval it was made for comes; then actual / forecast joins the role's error window.
        self._made: deque[tuple[float, float]] = deque()  # (prefill, decode) demand forecasts, oldest first
        self._actual: deque[tuple[float, float]] = deque()  # and the demands seen since
        self._errors: dict[str, deque[float]] = {
            r: deque(maxlen=max(config.error_window, 1)) for r in ("prefill", "decode")
        }

    def observe_startup(self, seconds: float) -> None:
        """A worker took `seconds` from start to ready: the forecast horizon follows the slowest seen lately."""
        self.startup_s = max(seconds, 0.5 * self.startup_s)

    @property
    def lead(self) -> int:
        """Intervals ahead to forecast: the next decision point plus a worker's start-up time."""
        return 1 + math.ceil(self.startup_s / self.config.interval_s)

    def tick(self, obs: Observation, now: float) -> Decision:
        rate_now = obs.requests / self.config.interval_s
        self._recent_rates.append(rate_now)
        sig = self._signals
        sig["rate"].observe(rate_now)
        if obs.requests:
            sig["isl"].observe(obs.mean_isl)
            sig["osl"].observe(obs.mean_osl)
            sig["hit"].observe(obs.hit_rate)
            self._long["isl"].observe(obs.mean_isl)
            self._long["osl"].observe(obs.mean_osl)
            if self.config.length_last:
                k = max(0.0, 1.0 - self.config.length_last_z / math.sqrt(obs.requests))
                self._last_len = (obs.mean_isl * k, obs.mean_osl * k)
        lead = self.lead
        burst = self._burst_rate()
        # In a bursty window the trend is the bursts' own steps (Holt extrapolates a 5x step to 7x
        # and holds it through the scale-down streak): size for the busiest interval seen instead.
        trend = sig["rate"].predict(lead) if not burst else 0.0
        # the floor: the load is at least what was just seen, less the count's own Poisson noise
        z = self.config.rate_floor_z
        floor = max(obs.requests - z * math.sqrt(obs.requests), 0.0) / self.config.interval_s
        forecast = Load(
            rate=max(trend, floor, burst),
            isl=self._length("isl", lead, self._last_len[0]),
            osl=self._length("osl", lead, self._last_len[1]),
            hit_rate=min(max(sig["hit"].predict(1), 0.0), 1.0),
        )
        m_p, m_d = self._error_margins(obs, rate_now, lead, forecast)
        prefill_load = replace(forecast, rate=forecast.rate * m_p)
        decode_load = replace(forecast, rate=forecast.rate * m_d)
        bursty = burst > 0
        if not bursty:  # a burst's queue is a transient, not the steady state the coefficient is of
            self._refit_wait(obs, rate_now)
        decode_only = self.config.max_prefill == 0
        # Decode-only (no prefill workers at all): the budget is decode's alone, so prefill's
        # wish must not squeeze it (decode workers prefill themselves).
        budget = (
            Budget(2 * self.budget.max_workers, 0, self.budget.min_decode) if decode_only else self.budget
        )
        sizing = size_pools(
            prefill_load,
            self.model,
            self._target,
            budget,
            self.wait_coeff,
            pooled=self._pooled,
            decode_slo=self._decode_slo,
            decode_load=decode_load,
        )
        sizing.inputs.update(forecast_margin_prefill=m_p, forecast_margin_decode=m_d)
        if self.capacity is not None:
            sizing = self._table_sizing(prefill_load, decode_load, budget, sizing)
        want_p, want_d = (0, sizing.decode) if decode_only else (sizing.prefill, sizing.decode)
        if self.capacity is not None and self.config.down_margin > 0:
            # the band: shrinking needs the demand under down_margin of the smaller pool's capacity
            m = self.config.table_margin
            if want_p < obs.prefill_workers and not decode_only:
                band = self.capacity.workers(
                    "prefill",
                    sizing.inputs["table_prefill_demand"] * m / self.config.down_margin
                    - sizing.inputs["table_prefill_absorbed"],
                )
                want_p = min(obs.prefill_workers, max(want_p, band))
            if want_d < obs.decode_workers:
                md = self.config.table_margin_decode or m
                band = self.capacity.workers(
                    "decode", sizing.inputs["table_decode_demand"] * md / self.config.down_margin
                )
                want_d = min(obs.decode_workers, max(want_d, band))
        reasons = [sizing.reason]
        if (
            "budget" in sizing.reason
            and self.split is not None
            and not getattr(self.model, "measured", False)
        ):
            # The wishes do not fit: with no rates of its own measured, the planner trusts the
            # disaggregation study's best split of a fleet this size over its prior's proportions.
            want_p, want_d = self.split.scaled(budget.max_workers)
            want_p, want_d = max(want_p, budget.min_prefill), max(want_d, budget.min_decode)
            want_p = min(want_p, budget.max_workers - want_d)
            reasons.append(f"split_prior:{self.split.prefill}:{self.split.decode}")
        # A breach while workers of that role are still starting is the capacity already on its
        # way not being there yet: adding one more for it over-shoots (and stays, for the
        # scale-down streak) what the load needs.
        ready_p = obs.prefill_workers if obs.ready_prefill_workers is None else obs.ready_prefill_workers
        ready_d = obs.decode_workers if obs.ready_decode_workers is None else obs.ready_decode_workers
        if obs.ttft_q_s is not None and obs.ttft_q_s > self.slo.ttft_s and want_p <= obs.prefill_workers:
            if ready_p >= obs.prefill_workers:
                want_p = obs.prefill_workers + 1
                reasons.append("ttft_measured_over_slo")
            else:
                reasons.append("ttft_over_slo_capacity_starting")
        if obs.itl_q_s is not None and obs.itl_q_s > self.slo.itl_s and want_d <= obs.decode_workers:
            if ready_d >= obs.decode_workers:
                want_d = obs.decode_workers + 1
                reasons.append("itl_measured_over_slo")
            else:
                reasons.append("itl_over_slo_capacity_starting")
        room = self.budget.max_workers
        if self.config.max_prefill >= 0:
            want_p = min(want_p, self.config.max_prefill)
        if self.config.max_decode > 0:
            want_d = min(want_d, self.config.max_decode)
        want_p = min(want_p, room - self.budget.min_decode)
        want_d = min(want_d, room - want_p)
        # the wishes before hysteresis, for the decision log (bench/planner.py's breakdown reads them)
        sizing.inputs.update(corrected_prefill=float(want_p), corrected_decode=float(want_d))
        fast = self.config.falling_down_after if self._falling(lead) else 0
        p = self.hysteresis.apply("prefill", obs.prefill_workers, want_p, now, down_after=fast)
        d = self.hysteresis.apply("decode", obs.decode_workers, want_d, now, down_after=fast)
        d = min(d, room - p)  # the budget holds after hysteresis too
        changed = (p, d) != (obs.prefill_workers, obs.decode_workers)
        decision = Decision(now, p, d, changed, " ".join(reasons), sizing, forecast)
        self.decisions.append(decision)
        return decision

    def _length(self, key: str, lead: int, last: float) -> float:
        """The mean length sized for: fast_up, the longest of the recent mean, the long-run mean and the
        last interval's (0 without length_last); long_run, the long-run mean alone (a role whose
        capacity averages over many requests and recovers within a start-up, sized for the stretches'
        mean instead of their peaks)."""
        long_run = self._long[key].predict(lead)
        rule = self.config.isl_rule if key == "isl" else self.config.osl_rule
        if rule == "long_run":
            return long_run
        if rule == "recent":
            return max(self._signals[key].predict(lead), last)
        return max(self._signals[key].predict(lead), long_run, last)

    def _table_sizing(self, prefill_load: Load, decode_load: Load, budget: Budget, model: Sizing) -> Sizing:
        """Both pools from the measured capacity table (the formulas' sizing stays in the inputs)."""
        table = self.capacity
        assert table is not None
        p_demand = prefill_load.rate * prefill_load.uncached_isl / self.config.table_margin
        d_demand = (
            decode_load.rate * decode_load.osl / (self.config.table_margin_decode or self.config.table_margin)
        )
        d = max(table.workers("decode", d_demand), budget.min_decode)
        absorbed = 0.0
        if self.config.local_prefill_share > 0 and d > 0:
            # Decode workers prefill what their ITL slack allows (services/decode/disagg_policy.py's
            # time rule takes a prompt locally when the prefill pool would miss its TTFT): the
            # pool's spare decode capacity, as a share of one prefill worker each, comes off the
            # prefill demand (it is what the pools' integer rounding left unused on decode).
            spare = max(0.0, 1.0 - d_demand / table.capacity("decode", d))
            absorbed = d * spare * self.config.local_prefill_share * table.prefill[0]
        p = max(table.workers("prefill", p_demand - absorbed), budget.min_prefill)
        inputs = dict(model.inputs)
        inputs.update(
            table_prefill_demand=p_demand,
            table_decode_demand=d_demand,
            table_prefill_absorbed=absorbed,
            model_prefill=float(model.prefill),
            model_decode=float(model.decode),
        )
        reason = "prefill:table decode:table"
        if p + d > budget.max_workers:
            p, d = fit_budget(p, d, budget)
            reason += " budget"
        return Sizing(p, d, reason, inputs)

    def _error_margins(self, obs: Observation, rate: float, lead: int, forecast: Load) -> tuple[float, float]:
        """Each role's forecast-error margin: the SLO quantile of (actual / forecast) demand, at least 1.

        Demand is prefill's uncached tokens/s and decode's output tokens/s; the forecast made `lead`
        ticks ago (what the capacity now serving was decided on) is compared with the mean demand
        of the `lead` intervals since (the window it was for: one interval's Poisson and length
        noise is the queueing model's business, not the forecast's). Growth the forecast did not see (a ramp steeper than its trend,
        lengths drifting along the trace) then widens the margin, and a forecast that keeps up
        needs none: a headroom that follows the error measured instead of a fixed one.
        """
        if self.config.error_window == 0:
            return 1.0, 1.0
        self._actual.append((rate * obs.mean_isl * (1 - obs.hit_rate), rate * obs.mean_osl))
        while len(self._actual) > lead:
            self._actual.popleft()
        if len(self._made) >= lead and len(self._actual) == lead:
            made = self._made[-lead]
            for i, role in enumerate(("prefill", "decode")):
                mean = sum(a[i] for a in self._actual) / lead
                if made[i] > 0:
                    self._errors[role].append(mean / made[i])
        self._made.append((forecast.rate * forecast.uncached_isl, forecast.rate * forecast.osl))
        while len(self._made) > lead:
            self._made.popleft()
        q = self.config.error_quantile
        out = []
        for role in ("prefill", "decode"):
            errs = sorted(self._errors[role])
            out.append(min(max(errs[min(int(q * len(errs)), len(errs) - 1)], 1.0), 2.0) if errs else 1.0)
        return out[0], out[1]

    def _falling(self, lead: int) -> bool:
        """The rate forecast a start-up ahead is `falling_ratio` below its level now (never in a burst window)."""
        if not self.config.falling_down_after or self._burst_rate() > 0:
            return False
        rate = self._signals["rate"]
        level = rate.predict(0)
        return level > 0 and rate.predict(lead) <= (1 - self.config.falling_ratio) * level

    def _burst_rate(self) -> float:
        """The busiest recent interval's rate when the window is bursty (its peak > `burst_ratio` x its median)."""
        rates = sorted(self._recent_rates)
        median = rates[len(rates) // 2]
        return rates[-1] if rates[-1] > self.config.burst_ratio * max(median, 1e-9) else 0.0

    def _refit_wait(self, obs: Observation, rate: float) -> None:
        """Refit sizing's queueing coefficient A from the TTFT quantile measured at a known utilisation."""
        ready = obs.ready_prefill_workers if obs.ready_prefill_workers is not None else obs.prefill_workers
        if obs.ttft_q_s is None or not obs.requests or ready < 1:
            return
        isl = obs.mean_isl * (1 - obs.hit_rate)
        s1, s_pass, tps = prefill_shape(self.model, isl)
        rho = rate * max(isl, 1.0) / (ready * tps)
        if not 0.05 <= rho <= 0.95:
            return  # too idle to see queueing, or too saturated to be steady
        waited = max(obs.ttft_q_s - s1 - self.model.transfer_s(int(isl)), 0.0)
        if self._pooled:
            prior = POOLED_PRIOR
            unit = pooled_wait_q(ready, rho, s_pass, self.slo.quantile)  # the wait at A = 1
            if unit < 0.1 * self._target.ttft_s:
                # The model sees little queueing here: the TTFT quantile is then the prompts' own
                # prefill (long prompts; only the mean ISL is known), not A's business.
                return
        else:
            prior = default_wait_coeff(self.model, isl, self.slo.quantile)
            unit = rho / (1 - rho)
        old = self.wait_coeff if self.wait_coeff is not None else prior
        # one interval moves the fit at most 3x either way (a transient is not the steady state)
        a_obs = min(max(waited / unit, 0.05 * prior, old / 3), 20 * prior, 3 * old)
        self.wait_coeff = math.exp(0.7 * math.log(old) + 0.3 * math.log(a_obs))
