"""How many prefill and decode workers a forecast load needs, jointly, within a budget.

`size_pools` is the planner's sizing rule; `dynamo_throughput_sizing` is NVIDIA
Dynamo's throughput-mode formula (docs: design-docs/planner-design.md, "Scaling
Algorithm"), reimplemented as the baseline the study compares against:

    prefill = ceil(rate * ISL / prefill_throughput_per_worker(ISL))
    decode  = ceil(rate * OSL / decode_throughput_per_worker(ITL target, context))

i.e. every worker at full utilisation. pdmesh's rule keeps the TTFT SLO with
queueing in mind. A prefill worker runs passes of up to the batch token budget
(`s_pass` seconds when full); at utilisation rho a new prompt waits behind
about rho / (1 - rho) half-passes (M/D/1), so at quantile q

    TTFT_q ~= s_1 + transfer_s + A * rho / (1 - rho),   A = -ln(1 - q) * s_pass / 2

with s_1 the prompt's own prefill time. The highest utilisation that meets the
SLO is rho_max = slack / (slack + A), slack = TTFT_slo - s_1 - transfer_s, and
prefill = ceil(rate * ISL / (tokens_per_s * rho_max)). `A` is a prior; the
planner refits it from the TTFT it measures (`wait_coeff`). Decode is sized by
Little's law: a worker can decode B sequences with steps <= the ITL target
(`capacity.decode_batch`), the load keeps rate * OSL * step(B) sequences
decoding, so decode = ceil(rate * OSL * step(B) / B).

`pooled=True` (what the planner uses; `PlannerConfig.queue_model`) sizes the
prefill pool as one queue of c workers instead of c separate ones: the
prompts go to the least-loaded worker, so a pool of c shares its slack
(Erlang C). A prompt waits behind whole passes, and a pass carries what queued
during the one before, so at utilisation rho a pass is about rho x a full one
(s_pass). With rho x s_pass as the service time, at quantile q (the M/M/c
waiting-time tail, scaled by `A`)

    wait_q(c, rho) = A * rho * s_pass / (c * (1 - rho)) * ln(C(c, c*rho) / (1 - q))   (0 when C <= 1 - q)

and prefill = the fewest c with s_1 + transfer_s + wait_q <= TTFT_slo. The
single-queue rule above asks the same utilisation of 2 workers as of 12; the
pooled one lets a big pool run hotter, which is where a diurnal peak's
worker-seconds are (bench/planner.py). Its A starts at 1 and is refit from
measured TTFT the same way; the rho x s_pass service time is what lets an A
fitted on a quiet pool (small passes) hold on a busy one (full passes): with
s_pass alone the fit from the morning under-sized the afternoon's ramp.

When prefix caching serves a share h of the prompt, only ISL * (1 - h) tokens
are prefilled. When the two pools do not fit the budget, both are cut in
proportion (each keeps at least its minimum) and the reason says "budget".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from services.planner.capacity import WorkerModel, decode_batch, prefill_rate


@dataclass(frozen=True)
class Load:
    """The forecast load of one interval."""

    rate: float  # requests per second
    isl: float  # mean prompt tokens
    osl: float  # mean output tokens
    hit_rate: float = 0.0  # share of prompt tokens served from prefix caches

    def __post_init__(self) -> None:
        if self.rate < 0 or self.isl < 0 or self.osl < 0 or not 0 <= self.hit_rate <= 1:
            raise ValueError(f"bad load {self}")

    @property
    def uncached_isl(self) -> float:
        return self.isl * (1 - self.hit_rate)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float
    quantile: float = 0.9  # the share of requests the SLO is for

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0 or not 0 < self.quantile < 1:
            raise ValueError(f"bad SLO {self}")


@dataclass(frozen=True)
class Budget:
    max_workers: int
    min_prefill: int = 1
    min_decode: int = 1

    def __post_init__(self) -> None:
        if (
            self.min_prefill < 0
            or self.min_decode < 1
            or self.max_workers < self.min_prefill + self.min_decode
        ):
            raise ValueError(f"bad budget {self}")


@dataclass(frozen=True)
class Sizing:
    prefill: int
    decode: int
    reason: str
    inputs: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.prefill + self.decode


def prefill_shape(model: WorkerModel, isl: float) -> tuple[float, float, float]:
    """(s_1, s_pass, tokens_per_s) of one prefill worker at `isl` uncached tokens a prompt."""
    tokens = max(math.ceil(isl), 1)
    batch = max(model.max_num_batched_tokens, tokens)
    s_pass = model.prefill_s(batch)
    return model.prefill_s(tokens), s_pass, batch / max(s_pass, 1e-9)


def default_wait_coeff(model: WorkerModel, isl: float, quantile: float) -> float:
    return -math.log(1 - quantile) * prefill_shape(model, isl)[1] / 2


def erlang_c(c: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with `offered` = arrival rate x service time (Erlangs)."""
    if c < 1 or offered >= c:
        return 1.0
    b = 1.0  # Erlang B by its recurrence, then C from B
    for k in range(1, c + 1):
        b = offered * b / (k + offered * b)
    rho = offered / c
    return b / (1 - rho + rho * b)


