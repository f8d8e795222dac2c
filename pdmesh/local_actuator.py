"""The planner's `local` actuator: worker processes of `pdmesh up --planner`.

`LocalActuator` implements services/planner/actuators.py's `Actuator` over the
processes the `pdmesh up` supervisor owns, through `WorkerProcesses` (the
launcher operations it needs; `LauncherWorkers` is the real one, tests pass
fakes). It owns the list of each role's workers; `scale` returns at once and
the starts and drains run as tasks on the planner's event loop (blocking
launcher calls in threads), so a slow drain never stalls the next decision.

Scale up, per new worker: launch it (it joins the router's internal listener
with `--router-address`), wait for its health SERVING, then until the router
lists it SERVING (only then does it get traffic); the seconds from launch to
that point go to `on_startup` (Planner.observe_startup).

Scale down, per removed worker (the newest started first; the static ones
`pdmesh up` began with last), in this order, so that nothing is lost:
1. `retiring`: the supervisor no longer restarts or reports it;
2. SIGTERM: the worker drains (services/common/server.py): health
   NOT_SERVING, new calls refused with UNAVAILABLE before any token (the router
   retries them elsewhere), in-flight streams and remote prefills run to their
   end, their KV pulled or released by the calls that hold it;
3. wait until the router no longer lists it SERVING (its health probe saw the
   drain), so no new request is routed there;
4. wait for the process to exit (SIGKILL only after `drain_timeout_s`);
5. forget it (the launcher stops tracking the process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog

from pdmesh.launcher import LaunchError
from pdmesh.v1 import router_pb2, router_pb2_grpc
from services.common.tls import sync_channel
from services.planner.actuators import ROLES, ActuatorError

log = structlog.get_logger()


class WorkerProcesses(Protocol):
    """What the actuator does to processes (blocking calls; run in threads)."""

    def launch(self, role: str) -> Any:
        """Start one more worker of `role` (does not wait); returns its handle."""
        ...

    def wait_ready(self, worker: Any) -> None:
        """Block until the worker's health is SERVING (LaunchError when it exits or times out)."""
        ...

    def routed(self, worker: Any) -> bool:
        """The router lists the worker SERVING (it may be routed to)."""
        ...

    def alive(self, worker: Any) -> bool: ...

    def terminate(self, worker: Any) -> None:
        """SIGTERM: start the worker's drain."""
        ...

    def wait_exit(self, worker: Any, timeout_s: float) -> int | None:
        """Wait for exit; SIGKILL after `timeout_s`. Returns the exit code."""
        ...

    def forget(self, worker: Any) -> None: ...

    def abort_waits(self) -> None:
        """Make `wait_ready` calls in progress give up (the mesh is stopping)."""
        ...


@dataclass
class _Worker:
    role: str
    handle: Any = None
    static: bool = False  # one `pdmesh up` started: removed last
    started_at: float = field(default_factory=time.monotonic)


