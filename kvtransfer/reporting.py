"""Sends a worker's transfer outcomes to the KV-transfer service for mesh-wide statistics.

The transports call `record(...)` once per pull (success or failure); records
are buffered and sent in batches by `ReportTransfers` every `flush_interval_s`,
so reporting never sits on a transfer's path. When the service is unreachable
the batch is kept (up to `max_buffer` records; beyond that the oldest are
dropped and counted) and retried at the next flush.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import grpc
import structlog

from pdmesh.v1 import kvtransfer_pb2

log = structlog.get_logger()


class ServiceReporter:
    def __init__(
        self,
        stub: object,  # kvtransfer_pb2_grpc.KvTransferServiceStub or a look-alike
        *,
        flush_interval_s: float = 1.0,
        max_buffer: int = 4096,
        rpc_timeout_s: float = 2.0,
    ):
        self._stub = stub
        self.flush_interval_s = flush_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self._buffer: deque[kvtransfer_pb2.TransferRecord] = deque(maxlen=max_buffer)
        self.dropped = 0
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    def record(
        self,
        *,
        transport: str,
        source_agent: str,
        target_agent: str,
        nbytes: int,
        seconds: float,
        error: str = "",
    ) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(
            kvtransfer_pb2.TransferRecord(
                transport=transport,
                source_agent=source_agent,
                target_agent=target_agent,
                bytes=nbytes,
                duration_ms=seconds * 1000.0,
                ok=not error,
                error=error,
            )
        )

    @property
    def pending(self) -> int:
        return len(self._buffer)

    async def flush(self) -> int:
        """Send what is buffered; returns records sent (0 when the service is unreachable)."""
        if not self._buffer:
            return 0
        batch = list(self._buffer)
        try:
            await self._stub.ReportTransfers(
                kvtransfer_pb2.ReportTransfersRequest(records=batch), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            log.warning("kv_report_failed", code=e.code().name, pending=len(batch))
            return 0
        for _ in batch:
            self._buffer.popleft()
        self.sent += len(batch)
        return len(batch)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)  # a periodic timer, not synchronisation
            await self.flush()

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kv-reporter")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()
