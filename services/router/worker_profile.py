"""Heterogeneous workers: each worker's own speed, learned online, and its warm models.

Owns one `WorkerProfile` per worker: what it registered (accelerator kind and
generation, memory headroom, warm models, model load time: WorkerInfo fields
30-33) and the medians of its last `window` *measured* seconds per prefill
token and per decode token (medians: one request queued behind a long prompt's
chunk, or one stream beside a burst, must not move a worker's rate; an
exponentially weighted mean did, and on the routing model a few such samples
priced a worker at the cap). Labels are not rates: two workers of one
generation differ (clocks, neighbours, a noisy host), so the rates come only
from what the router saw each worker do (`observe_prefill`: a first token
after `tokens` prompt tokens to compute; `observe_decode`: `tokens` generated
in `seconds`).

`predict_s` is the time a request would take on a worker: prefill + decode at
that worker's rates (the fleet's median rate while it has no sample yet, so a
new worker is neither favoured nor shunned), plus the model's load time when
the model is not warm there. `cost_per_token` divides it by the tokens the
request delivers: the router's "cost per successful token" in seconds of that
worker. Plain, synchronous.

With `route` (`--speed-route`: true; or auto, the default, while the decode
workers registered different hardware: on a homogeneous fleet the factors are
noise around 1, BENCHMARKS.md) routing reads `speeds()`: per worker, (prefill
factor, decode factor), each its measured rate over the median rate of the
workers measured (`min_samples` samples each), clamped to [1 / max_factor,
max_factor]. The kv_aware cost (services/router/policy.py) is in blocks; a
factor turns a worker's blocks into the fleet median worker's blocks, so the
cost ranks predicted time: a block to prefill on a worker twice as slow costs
two. A worker not measured yet has no
entry (factor 1). What the router feeds it (services/router/generate.py):

- a prefill sample per attempt: its time to first message over the prompt
  tokens the worker had to compute before it, the queue the router saw there
  at dispatch plus the request's own (plus one block, so a cached prompt's
  first pass counts): seconds per token of prefill work, queue included, so a
  worker with a longer queue is not taken for a slower one;
- a decode sample per attempt that streamed: its mean gap per token.

Only a model's load time is not learned: a mesh serves one model (the registry
refuses others), so every worker's is warm and `predict_s` charges nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from services.common.config import require, setting
from services.router.registry import WorkerRegistry, WorkerRole

ROUTE_MODES = ("auto", "true", "false")


@dataclass(frozen=True)
class WorkerProfileConfig:
    route: str = setting(
        "auto",
        "rank workers on their measured prefill and decode speed (issue 21): true, false, or auto: "
        "when the decode workers registered different accelerators or generations (on a homogeneous "
        "fleet the factors are noise: faults study 611-624 vs 628-639 within SLO)",
    )
    window: int = setting(32, "samples per worker and rate whose median is the rate (the newest)")
    default_prefill_s_per_token: float = setting(1e-4, "prefill rate assumed before any worker is measured")
    default_decode_s_per_token: float = setting(2e-2, "decode rate assumed before any worker is measured")
    default_load_s: float = setting(30.0, "load time charged for a cold model when the worker gave none")
    min_samples: int = setting(4, "samples of a rate before routing weighs a worker by it")
    decode_factor: bool = setting(
        False,
        "weigh the cost's decode term by the measured decode factor (false: by the prefill factor): "
        "a request's time per token follows its worker's load as much as its speed, and a slow "
        "worker given less work measured faster (BENCHMARKS.md, issue 21)",
    )
    max_factor: float = setting(
        8.0, "largest speed factor on a worker's routing cost (1 / this the smallest)"
    )

    def __post_init__(self) -> None:
        require(self.window >= 1, "window must be >= 1")
        require(self.default_prefill_s_per_token > 0, "default_prefill_s_per_token must be > 0")
        require(self.default_decode_s_per_token > 0, "default_decode_s_per_token must be > 0")
        require(self.default_load_s >= 0, "default_load_s must be >= 0")
        require(self.min_samples >= 1, "min_samples must be >= 1")
        require(self.route in ROUTE_MODES, f"route must be one of {', '.join(ROUTE_MODES)}")
        require(self.max_factor >= 1, "max_factor must be >= 1")


@dataclass
class WorkerProfile:
    worker_id: str
    accelerator: str = ""  # kind/generation as registered, e.g. "cuda/h200"; a label only
    memory_headroom_bytes: int = 0
    warm_models: frozenset[str] = field(default_factory=frozenset)
    model_load_s: float = 0.0
    prefill_s_per_token: float | None = None  # measured (the window's median); None: no sample yet
    decode_s_per_token: float | None = None
    prefill_samples: int = 0
    decode_samples: int = 0
    prefill_window: deque[float] = field(default_factory=deque)
    decode_window: deque[float] = field(default_factory=deque)


class WorkerProfiles:
    def __init__(self, config: WorkerProfileConfig | None = None):
        self.config = config or WorkerProfileConfig()
        self._by_worker: dict[str, WorkerProfile] = {}
        self._speeds: dict[str, tuple[float, float]] | None = {}  # None: recompute
        self._ranking: dict[str, tuple[float, float]] | None = {}

    def register(
        self,
        worker_id: str,
        *,
        accelerator: str = "",
        memory_headroom_bytes: int = 0,
        warm_models: tuple[str, ...] = (),
        model_load_s: float = 0.0,
    ) -> WorkerProfile:
        """A worker joined or re-registered: its description; learned rates are kept."""
        p = self._by_worker.get(worker_id) or WorkerProfile(worker_id)
        p.accelerator = accelerator
        p.memory_headroom_bytes = max(memory_headroom_bytes, 0)
        p.warm_models = frozenset(warm_models)
        p.model_load_s = max(model_load_s, 0.0)
        self._by_worker[worker_id] = p
        return p

    def forget(self, worker_id: str) -> None:
        if self._by_worker.pop(worker_id, None) is not None:
            self._speeds = None

    def get(self, worker_id: str) -> WorkerProfile | None:
        return self._by_worker.get(worker_id)

    def observe_prefill(self, worker_id: str, tokens: int, seconds: float) -> None:
        """`worker_id` computed `tokens` prompt tokens and sent a first token after `seconds`."""
        if tokens <= 0 or not seconds > 0:
            return
        p = self._profile(worker_id)
        p.prefill_s_per_token = self._add(p.prefill_window, seconds / tokens)
        p.prefill_samples += 1
        self._speeds = None

    def observe_decode(self, worker_id: str, tokens: int, seconds: float) -> None:
        """`worker_id` generated `tokens` tokens in `seconds` (after the first)."""
        if tokens <= 0 or not seconds > 0:
            return
        p = self._profile(worker_id)
        p.decode_s_per_token = self._add(p.decode_window, seconds / tokens)
        p.decode_samples += 1
        self._speeds = None

    def predict_s(self, worker_id: str, prefill_tokens: int, decode_tokens: int, model_id: str = "") -> float:
        """Seconds a request would take on `worker_id`: its prefill and decode at
        the worker's measured rates, plus the load time of a model not warm there."""
        p = self._profile(worker_id)
        pre = p.prefill_s_per_token or self._fleet_median("prefill_s_per_token")
        dec = p.decode_s_per_token or self._fleet_median("decode_s_per_token")
        t = max(prefill_tokens, 0) * pre + max(decode_tokens, 0) * dec
        if model_id and model_id not in p.warm_models:
            t += p.model_load_s or self.config.default_load_s
        return t

    def cost_per_token(
        self, worker_id: str, prefill_tokens: int, decode_tokens: int, model_id: str = ""
    ) -> float:
        """Predicted worker-seconds per token delivered (decode_tokens >= 1)."""
        return self.predict_s(worker_id, prefill_tokens, decode_tokens, model_id) / max(decode_tokens, 1)

    def ranking_factors(self) -> dict[str, tuple[float, float]]:
        """`speeds()` as the cost uses them: the decode term weighed by the prefill factor too,
        unless `decode_factor` (the measured decode factors stay in `speeds()`, shown)."""
        speeds = self.speeds()
        if self.config.decode_factor:
            return speeds
        if self._ranking is None:
            self._ranking = {w: (p, p) for w, (p, _) in speeds.items()}
        return self._ranking

    def speeds(self) -> dict[str, tuple[float, float]]:
        """Worker id -> (prefill factor, decode factor) for the workers measured (module doc).
        Recomputed after a sample or a departure; the same dict until then (do not change it)."""
        if self._speeds is None:
            self._speeds = self._compute_speeds()
            self._ranking = None
        return self._speeds

    def _compute_speeds(self) -> dict[str, tuple[float, float]]:
        need, cap = self.config.min_samples, self.config.max_factor
        pre = {w: p.prefill_s_per_token for w, p in self._by_worker.items() if p.prefill_samples >= need}
        dec = {w: p.decode_s_per_token for w, p in self._by_worker.items() if p.decode_samples >= need}
        pre_mid = statistics.median(pre.values()) if pre else 0.0
        dec_mid = statistics.median(dec.values()) if dec else 0.0

        def factor(rate: float | None, mid: float) -> float:
            if rate is None or mid <= 0:
                return 1.0
            return min(max(rate / mid, 1.0 / cap), cap)

        return {
            w: (factor(pre.get(w), pre_mid), factor(dec.get(w), dec_mid)) for w in pre.keys() | dec.keys()
        }

    def _fleet_median(self, attr: str) -> float:
        seen = [v for p in self._by_worker.values() if (v := getattr(p, attr)) is not None]
        if seen:
            return statistics.median(seen)
        if attr == "prefill_s_per_token":
            return self.config.default_prefill_s_per_token
        return self.config.default_decode_s_per_token

    def _add(self, window: deque[float], sample: float) -> float:
        """Keep `sample` in `window` (the newest `window` samples); their median."""
        window.append(sample)
        if len(window) > self.config.window:
            window.popleft()
        return statistics.median(window)

    def _profile(self, worker_id: str) -> WorkerProfile:
        p = self._by_worker.get(worker_id)
        if p is None:
            p = self._by_worker[worker_id] = WorkerProfile(worker_id)
        return p


def ranking_speeds(
    profiles: WorkerProfiles | None, registry: WorkerRegistry
) -> dict[str, tuple[float, float]] | None:
    """The speed factors the decode ranking uses, or None: with --speed-route auto, only while
    the decode workers registered different hardware (`WorkerRegistry.mixed`)."""
    if profiles is None or profiles.config.route == "false":
        return None
    if profiles.config.route == "auto" and not registry.mixed(WorkerRole.DECODE):
        return None
    return profiles.ranking_factors() or None
