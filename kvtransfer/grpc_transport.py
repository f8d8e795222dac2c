"""KV bytes over gRPC: the holder's `KvSourceServicer` and the receiver's `GrpcTransport`.

The holder streams a leased handle's blocks, in token order, in chunks of at
most `chunk_bytes`; the receiver writes each chunk straight into its reserved
blocks. Copies: holder pool -> outgoing message (one join of pool views,
`grpc_wire`), gRPC's own buffers, received message -> receiver pool. There is
no staging tensor and no protobuf re-encoding.

The stream reads the whole handle (ReadBlocksRequest cannot name a subset);
a receiver that already has a prefix cached drops those bytes on arrival.

Only the worker a handle was issued to may read it (`requester_id` against the
lease's `issued_to`); with mTLS and a certificate that names its worker
(`pdmesh://decode/<worker_id>`), `requester_id` must also be that worker.

The holder pins the lease while streaming (`LeaseManager.begin_read`), checks
between chunks that the lease has not ended, and releases it after the last
chunk when asked (`release_after`). A reader that goes away mid-stream leaves
the lease held (the receiver may retry) until released or expired.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from kvtransfer.agents import AgentDirectory, AgentRecord
from kvtransfer.errors import FailureKind, KvTransferFailed, from_rpc_error
from kvtransfer.grpc_wire import ReceivedChunk, SourceChunk, WireError, decode_chunk, encode_chunk
from kvtransfer.layout import LayoutMismatch, layout_from_proto, layout_to_proto
from kvtransfer.leases import LeaseManager
from kvtransfer.pool import PoolView
from kvtransfer.transport import (
    BlockHandle,
    PulledBlockCheck,
    TransferReporter,
    TransferStats,
    check_pull,
    guarded_pull,
)
from pdmesh.v1 import kvtransfer_pb2

log = structlog.get_logger()

SERVICE_NAME = "pdmesh.v1.KvSourceService"
READ_BLOCKS = f"/{SERVICE_NAME}/ReadBlocks"
MIB = 1024 * 1024
ChannelFactory = Callable[[str, Sequence[tuple[str, Any]]], grpc.aio.Channel]


class KvSourceServicer:
    """Serves `KvSourceService.ReadBlocks` from a pool for the leases of `leases`.

    Mount with `add_kv_source(server, servicer)` (not the generated helper: the
    responses are encoded by `grpc_wire`). `on_chunk(sent_bytes)` is an optional
    observer awaited after each chunk is handed to gRPC (metrics; tests use it
    to stall a stream at a known point).
    """

    def __init__(
        self,
        pool: PoolView,
        leases: LeaseManager,
        *,
        default_chunk_bytes: int = 4 * MIB,
        max_chunk_bytes: int = 16 * MIB,
        on_chunk: Callable[[int], Awaitable[None]] | None = None,
        caller_worker: Callable[[grpc.aio.ServicerContext], str] | None = None,
    ):
        self.pool = pool
        self.leases = leases
        # The worker id the caller's client certificate names ("" = none; mTLS only).
        self.caller_worker = caller_worker
        self.default_chunk_bytes = default_chunk_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.on_chunk = on_chunk
        self.streams_started = 0
        self.streams_completed = 0

    def _chunk_size(self, asked: int) -> int:
        size = asked or self.default_chunk_bytes
        return max(4096, min(size, self.max_chunk_bytes))

    async def ReadBlocks(self, request: kvtransfer_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext):
        certified = self.caller_worker(context) if self.caller_worker is not None else ""
        if certified and certified != request.requester_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"requester_id {request.requester_id!r} is not the worker {certified!r} of the client certificate",
            )
        try:
            lease = self.leases.begin_read(request.handle_id, request.requester_id)
        except KvTransferFailed as e:
            await _abort(context, e)
            return
        self.streams_started += 1
        try:
            blocks = self._blocks_to_read(request, lease.block_ids)
            total = len(blocks) * self.pool.block_bytes
            chunk = self._chunk_size(request.chunk_bytes)
            for offset in range(0, total, chunk):
                if lease.ended is not None:
                    await _abort(
                        context,
                        KvTransferFailed(
                            FailureKind.STALE_HANDLE,
                            f"KV handle {request.handle_id!r} was {lease.ended.value} during the read",
                        ),
                    )
                    return
                n = min(chunk, total - offset)
                yield SourceChunk(offset, total, self.pool.read(blocks, offset, n))
                if self.on_chunk is not None:
                    await self.on_chunk(offset + n)
            self.leases.mark_pulled(request.handle_id)
            if request.release_after:
                self.leases.release(request.handle_id)
            self.streams_completed += 1
        except KvTransferFailed as e:
            await _abort(context, e)
        finally:
            self.leases.end_read(lease)

    def _blocks_to_read(
        self, request: kvtransfer_pb2.ReadBlocksRequest, held: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The requested subset of the lease's blocks (all of them when none is named),
        after checking the reader's pool has our layout."""
        if request.HasField("layout"):
            try:
                self.pool.layout.check_compatible(layout_from_proto(request.layout))
            except LayoutMismatch as e:
                raise KvTransferFailed(FailureKind.LAYOUT_MISMATCH, f"reader's pool: {e}") from e
        if not request.block_ids:
            return held
        stray = set(request.block_ids) - set(held)
        if stray:
            raise KvTransferFailed(
                FailureKind.INVALID,
                f"blocks {sorted(stray)[:4]} are not held under handle {request.handle_id!r}",
            )
        return tuple(request.block_ids)


