"""A worker's runtime membership in the router: register, heartbeat, leave.

Started by decode and prefill workers given `--router-address`, the router's
*internal* address (its `--internal-port`; the public port does not serve
membership). Registration carries the worker's description (role, model, block
size, capacity); heartbeats carry load. The router answers a registration with
an incarnation secret that binds the worker id to this process: it goes with
every heartbeat, the deregistration and any re-registration (with a per-worker
mTLS certificate the certificate does that job too). When the router answers
`known=false` (its lease on us expired, or it restarted) the worker registers
again. Errors are logged and retried with backoff; the worker keeps serving
whatever the router does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger()


class RouterMembership:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        info: Callable[[], common_pb2.WorkerInfo],
        load: Callable[[], common_pb2.WorkerLoad],
        lease_ms: int = 10_000,
    ):
        self._stub = router_pb2_grpc.RouterServiceStub(channel)
        self._info = info
        self._load = load
        self._lease_ms = lease_ms
        self._interval_s = lease_ms / 3000.0
        self._task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()
        self.incarnation = ""  # the router's secret for our registration (kept across re-joins)

    async def register(self) -> None:
        resp = await self._stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker=self._info(), lease_ms=self._lease_ms, incarnation=self.incarnation
            ),
            timeout=5,
        )
        self.incarnation = resp.incarnation
        self._interval_s = max(resp.heartbeat_interval_ms / 1000.0, 0.05)
        self.registered.set()
        log.info("registered_with_router", worker_id=self._info().worker_id, interval_s=self._interval_s)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                if not self.registered.is_set():
                    await self.register()
                resp = await self._stub.Heartbeat(
                    router_pb2.RouterServiceHeartbeatRequest(
                        worker_id=self._info().worker_id, load=self._load(), incarnation=self.incarnation
                    ),
                    timeout=5,
                )
                if not resp.known:
                    self.registered.clear()
                    continue
                backoff = 0.1
                await asyncio.sleep(self._interval_s)
            except grpc.aio.AioRpcError as e:
                self.registered.clear()
                # PERMISSION_DENIED: another process holds our id (a restart that lost the
                # incarnation waits for the old lease to expire) or we are a static worker.
                event = (
                    "router_refused"
                    if e.code() == grpc.StatusCode.PERMISSION_DENIED
                    else "router_unreachable"
                )
                log.warning(event, code=e.code().name, details=e.details(), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if deregister and self.registered.is_set():
            try:
                await self._stub.DeregisterWorker(
                    router_pb2.DeregisterWorkerRequest(
                        worker_id=self._info().worker_id, incarnation=self.incarnation
                    ),
                    timeout=2,
                )
            except grpc.aio.AioRpcError as e:
                log.warning("deregister_failed", code=e.code().name)