def pooled_wait_q(c: int, rho: float, s_pass: float, quantile: float, coeff: float = 1.0) -> float:
    """The `quantile` wait of a prompt in a pool of c prefill workers at utilisation rho (see above)."""
    if rho >= 1:
        return math.inf
    waits = erlang_c(c, c * rho)
    if waits <= 1 - quantile:
        return 0.0
    return coeff * s_pass * rho / (c * (1 - rho)) * math.log(waits / (1 - quantile))


POOLED_PRIOR = 1.0  # the pooled model's A before any TTFT is measured


def pooled_prefill_workers(
    load: Load, model: WorkerModel, slo: Slo, cap: int, wait_coeff: float | None = None
) -> tuple[int, str, dict[str, float]]:
    isl = load.uncached_isl
    if load.rate <= 0:
        return 0, "idle", {"rho_max": 1.0}
    s1, s_pass, tps = prefill_shape(model, isl)
    a = wait_coeff if wait_coeff is not None else POOLED_PRIOR
    slack = slo.ttft_s - s1 - model.transfer_s(int(isl))
    info = {"prefill_s": s1, "tokens_per_s": tps, "wait_coeff": a}
    if slack <= 0:
        info["rho_max"] = 0.0
        return cap, "ttft_infeasible", info
    work = load.rate * max(isl, 1.0) / tps  # busy workers' worth
    c = max(1, math.ceil(work - 1e-9))
    while c < cap and pooled_wait_q(c, work / c, s_pass, slo.quantile, a) > slack:
        c += 1
    info["rho_max"] = work / c
    if pooled_wait_q(c, work / c, s_pass, slo.quantile, a) > slack:
        return cap, "ttft_infeasible", info
    return c, "ttft", info


def prefill_workers(
    load: Load, model: WorkerModel, slo: Slo, cap: int, wait_coeff: float | None = None
) -> tuple[int, str, dict[str, float]]:
    isl = load.uncached_isl
    if load.rate <= 0:
        return 0, "idle", {"rho_max": 1.0}
    s1, _, tps = prefill_shape(model, isl)
    a = wait_coeff if wait_coeff is not None else default_wait_coeff(model, isl, slo.quantile)
    slack = slo.ttft_s - s1 - model.transfer_s(int(isl))
    rho_max = slack / (slack + a) if slack > 0 else 0.0
    info = {"prefill_s": s1, "rho_max": rho_max, "tokens_per_s": tps, "wait_coeff": a}
    if rho_max <= 0:
        return cap, "ttft_infeasible", info
    n = math.ceil(load.rate * max(isl, 1.0) / (tps * rho_max) - 1e-9)
    return min(n, cap), "ttft", info


def quantile_decode_batch(model: WorkerModel, ctx: float, slo: Slo) -> int:
    """The mean batch a worker may run so that its batch at the SLO quantile keeps steps <= the ITL SLO.

    A worker's batch is the count of sequences the router gave it that have not finished: it
    moves like a Poisson count around its mean B (sd ~ sqrt(B)), and a sequence's mean ITL is
    the step time at the batches it lived through. So size for B + z sqrt(B) <= the ITL SLO's
    batch, z the normal quantile of the SLO's share, instead of a flat share of the SLO's time
    (which at this step-time curve left 1/3 of each worker's batch unused).
    """
    limit = decode_batch(model, ctx, slo.itl_s)
    z = NormalDist().inv_cdf(slo.quantile)
    b = limit
    while b > 1 and b + z * math.sqrt(b) > limit:
        b -= 1
    # a small limit (a slow worker: 2 sequences within the ITL) leaves no room for the margin; one
    # sequence at a time is still within the SLO, and 0 would read as "the SLO is infeasible"
    return b


