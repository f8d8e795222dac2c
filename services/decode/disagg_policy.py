"""The conditional disaggregation rule, as a pure function of what the decode
worker knows when a request arrives.

The rule is in time, not tokens, so one default carries from a CPU at 700
prompt tokens/s to a GPU at 20,000 (issue 19). From rates the worker measures
continuously (`services/common/wait_estimator.PathRates`: every local
prefill, every remote prefill's queue + compute, every KV pull's bytes and
seconds, every decode interval) it predicts the request's time to first token
on each path:

    local  = local wait + uncached / local prefill rate
    remote = candidate's wait + uncached / remote prefill rate
             + uncached * KV bytes per token / link bandwidth

and what a local prefill costs the decodes already running here: each of them
stalls for the prefill's whole compute time (`uncached / local rate`) against
its TPOT slack, `tpot_slo * its tokens - (elapsed + queued local prefills +
remaining tokens * the decode step here)`. The step is the median inter-token
latency of the last 10 s: the pass at the current batch with the prefill stalls
left out. (It was the time-averaged mean, stalls included; that projected the
stalls being decided about as if they would continue whatever the choice, so
on a decode worker slowed by its own local prefills every decode read as past
its SLO, "lost either way", priced at nothing, and the rule kept prefilling
locally: bench/disagg_sim.py, the 8B azure 7:1 case, issue 19.) The unloaded
step (for the relative TPOT SLO) is the fastest step seen, rising toward slower
ones only with time (minutes), not with the number of samples. Score, in requests meeting their SLOs (goodput):

    local  = [local TTFT <= TTFT SLO] - sum over running decodes of min(1, (stall / slack)^2)
    remote = [remote TTFT <= TTFT SLO]

The higher score wins (reasons `local_slo`, `remote_slo`). On a tie before any
remote prefill has been measured, remote (`remote_unmeasured`: its prediction is
only the local rate borrowed, and one remote prefill measures it). On a tie, the path
that uses less of the SLO budgets (`local_cheaper`, `remote_cheaper`): local
uses `local TTFT / TTFT SLO` of this request's budget plus `stall / slack` of
every running decode's, remote `remote TTFT / TTFT SLO`: both are fractions,
so the tie-break is as hardware-free as the score. Local's share in the tie-break also
counts the decodes expected to start during the stall (the measured arrival rate x the
stall, each stalled half of it against a fresh request's slack), when the prefill worker
has no queue (one with a queue delays its own later arrivals alike): an idle decode worker
otherwise "saves the transfer" on a long prompt and blocks everything that arrives
meanwhile. The stall term is the
number of running decodes this prefill is expected to push past their SLO: a
stall that uses a fraction x of a decode's slack loses it with probability x^2
(a small bite is nearly free, since the decode absorbs it unless later stalls
add up; one near the whole slack nearly always loses it; more than the whole
always). One already past its slack at the current step is not certainly lost
(the step is a median over seconds, and it falls when the batch shrinks), and
a further stall makes it later still: its x is the stall's fraction of its
whole TPOT budget instead. Priced at nothing, as it was until session 21, a
worker whose decodes all read as past took every prompt locally and its decode
collapsed (bench/fleet_sim.py, static 7 prefill + 5 decode workers: 0.813 of
requests within the SLOs without decode-local prefill, 0.720 with it, 0.814
with this price; the measured H200 profile's agent row at 3:5, 0.65 req/s per
instance: 0.959 -> 0.971; every published profile's row checked unchanged). A request
whose remote prefill is in flight will join the batch and counts as running.
Before any decode step has been measured there is no TPOT SLO to price
against, and every running decode counts as lost. Both the hard threshold
(lost only when stall >= slack) and the linear price x were tried in the
event model of bench/disagg_sim.py: the threshold lost to disaggregation on the
70B long-prompt mix (decodes near their SLO lose it to batch growth after a
stall that "fit"), the linear price to aggregation on the CPU profile (it sent
away short prompts a decode absorbs); x^2 was the best of the three on both.

SLOs: absolute (`ttft_slo_s`, `tpot_slo_s`) when set; by default relative to
unloaded latency as Splitwise defines them (TTFT <= `ttft_slo_x` x the
unloaded prefill of this prompt, TPOT <= `tpot_slo_x` x the unloaded decode
step), both measured here, so the default needs no retuning per hardware.

`max_local_prefill_tokens` is the operator override, off by default: when set,
the old token rule runs instead (local at or below that many uncached tokens;
else remote unless the best candidate's wait exceeds the local estimate and
this worker would prefill the prompt within `max_busy_local_prefill_s`).
Dynamo's equivalent (`lib/kv-router/src/conditional_disagg.rs`) is such a
token threshold (2,048); TensorRT-LLM's disaggregated server has a similar
one. bench/disagg.py measured both rules (BENCHMARKS.md, Disaggregation).

Forced modes (tests, benchmarks, operators) override the rule but never send
a request to a candidate that does not exist. Every decision carries a reason
that the decode service counts (`pdmesh_disagg_decisions_total{path,reason}`)
and logs.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.common.wait_estimator import Rates

__all__ = ["Rates"]  # re-exported: the policy's input, measured by PathRates


class Path(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


class Mode(enum.Enum):
    AUTO = "auto"
    LOCAL = "local"
    REMOTE = "remote"


class Reason(enum.Enum):
    SHORT_PROMPT = "short_prompt"  # token override: uncached tokens <= threshold
    LONG_PROMPT = "long_prompt"  # token override: uncached tokens > threshold: remote
    NO_CANDIDATE = "no_candidate"  # no healthy prefill worker
    PREFILL_BUSY = "prefill_busy"  # token override: best candidate would start later than local
    LOCAL_SLO = "local_slo"  # time rule: local scores more requests within SLO
    REMOTE_SLO = "remote_slo"  # time rule: remote scores more (local misses TTFT or stalls decodes)
    LOCAL_CHEAPER = "local_cheaper"  # time rule: a tie, local uses less of the SLO budgets
    REMOTE_CHEAPER = "remote_cheaper"  # time rule: a tie, remote uses less of the SLO budgets
    REMOTE_UNMEASURED = "remote_unmeasured"  # time rule: a tie, and the remote path never measured
    FORCED_LOCAL = "forced_local"
    FORCED_REMOTE = "forced_remote"
    FALLBACK = "fallback"  # the remote path failed; local once


@dataclass(frozen=True)
class DisaggConfig:
    max_local_prefill_tokens: int | None = setting(
        None,
        "operator override: prefill locally when the uncached prompt has at most this many tokens and "
        "use the old token rule; unset: the time rule (predicted TTFT and decode stall vs the SLOs)",
    )
    max_busy_local_prefill_s: float = setting(
        0.5,
        "token rule only: when the prefill workers are busy, prefill locally only prompts this worker "
        "computes within this many seconds (at its measured prefill rate)",
    )
    busy_margin_s: float = setting(
        0.0, "token rule only: go local when a prefill worker's wait exceeds the local estimate by more"
    )
    ttft_slo_s: float | None = setting(
        None, "time rule: TTFT SLO in seconds; unset: ttft_slo_x x this prompt's unloaded prefill"
    )
    tpot_slo_s: float | None = setting(
        None, "time rule: TPOT SLO in seconds; unset: tpot_slo_x x the unloaded decode step"
    )
    ttft_slo_x: float = setting(3.0, "time rule: relative TTFT SLO (Splitwise's definition)")
    tpot_slo_x: float = setting(1.5, "time rule: relative TPOT SLO (Splitwise's definition)")
    default_mode: str = setting(
        "auto", "mode of requests that ask for none: auto (the rule), local or remote (benchmarks, operators)"
    )

    def __post_init__(self) -> None:
        require(
            self.default_mode in {m.value for m in Mode},
            f"default_mode must be auto, local or remote, got {self.default_mode!r}",
        )
        require(
            self.max_local_prefill_tokens is None or self.max_local_prefill_tokens >= 0,
            "max_local_prefill_tokens must be >= 0 (or unset)",
        )
        require(self.busy_margin_s >= 0, "busy_margin_s must be >= 0")
        require(self.max_busy_local_prefill_s >= 0, "max_busy_local_prefill_s must be >= 0")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            v = getattr(self, name)
            require(v is None or v > 0, f"{name} must be > 0 (or unset)")
        require(self.ttft_slo_x > 0 and self.tpot_slo_x > 0, "ttft_slo_x and tpot_slo_x must be > 0")

    @property
    def token_rule(self) -> bool:
        return self.max_local_prefill_tokens is not None


@dataclass(frozen=True)
class Candidate:
    """A prefill worker as ranked by the router (best first)."""

    worker_id: str
    address: str
    estimated_wait_s: float = 0.0
    healthy: bool = True


@dataclass(frozen=True)
class RunningDecode:
    """A request decoding on this worker (or about to: its remote prefill is in flight),
    as far as a local prefill's stall matters to it."""

    decoded: int  # tokens it has produced after its first
    remaining: int  # tokens it may still produce (max_tokens left)
    elapsed_s: float  # since its first token


