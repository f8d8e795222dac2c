"""The planner's control loop: read, decide, actuate, every interval.

`PlannerLoop.step()` is one interval: read a `Snapshot` (services/planner/
stats_reader.py or any object with `async read(now)`), turn the difference to the
previous one into an `Observation` with the pools' sizes from the actuator,
call `Planner.tick`, hand a changed size to the actuator, and record the
decision (metrics, a JSON log line with its inputs, an optional state file that
`pdmesh workers --planner-state` prints).

Start-up time is measured here for every actuator alike: when a role is scaled
up from n to m, the first read that shows m of its workers healthy at the
router gives `Planner.observe_startup` the time since the scale call.

An actuator error is logged and counted; the next interval tries again (the
planner's decision is still its wish). The clock is the caller's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from services.planner.actuators import ROLES, Actuator, ActuatorError
from services.planner.metrics import PlannerMetrics, decision_inputs
from services.planner.observe import Snapshot, observation_between
from services.planner.planner import Decision, Planner
from services.planner.stats_reader import StatsUnavailable

log = structlog.get_logger()


class SnapshotSource(Protocol):
    async def read(self, now: float) -> Snapshot: ...


class PlannerLoop:
    def __init__(
        self,
        planner: Planner,
        source: SnapshotSource,
        actuator: Actuator,
        metrics: PlannerMetrics | None = None,
        *,
        state_file: str | os.PathLike | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.planner = planner
        self.source = source
        self.actuator = actuator
        self.metrics = metrics
        self.state_file = Path(state_file) if state_file else None
        self.clock = clock
        self.last: Decision | None = None
        self._prev: Snapshot | None = None
        self._starting: dict[str, tuple[int, float]] = {}  # role -> (size asked for, when)

    async def step(self) -> Decision | None:
        """One interval; None when there is no decision yet (the first read, or no Stats)."""
        now = self.clock()
        try:
            cur = await self.source.read(now)
        except StatsUnavailable as e:
            log.warning("planner.stats_unavailable", error=str(e))
            if self.metrics is not None:
                self.metrics.stats_error()
            return None
        self._watch_startup(cur, now)
        prev, self._prev = self._prev, cur
        if prev is None:
            return None
        pools = await self.actuator.replicas()
        obs = observation_between(prev, cur, pools, self.planner.slo.quantile)
        interval = self.planner.config.interval_s
        elapsed = cur.at_s - prev.at_s
        if elapsed > 0 and abs(elapsed - interval) > 0.05 * interval:
            # the planner reads requests per configured interval; a late read holds more of them
            obs = dataclasses.replace(obs, requests=round(obs.requests * interval / elapsed))
        d = self.planner.tick(obs, now)
        for role, want in (("prefill", d.prefill), ("decode", d.decode)):
            have = pools.get(role, 0)
            if want == have:
                continue
            try:
                await self.actuator.scale(role, want)
            except ActuatorError as e:
                log.warning("planner.scale_failed", role=role, replicas=want, error=str(e))
                if self.metrics is not None:
                    self.metrics.actuator_error(role)
                continue
            if want > have:
                self._starting[role] = (want, now)
            else:
                self._starting.pop(role, None)
        self.last = d
        inputs = decision_inputs(d, obs, self.planner.config.interval_s)
        log.info(
            "planner.decision",
            prefill=d.prefill,
            decode=d.decode,
            changed=d.changed,
            reason=d.reason,
            lead_intervals=self.planner.lead,
            startup_s=round(self.planner.startup_s, 3),
            **{k: round(v, 4) for k, v in inputs.items()},
        )
        if self.metrics is not None:
            self.metrics.decision(d, obs, self.planner.config.interval_s, self.planner.startup_s)
        self._write_state(d, inputs)
        return d

    def _watch_startup(self, cur: Snapshot, now: float) -> None:
        for role in ROLES:
            pending = self._starting.get(role)
            if pending is not None and cur.ready.get(role, 0) >= pending[0]:
                del self._starting[role]
                self.planner.observe_startup(now - pending[1])
                log.info("planner.startup_measured", role=role, seconds=round(now - pending[1], 3))

    def _write_state(self, d: Decision, inputs: dict[str, float]) -> None:
        if self.state_file is None:
            return
        state = {
            "at_unix_s": time.time(),
            "prefill": d.prefill,
            "decode": d.decode,
            "changed": d.changed,
            "reason": d.reason,
            "startup_s": self.planner.startup_s,
            "inputs": inputs,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)  # readers never see half a file

    async def run(self, stop: asyncio.Event) -> None:
        """Step every interval until `stop` is set."""
        interval = self.planner.config.interval_s
        while not stop.is_set():
            await self.step()
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
