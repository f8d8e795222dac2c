"""HealthWatch: a worker's readiness from its engine's forward progress (issue 18 item 1).

Owns one `ForwardProgress` (services/worker/progress.py) and a task on the
event loop that feeds it every `interval_s` from `engine.stats()` and sets the
server's readiness from the verdict: grpc.health.v1 (the service's own name)
and the HTTP `/readyz` of the metrics port go NOT_SERVING with the reason when
the engine has work and computes nothing for `stall_s`, and SERVING again when
tokens flow. Stats and heartbeats carry the reason (`fill_load`).

Nothing here waits on the engine thread: `engine.stats()` reads the core's
thread-safe views, and the probes answer from the last verdict. So a worker
whose engine thread is held (a long step, a deadlock) still answers its probes
at once: liveness stays OK, and readiness goes only by the forward-progress
rule. The HTTP probe runs on the metrics server's own thread; if this watch's
task stops ticking (the event loop itself is blocked), `/readyz` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from pdmesh.v1 import common_pb2
from services.common.server import MeshServer
from services.engine.api import Engine
from services.worker.progress import ForwardProgress, Verdict

log = structlog.get_logger()

# Ticks missed before /readyz reports the event loop itself as stalled.
_MISSED_TICKS = 4


class HealthWatch:
    def __init__(
        self,
        engine: Engine,
        server: MeshServer,
        stall_s: float,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`stall_s` > 0; `interval_s` defaults to a quarter of it (at most 1 s)."""
        self.engine = engine
        self.server = server
        self.progress = ForwardProgress(stall_s, clock)
        self.interval_s = interval_s if interval_s is not None else min(stall_s / 4, 1.0)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._last_tick = clock()
        self._serving = True

    @property
    def verdict(self) -> Verdict:
        return self.progress.verdict

    def start(self) -> None:
        """Begin watching (after the server was set ready)."""
        self._last_tick = self._clock()
        self.server.readiness_check = self._loop_stalled
        self._task = asyncio.create_task(self._run(), name="health-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def check(self) -> Verdict:
        """Observe the engine once and apply the verdict to the server's readiness."""
        s = self.engine.stats()
        v = self.progress.observe(
            s.running + s.waiting > 0, s.prompt_tokens_computed + s.decode_tokens_computed
        )
        self._last_tick = self._clock()
        if v.serving != self._serving:
            self._serving = v.serving
            if v.serving:
                log.info("worker_serving_again")
            else:
                log.warning("worker_not_serving", reason=v.detail)
            await self.server.set_ready(v.serving, v.detail)
        return v

    def fill_load(self, load: common_pb2.WorkerLoad) -> common_pb2.WorkerLoad:
        """The verdict's reason and stall time on a load report (Stats, heartbeats)."""
        v = self.progress.verdict
        load.not_serving_reason = v.reason.value
        load.no_progress_ms = int(v.no_progress_s * 1000)
        return load

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)

    def _loop_stalled(self) -> str:
        """For the HTTP probe's thread: a reason when this task stopped ticking."""
        late = self._clock() - self._last_tick
        if self._task is not None and late > _MISSED_TICKS * self.interval_s + 1.0:
            return f"event_loop_stalled: no health check for {late:.1f}s"
        return ""