class LocalActuator:
    def __init__(
        self,
        processes: WorkerProcesses,
        initial: dict[str, list[Any]],
        *,
        on_startup: Callable[[float], None] | None = None,
        ready_timeout_s: float = 180.0,
        unroute_timeout_s: float = 30.0,
        drain_timeout_s: float = 120.0,
        poll_s: float = 0.1,
    ):
        self.processes = processes
        self.on_startup = on_startup
        self.ready_timeout_s = ready_timeout_s
        self.unroute_timeout_s = unroute_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self.workers: dict[str, list[_Worker]] = {
            role: [_Worker(role, h, static=True) for h in initial.get(role, [])] for role in ROLES
        }
        # id() -> handle of every worker drained by us (kept: the supervisor must never take one
        # for a crash, and a kept handle's id is never reused by a new worker)
        self.retiring: dict[int, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.failed_starts = 0

    async def replicas(self) -> dict[str, int]:
        # A worker that died (not drained by us) no longer counts: the planner replaces it.
        for role, ws in self.workers.items():
            self.workers[role] = [w for w in ws if w.handle is None or self.processes.alive(w.handle)]
        return {role: len(ws) for role, ws in self.workers.items()}

    async def scale(self, role: str, replicas: int) -> None:
        if role not in self.workers:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        if replicas < 0:
            raise ActuatorError(f"replicas must be >= 0, got {replicas}")
        ws = self.workers[role]
        while len(ws) < replicas:
            w = _Worker(role)
            ws.append(w)
            self._spawn(self._start(w))
        if len(ws) > replicas:
            # newest first, the static ones last; a worker still starting is newest of all
            order = sorted(ws, key=lambda w: (w.static, -w.started_at))
            for w in order[: len(ws) - replicas]:
                ws.remove(w)
                if w.handle is not None:  # at once: the supervisor's next look must not see a crash
                    self.retiring[id(w.handle)] = w.handle
                self._spawn(self._retire(w))
        log.info("planner.local_scale", role=role, replicas=replicas)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start(self, w: _Worker) -> None:
        t0 = time.monotonic()
        try:
            w.handle = await asyncio.to_thread(self.processes.launch, w.role)
            await asyncio.to_thread(self.processes.wait_ready, w.handle)
            await self._until(lambda: self.processes.routed(w.handle), self.ready_timeout_s, "routed")
        except (OSError, RuntimeError, ActuatorError) as e:  # LaunchError is a RuntimeError
            self.failed_starts += 1
            log.warning("planner.start_failed", role=w.role, error=str(e))
            if w in self.workers[w.role]:
                self.workers[w.role].remove(w)
            if w.handle is not None:
                self._spawn(self._retire(w))
            return
        seconds = time.monotonic() - t0
        log.info("planner.worker_started", role=w.role, seconds=round(seconds, 3))
        if self.on_startup is not None:
            self.on_startup(seconds)

    async def _retire(self, w: _Worker) -> None:
        while w.handle is None:  # scaled down while its launch was still being made
            await asyncio.sleep(self.poll_s)
        handle = w.handle
        self.retiring[id(handle)] = handle
        self.processes.terminate(handle)
        try:
            await self._until(lambda: not self.processes.routed(handle), self.unroute_timeout_s, "unrouted")
        except TimeoutError:
            log.warning("planner.still_routed", role=w.role)  # the drain still refuses new calls
        code = await asyncio.to_thread(self.processes.wait_exit, handle, self.drain_timeout_s)
        self.processes.forget(handle)
        log.info("planner.worker_drained", role=w.role, exit_code=code)

    async def _until(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(cond):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker not {what} after {timeout_s:.0f}s")
            await asyncio.sleep(self.poll_s)  # polling the router's view, not synchronisation

    async def close(self) -> None:
        """Let drains in progress finish and starts give up (pdmesh up is stopping; a worker
        half started is then drained like any other)."""
        self.processes.abort_waits()
        while self.tasks:  # an abandoned start spawns its drain: wait for that too
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


def set_flag(args: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    """`args` with `flag`'s value replaced (or the pair appended)."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return tuple(out)


class LauncherWorkers:
    """`WorkerProcesses` over `pdmesh up`'s Launcher: a new worker is a copy of the role's
    first worker's spec under a new name and worker id, joining the router at run time."""

    def __init__(
        self,
        launcher: Any,
        templates: dict[str, Any],
        router_internal: str,
        *,
        tls: Any = None,
        cert_flags: Callable[[str, str], tuple[str, ...]] = lambda role, name: (),
        ready_timeout_s: float = 180.0,
    ):
        self.launcher = launcher
        self.templates = templates
        self.router_internal = router_internal
        self.tls = tls
        self.cert_flags = cert_flags
        self.ready_timeout_s = ready_timeout_s
        self._next = {role: 0 for role in ROLES}
        self._lock = threading.Lock()  # launches run in threads: one name, one start at a time
        self._aborted = threading.Event()

    def _name(self, role: str) -> str:
        taken = {s.spec.name for s in self.launcher.services}
        while f"{role}-{self._next[role]}" in taken:
            self._next[role] += 1
        name = f"{role}-{self._next[role]}"
        self._next[role] += 1
        return name

    def launch(self, role: str) -> Any:
        template = self.templates.get(role)
        if template is None:
            raise ActuatorError(f"no {role} worker to copy (start pdmesh up with at least one)")
        with self._lock:
            name = self._name(role)
            return self.launcher.start(dataclasses.replace(template, name=name, args=self._args(role, name)))

    def _args(self, role: str, name: str) -> tuple[str, ...]:
        template = self.templates[role]
        args = set_flag(template.args, "--worker-id", name)
        args = set_flag(args, "--router-address", self.router_internal)
        if "--metrics-port" in args:
            args = set_flag(args, "--metrics-port", "0")
        cert = self.cert_flags(role, name)
        for flag, value in zip(cert[::2], cert[1::2], strict=True):
            args = set_flag(args, flag, value)
        return args

    def wait_ready(self, worker: Any) -> None:
        def check() -> None:
            if self._aborted.is_set():
                raise LaunchError(f"{worker.spec.name}: start abandoned, the mesh is stopping")

        self.launcher.wait_ready(worker, self.ready_timeout_s, on_poll=check)

    def abort_waits(self) -> None:
        self._aborted.set()

    def routed(self, worker: Any) -> bool:
        with sync_channel(self.router_internal, self.tls) as channel:
            try:
                listed = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=5
                )
            except grpc.RpcError:
                return False
        return any(
            w.info.worker_id == worker.spec.name and w.health == router_pb2.WORKER_HEALTH_SERVING
            for w in listed.workers
        )

    def alive(self, worker: Any) -> bool:
        return worker.proc.poll() is None

    def terminate(self, worker: Any) -> None:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, worker: Any, timeout_s: float) -> int | None:
        return self.launcher.stop(worker, timeout_s)  # SIGTERM again is harmless; SIGKILL after

    def forget(self, worker: Any) -> None:
        if worker in self.launcher.services:
            self.launcher.services.remove(worker)