@dataclass(frozen=True)
class Prediction:
    """The time rule's view of one request (logged, and read by tests and benchmarks)."""

    ttft_slo_s: float
    tpot_slo_s: float
    local_ttft_s: float
    remote_ttft_s: float
    stall_s: float
    stall_cost: float  # running decodes a local prefill is expected to push past their TPOT SLO
    slack_used: float  # the fractions of their TPOT slack it would use, summed


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: Reason
    candidate: Candidate | None = None
    prediction: Prediction | None = None

    @property
    def label(self) -> str:
        return f"{self.path.value}/{self.reason.value}"


class DisaggregationPolicy:
    def __init__(self, config: DisaggConfig):
        self.config = config

    def may_go_remote(self, uncached: int, mode: Mode) -> bool:
        """Whether a request could be sent remote (worth probing the candidates for)."""
        if mode is Mode.LOCAL:
            return False
        if mode is Mode.REMOTE or not self.config.token_rule:
            return True
        return uncached > (self.config.max_local_prefill_tokens or 0)

    def decide(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        candidates: Sequence[Candidate],
        local_wait_s: float,
        mode: Mode = Mode.AUTO,
        local_tokens_per_s: float = math.inf,
        *,
        rates: Rates | None = None,
        running: Sequence[RunningDecode] = (),
    ) -> Decision:
        """Where to prefill. `cached_tokens`: prompt tokens already in this
        worker's prefix cache; `local_wait_s`: estimated wait before a local
        prefill would start; `local_tokens_per_s`: this worker's prefill rate
        (the token rule's; the time rule reads `rates`); `running`: the decodes
        running here."""
        if mode is Mode.LOCAL:
            return Decision(Path.LOCAL, Reason.FORCED_LOCAL)
        uncached = max(prompt_tokens - cached_tokens, 0)
        token_rule = self.config.token_rule
        if mode is Mode.AUTO and token_rule and uncached <= (self.config.max_local_prefill_tokens or 0):
            return Decision(Path.LOCAL, Reason.SHORT_PROMPT)
        best = next((c for c in candidates if c.healthy), None)
        if best is None:
            return Decision(Path.LOCAL, Reason.NO_CANDIDATE)
        if mode is Mode.REMOTE:
            return Decision(Path.REMOTE, Reason.FORCED_REMOTE, best)
        if not token_rule:
            if rates is None:
                rates = Rates(local_tokens_per_s=local_tokens_per_s, remote_tokens_per_s=local_tokens_per_s)
            return self._time_rule(prompt_tokens, uncached, best, local_wait_s, rates, running)
        busy = best.estimated_wait_s > local_wait_s + self.config.busy_margin_s
        if busy and uncached / local_tokens_per_s <= self.config.max_busy_local_prefill_s:
            return Decision(Path.LOCAL, Reason.PREFILL_BUSY)
        return Decision(Path.REMOTE, Reason.LONG_PROMPT, best)

    def predict(
        self,
        prompt_tokens: int,
        uncached: int,
        best: Candidate,
        local_wait_s: float,
        rates: Rates,
        running: Sequence[RunningDecode],
    ) -> Prediction:
        cfg = self.config
        stall = uncached / rates.local_tokens_per_s
        transfer = (
            rates.link_latency_s + uncached * rates.kv_bytes_per_token / rates.link_bytes_per_s
            if rates.link_bytes_per_s
            else 0.0
        )
        local = local_wait_s + stall
        remote = best.estimated_wait_s + uncached / rates.remote_tokens_per_s + transfer
        # Unloaded: the whole prompt at this worker's prefill rate plus one decode step
        # (the first token leaves with the prefill pass).
        ttft_slo = cfg.ttft_slo_s or cfg.ttft_slo_x * (
            prompt_tokens / rates.local_tokens_per_s + rates.unloaded_tpot_s
        )
        tpot_slo = cfg.tpot_slo_s or cfg.tpot_slo_x * rates.unloaded_tpot_s
        cost = used = 0.0
        if stall > 0 and tpot_slo <= 0:
            # No decode step measured yet, so no TPOT SLO to price against: every running
            # decode counts as lost (a fresh worker learns the step from its first decodes).
            cost = used = float(len(running))
        elif stall > 0:
            step = max(rates.decode_step_s or rates.tpot_s, rates.unloaded_tpot_s)
            for r in running:
                budget = tpot_slo * (r.decoded + r.remaining)
                # The local prefills queued ahead will stall it too, whatever this decision.
                slack = budget - (r.elapsed_s + local_wait_s + r.remaining * step)
                # One already past its slack: the stall against its whole budget (module docstring).
                x = stall / slack if slack > 0 else stall / budget if budget > 0 else 0.0
                used += min(1.0, x)
                cost += min(1.0, x * x)
            # The decodes that will start during the stall: requests arriving here while this
            # prefill runs (the measured arrival rate), each joining the batch part-way through it
            # and so stalled for half of it on average, against a fresh request's whole slack.
            # Without this term an idle decode worker judged a 2,300-token prompt "cheaper" here
            # (no decode running to stall) and then blocked every request arriving in the next
            # 4.6 s: the CPU study's cond lost to both pure modes at every rate (issue 19). It
            # weighs in the tie-break only (`used`), not the score: these decodes are expected,
            # not running, and as a score their small bites sent every prompt to a scarce prefill
            # worker (1:7 splits lost up to 41% of their goodput in bench/disagg_gpu.py's model).
            # And only against an idle prefill worker: with a queue there, a prompt sent away
            # delays the requests arriving behind it at that worker in the same way, which this
            # worker cannot see, and pricing one side only sent prompts on to the scarce side
            # (8B Mooncake 1:7: 0.72x its goodput; 0.98x with this condition).
            arriving = rates.arrivals_per_s * stall
            if arriving > 0 and rates.mean_output_tokens > 1 and best.estimated_wait_s <= 0:
                slack = (tpot_slo - step) * (rates.mean_output_tokens - 1)
                x = stall / 2 / slack if slack > 0 else math.inf
                used += arriving * min(1.0, x)
        return Prediction(ttft_slo, tpot_slo, local, remote, stall, cost, used)

    def _time_rule(
        self,
        prompt_tokens: int,
        uncached: int,
        best: Candidate,
        local_wait_s: float,
        rates: Rates,
        running: Sequence[RunningDecode],
    ) -> Decision:
        p = self.predict(prompt_tokens, uncached, best, local_wait_s, rates, running)
        local = (p.local_ttft_s <= p.ttft_slo_s) - p.stall_cost
        remote = float(p.remote_ttft_s <= p.ttft_slo_s)
        if local > remote:
            return Decision(Path.LOCAL, Reason.LOCAL_SLO, prediction=p)
        if remote > local:
            return Decision(Path.REMOTE, Reason.REMOTE_SLO, best, p)
        if not rates.remote_measured:
            # A tie on priors: the remote path's rates and the link have never been measured, so
            # its prediction is the local one borrowed. Measure it once rather than trust the
            # prior forever (a fresh mesh would otherwise prefill everything locally on an idle tie).
            return Decision(Path.REMOTE, Reason.REMOTE_UNMEASURED, best, p)
        if p.local_ttft_s / p.ttft_slo_s + p.slack_used <= p.remote_ttft_s / p.ttft_slo_s:
            return Decision(Path.LOCAL, Reason.LOCAL_CHEAPER, prediction=p)
        return Decision(Path.REMOTE, Reason.REMOTE_CHEAPER, best, p)
