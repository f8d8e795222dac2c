"""ForwardProgress: is this worker's engine still producing tokens? (readiness, issue 18 item 1)

A worker whose engine is deadlocked or wedged still answers its health probe
(the probe runs on the event loop, the engine on its own thread), so liveness
says nothing about it. This core decides readiness from forward progress
instead: the worker has work (requests running or waiting) and its engine's
work counter (prompt + decode tokens computed) has not moved for `stall_s`
-> not serving, reason `NO_PROGRESS`; the counter moves again (or the work is
gone) -> serving. A busy but healthy worker always moves the counter within a
step, so it is never reported stalled however slow the probe is.

Pure and synchronous, on an injected clock: `HealthWatch`
(services/worker/health.py) feeds it from engine stats; unit tests feed it by
hand.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class NotServingReason(enum.Enum):
    """Why a worker reports NOT_SERVING for readiness ("" while it is ready).
    The values travel in WorkerLoad.not_serving_reason."""

    NONE = ""
    NO_PROGRESS = "no_progress"  # work to do and no token computed for stall_s


@dataclass(frozen=True)
class Verdict:
    serving: bool
    reason: NotServingReason
    no_progress_s: float  # how long the worker has had work and computed nothing (0 when idle)

    @property
    def detail(self) -> str:
        if self.serving:
            return ""
        return f"{self.reason.value}: no token computed for {self.no_progress_s:.1f}s with requests running"


SERVING = Verdict(True, NotServingReason.NONE, 0.0)


class ForwardProgress:
    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        """`stall_s` > 0: how long work may see no progress before readiness goes."""
        if stall_s <= 0:
            raise ValueError("stall_s must be > 0")
        self.stall_s = stall_s
        self._clock = clock
        self._work: int | None = None  # the counter at the last observation
        self._since: float | None = None  # when work was last seen moving (or began); None: idle
        self.verdict = SERVING

    def observe(self, busy: bool, work: int) -> Verdict:
        """One observation: `busy` = the engine has requests (running, waiting or
        handed to it and not yet seen); `work` = a counter that grows with every
        token computed. Returns (and keeps) the verdict."""
        now = self._clock()
        moved = self._work is not None and work != self._work
        self._work = work
        if not busy:
            self._since = None
            self.verdict = SERVING
            return self.verdict
        if self._since is None or moved:
            self._since = now  # work began, or a token was computed: the clock restarts
        idle = now - self._since
        if idle >= self.stall_s:
            self.verdict = Verdict(False, NotServingReason.NO_PROGRESS, idle)
        else:
            self.verdict = Verdict(True, NotServingReason.NONE, idle)
        return self.verdict