async def _abort(context: grpc.aio.ServicerContext, e: KvTransferFailed) -> None:
    context.set_trailing_metadata(e.trailing_metadata())
    # The message may quote a request's handle id: keep the header small (see services.common.errors).
    message = e.message if len(e.message) <= 512 else e.message[:512] + "..."
    await context.abort(e.status_code, message)


def add_kv_source(server: grpc.aio.Server, servicer: KvSourceServicer) -> None:
    """Mount `servicer` as pdmesh.v1.KvSourceService on `server`."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "ReadBlocks": grpc.unary_stream_rpc_method_handler(
                servicer.ReadBlocks,
                request_deserializer=kvtransfer_pb2.ReadBlocksRequest.FromString,
                response_serializer=encode_chunk,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))


@dataclass(frozen=True)
class GrpcTransportConfig:
    # Measured on loopback between two processes (bench/kv_transfer.py): 384-512 KiB
    # chunks ~0.8 GB/s, 1-4 MiB ~0.45 GB/s, 128 KiB ~0.4 GB/s. Big chunks serialise
    # the holder's copy, the wire and our copy; small ones pay per-message costs.
    chunk_bytes: int = field(
        default=512 * 1024, metadata={"help": "bytes per ReadBlocks chunk asked of the holder"}
    )
    max_channels: int = field(default=64, metadata={"help": "cached channels to KvSource peers"})

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= 64 * MIB:
            raise ValueError(f"chunk_bytes must be in [4096, 64 MiB], got {self.chunk_bytes}")


class GrpcTransport:
    """Receiver side of the gRPC transport (the holder side is `KvSourceServicer`)."""

    kind = "grpc"

    def __init__(
        self,
        agent_name: str,
        pool: PoolView,
        *,
        worker_id: str,
        directory: AgentDirectory | None = None,
        config: GrpcTransportConfig | None = None,
        reporter: TransferReporter | None = None,
        channel_factory: ChannelFactory | None = None,
        require_digests: bool = False,
    ):
        self.agent_name = agent_name
        self.pool = pool
        self.layout = pool.layout
        self.worker_id = worker_id
        self.directory = directory
        self.config = config or GrpcTransportConfig()
        self.reporter = reporter
        # (address, options) -> channel; the worker passes one with its TLS credentials.
        self._new_channel = channel_factory or (lambda a, o: grpc.aio.insecure_channel(a, options=list(o)))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.integrity = PulledBlockCheck(pool, require_digests)

    async def start(self, kv_source_address: str = "") -> None:
        """Announce this worker's agent (no NIXL metadata) so holders can tell it is alive."""
        if self.directory is not None:
            await self.directory.register(
                AgentRecord(
                    name=self.agent_name,
                    metadata=b"",
                    layout=self.layout,
                    num_blocks=self.pool.num_blocks,
                    worker_id=self.worker_id,
                    kv_source_address=kv_source_address,
                    memory_type=self.pool.memory_type,
                )
            )
            self.directory.start_heartbeats()

    def attach_source(self, leases: LeaseManager) -> None:
        """Nothing to do: gRPC reads are served by the `KvSourceServicer` the holder mounts."""

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            if len(self._channels) >= self.config.max_channels:
                old_addr, old = next(iter(self._channels.items()))
                del self._channels[old_addr]
                asyncio.get_running_loop().create_task(old.close())
            limit = self.config.chunk_bytes + MIB  # a chunk plus its few header bytes
            ch = self._new_channel(
                address,
                [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
            )
            self._channels[address] = ch
        return ch

    async def pull(
        self,
        handle: BlockHandle,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        deadline_s: float,
        on_failure: Callable[[], None],
    ) -> TransferStats:
        expected: list[list[bytes] | None] = []

        async def move() -> None:
            expected.append(self.integrity.expected(handle, src_block_ids))  # before any byte moves
            await self._move(handle, src_block_ids, dst_block_ids, deadline_s)

        return await guarded_pull(
            self.kind,
            self.agent_name,
            handle,
            len(src_block_ids),
            self.pool.block_bytes,
            move,
            on_failure,
            self.reporter,
            lambda: self.integrity.verify(handle, expected[0], dst_block_ids),
        )

    async def _move(
        self, handle: BlockHandle, src: Sequence[int], dst: Sequence[int], deadline_s: float
    ) -> None:
        check_pull(self.pool, handle, src, dst, deadline_s)
        if not handle.kv_source_address:
            raise KvTransferFailed(
                FailureKind.INVALID, f"handle {handle.handle_id!r} has no kv_source_address"
            )
        # Ask for just the blocks we lack, in `src` order; chunk i of the stream is dst[i].
        dst_at: list[int | None] = list(dst)
        total = len(src) * self.pool.block_bytes
        read = self._channel(handle.kv_source_address).unary_stream(
            READ_BLOCKS,
            request_serializer=kvtransfer_pb2.ReadBlocksRequest.SerializeToString,
            response_deserializer=decode_chunk,
        )
        call = read(
            kvtransfer_pb2.ReadBlocksRequest(
                handle_id=handle.handle_id,
                requester_id=self.worker_id,
                chunk_bytes=self.config.chunk_bytes,
                release_after=True,
                block_ids=list(src),
                layout=layout_to_proto(self.pool.layout),
            ),
            timeout=deadline_s,
        )
        received = 0
        t_end = time.monotonic() + deadline_s
        try:
            async with asyncio.timeout(deadline_s + 1.0):  # backstop if the call deadline is not honoured
                async for chunk in call:
                    self._check_chunk(handle, chunk, received, total)
                    self._write(dst_at, chunk)
                    received += len(chunk.data)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"reading {handle.handle_id!r} from {handle.kv_source_address}") from e
        except WireError as e:
            raise KvTransferFailed(
                FailureKind.TRUNCATED, f"malformed chunk of {handle.handle_id!r}: {e}"
            ) from e
        except TimeoutError as e:
            raise KvTransferFailed(
                FailureKind.TIMEOUT, f"reading {handle.handle_id!r} took longer than {deadline_s:.3f} s"
            ) from e
        finally:
            call.cancel()  # no-op when finished; stops the stream on any failure
        if received != total:
            kind = FailureKind.TIMEOUT if time.monotonic() > t_end else FailureKind.TRUNCATED
            raise KvTransferFailed(
                kind, f"stream of {handle.handle_id!r} ended after {received} of {total} bytes"
            )

    @staticmethod
    def _check_chunk(handle: BlockHandle, chunk: ReceivedChunk, received: int, total: int) -> None:
        if chunk.total_bytes != total:
            raise KvTransferFailed(
                FailureKind.LAYOUT_MISMATCH,
                f"holder has {chunk.total_bytes} bytes for {handle.handle_id!r}, we asked for {total}",
            )
        if chunk.offset != received:
            raise KvTransferFailed(
                FailureKind.TRUNCATED, f"chunk of {handle.handle_id!r} at {chunk.offset}, expected {received}"
            )
        if received + len(chunk.data) > total:
            raise KvTransferFailed(
                FailureKind.TRUNCATED, f"stream of {handle.handle_id!r} overruns {total} bytes"
            )

    def _write(self, dst_at: list[int | None], chunk: ReceivedChunk) -> None:
        """Copy the parts of `chunk` that belong to wanted blocks into their dst blocks."""
        bb = self.pool.block_bytes
        pos, end = chunk.offset, chunk.offset + len(chunk.data)
        while pos < end:
            i, within = divmod(pos, bb)
            take = min(bb - within, end - pos)
            d = dst_at[i]
            if d is not None:
                start = pos - chunk.offset
                self.pool.write((d,), within, chunk.data[start : start + take])
            pos += take

    async def close(self) -> None:
        self.integrity.hasher.close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self.directory is not None:
            await self.directory.deregister()