def decode_workers(
    load: Load, model: WorkerModel, slo: Slo, cap: int, *, quantile_margin: bool = False
) -> tuple[int, str, dict[str, float]]:
    ctx = load.isl + load.osl / 2
    batch = quantile_decode_batch(model, ctx, slo) if quantile_margin else decode_batch(model, ctx, slo.itl_s)
    info = {"decode_batch": float(batch)}
    if batch == 0:
        return cap, "itl_infeasible", info
    if load.rate <= 0:
        return 0, "idle", info
    step = model.decode_step_s(batch, int(batch * ctx))
    running = load.rate * load.osl * step
    info.update(decode_step_s=step, running=running)
    return min(math.ceil(running / batch - 1e-9), cap), "itl", info


def size_pools(
    load: Load,
    model: WorkerModel,
    slo: Slo,
    budget: Budget,
    wait_coeff: float | None = None,
    *,
    pooled: bool = False,
    decode_slo: Slo | None = None,
    decode_load: Load | None = None,
) -> Sizing:
    """`decode_slo`: size decode for this SLO with the quantile batch margin (`quantile_decode_batch`)
    instead of for `slo`'s ITL as a flat target. `decode_load`: the load decode is sized for, when its
    forecast differs from prefill's (each role's own forecast-error margin)."""
    cap = budget.max_workers
    prefill_rule = pooled_prefill_workers if pooled else prefill_workers
    p, p_why, p_info = prefill_rule(load, model, slo, cap, wait_coeff)
    dl = load if decode_load is None else decode_load
    if decode_slo is None:
        d, d_why, d_info = decode_workers(dl, model, slo, cap)
    else:
        d, d_why, d_info = decode_workers(dl, model, decode_slo, cap, quantile_margin=True)
    p, d = max(p, budget.min_prefill), max(d, budget.min_decode)
    inputs = {"rate": load.rate, "isl": load.isl, "osl": load.osl, "hit_rate": load.hit_rate}
    inputs.update({f"p_{k}": v for k, v in p_info.items()})
    inputs.update({f"d_{k}": v for k, v in d_info.items()})
    inputs.update(want_prefill=float(p), want_decode=float(d))
    reason = f"prefill:{p_why} decode:{d_why}"
    if p + d > cap:
        p, d = fit_budget(p, d, budget)
        reason += " budget"
    return Sizing(p, d, reason, inputs)


def fit_budget(p: int, d: int, budget: Budget) -> tuple[int, int]:
    """Cut (p, d) in proportion to fit max_workers, each at least its minimum."""
    spare = budget.max_workers - budget.min_prefill - budget.min_decode
    extra_p, extra_d = p - budget.min_prefill, d - budget.min_decode
    give_p = round(spare * extra_p / (extra_p + extra_d)) if extra_p + extra_d else 0
    give_p = min(give_p, extra_p)
    give_d = min(spare - give_p, extra_d)
    return budget.min_prefill + give_p, budget.min_decode + give_d


def dynamo_throughput_sizing(load: Load, model: WorkerModel, slo: Slo, budget: Budget) -> Sizing:
    """Dynamo's throughput-mode formula (every worker at full utilisation), within the same budget."""
    if load.rate <= 0:
        return Sizing(budget.min_prefill, budget.min_decode, "idle")
    isl = max(load.uncached_isl, 1.0)
    prefill_tps = prefill_rate(model, isl) * isl
    ctx = load.isl + load.osl / 2
    batch = decode_batch(model, ctx, slo.itl_s)
    if batch == 0:
        return Sizing(budget.min_prefill, budget.max_workers - budget.min_prefill, "itl_infeasible")
    decode_tps = batch / model.decode_step_s(batch, int(batch * ctx))
    p = max(math.ceil(load.rate * isl / prefill_tps - 1e-9), budget.min_prefill)
    d = max(math.ceil(load.rate * load.osl / decode_tps - 1e-9), budget.min_decode)
    reason = "dynamo_throughput"
    if p + d > budget.max_workers:
        p, d = fit_budget(p, d, budget)
        reason += " budget"
    return Sizing(p, d, reason, {"prefill_tps": prefill_tps, "decode_tps": decode_tps})
