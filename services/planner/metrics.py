"""The planner's Prometheus metrics: its decisions, their inputs and its actuator's errors.

- `pdmesh_planner_decisions_total{reason,changed}`: one per tick, per reason word
  (the sizing's "prefill:ttft decode:itl", "itl_measured_over_slo", ...);
- `pdmesh_planner_desired_replicas{role}`: what the planner wants (what an HPA
  or KEDA scaler follows with the metrics-only actuator);
- `pdmesh_planner_input{name}`: the last decision's inputs (observed and
  forecast rate, ISL, OSL, hit rate, measured TTFT/ITL quantiles);
- `pdmesh_planner_startup_seconds`: the start-up time the forecast horizon covers;
- `pdmesh_planner_actuator_errors_total`, `pdmesh_planner_stats_errors_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.planner.planner import Decision, Observation

DESIRED = "pdmesh_planner_desired_replicas"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry, desired: Gauge | None = None):
        r = registry
        # the metrics-only actuator owns the desired gauge when it is the actuator (one series per role)
        self.desired = desired or Gauge(DESIRED, "Workers per role the planner wants", ["role"], registry=r)
        self._decisions = Counter(
            "pdmesh_planner_decisions", "Planner decisions by reason word", ["reason", "changed"], registry=r
        )
        self._inputs = Gauge("pdmesh_planner_input", "The last decision's inputs", ["name"], registry=r)
        self._startup = Gauge(
            "pdmesh_planner_startup_seconds", "Worker start-up time the forecast covers", registry=r
        )
        self._actuator_errors = Counter(
            "pdmesh_planner_actuator_errors", "Scale calls that failed", ["role"], registry=r
        )
        self._stats_errors = Counter("pdmesh_planner_stats_errors", "Stats reads that failed", registry=r)

    def decision(self, d: Decision, obs: Observation, interval_s: float, startup_s: float) -> None:
        for word in d.reason.split():
            self._decisions.labels(reason=word, changed=str(d.changed).lower()).inc()
        self.desired.labels(role="prefill").set(d.prefill)
        self.desired.labels(role="decode").set(d.decode)
        for name, value in decision_inputs(d, obs, interval_s).items():
            self._inputs.labels(name=name).set(value)
        self._startup.set(startup_s)

    def actuator_error(self, role: str) -> None:
        self._actuator_errors.labels(role=role).inc()

    def stats_error(self) -> None:
        self._stats_errors.inc()


def decision_inputs(d: Decision, obs: Observation, interval_s: float) -> dict[str, float]:
    """What a decision was made from (logged with it, exported, shown by `pdmesh workers`)."""
    out = {
        "observed_rate": obs.requests / interval_s,
        "observed_isl": obs.mean_isl,
        "observed_osl": obs.mean_osl,
        "observed_hit_rate": obs.hit_rate,
        "forecast_rate": d.forecast.rate,
        "forecast_isl": d.forecast.isl,
        "forecast_osl": d.forecast.osl,
        "prefill_workers": float(obs.prefill_workers),
        "decode_workers": float(obs.decode_workers),
    }
    if obs.ttft_q_s is not None:
        out["measured_ttft_q_s"] = obs.ttft_q_s
    if obs.itl_q_s is not None:
        out["measured_itl_q_s"] = obs.itl_q_s
    return out
