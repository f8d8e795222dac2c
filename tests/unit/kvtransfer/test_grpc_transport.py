"""The gRPC transport against a KvSource on port 0 in this process: bytes, faults, no leaks."""

import asyncio
import socket

import grpc
import pytest

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.grpc_transport import GrpcTransport, GrpcTransportConfig, KvSourceServicer, add_kv_source
from kvtransfer.layout import KvLayout
from kvtransfer.leases import LeaseManager
from kvtransfer.pool import PoolView
from kvtransfer.testing import BlockPool, checksum, expected_checksum, fill_blocks
from kvtransfer.transport import BlockHandle
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from tests.support.poll import eventually

LAYOUT = KvLayout(2, 2, 16, "float32", 4)  # 2048-byte blocks
SEED = 3
N = 16


class Holder:
    def __init__(self, on_chunk=None):
        self.pool = PoolView(LAYOUT.allocate_pool(N), LAYOUT)
        fill_blocks(self.pool, SEED)
        self.blocks = BlockPool(N)
        self.leases = LeaseManager()
        self.source = KvSourceServicer(self.pool, self.leases, default_chunk_bytes=5000, on_chunk=on_chunk)
        self.server = MeshServer(ServerConfig(port=0), "pdmesh.v1.KvSourceService")
        add_kv_source(self.server.server, self.source)

    def export(self, handle_id, ids, issued_to="dec-1"):
        ids = self.blocks.take(ids)
        lease = self.leases.issue(
            handle_id, ids, issued_to, "dec-agent", on_free=lambda: self.blocks.free(ids)
        )
        return BlockHandle(
            handle_id,
            "holder",
            LAYOUT,
            tuple(ids),
            len(ids) * 4,
            self.server.address,
            issued_to,
            lease.expires_unix_ms,
        )


class Receiver:
    def __init__(self, layout=LAYOUT, worker_id="dec-1", chunk_bytes=5000):
        self.pool = PoolView(layout.allocate_pool(N), layout)
        self.blocks = BlockPool(N)
        self.transport = GrpcTransport(
            "dec-agent", self.pool, worker_id=worker_id, config=GrpcTransportConfig(chunk_bytes=chunk_bytes)
        )

    async def pull(self, handle, src, dst_ids, deadline_s=10.0):
        dst = self.blocks.take(dst_ids)
        return dst, await self.transport.pull(
            handle, src, dst, deadline_s=deadline_s, on_failure=lambda: self.blocks.free(dst)
        )


@pytest.fixture
async def pair():
    holder = Holder()
    await holder.server.start()
    receiver = Receiver()
    yield holder, receiver
    await receiver.transport.close()
    await holder.server.stop()
    assert receiver.blocks.num_free == N  # every test frees what it kept
    holder.leases.close()
    await eventually(
        lambda: holder.blocks.num_free == N, what="the holder's blocks (a cancelled read unpins late)"
    )


async def expect_failure(kind, coro, receiver):
    before = receiver.blocks.num_free
    with pytest.raises(KvTransferFailed) as e:
        await coro
    assert e.value.kind == kind, e.value
    assert receiver.blocks.num_free == before + 0  # the reservation came back (take + free)
    return e.value


async def test_scattered_blocks_arrive_identical_and_the_lease_is_released(pair):
    holder, receiver = pair
    h = holder.export("h1", [5, 1, 9, 2, 3])
    dst, stats = await receiver.pull(h, h.block_ids, [15, 0, 7, 8, 4])
    assert checksum(receiver.pool, dst) == expected_checksum(LAYOUT.block_bytes, SEED, [5, 1, 9, 2, 3])
    assert stats.bytes == 5 * LAYOUT.block_bytes and stats.transport == "grpc"
    assert holder.blocks.num_free == N and holder.leases.counters.released == 1
    receiver.blocks.free(dst)


async def test_a_suffix_pull_skips_the_blocks_the_receiver_has(pair):
    holder, receiver = pair
    h = holder.export("h2", [4, 5, 6, 7])
    dst, stats = await receiver.pull(h, h.block_ids[2:], [1, 0])
    assert checksum(receiver.pool, dst) == expected_checksum(LAYOUT.block_bytes, SEED, [6, 7])
    assert receiver.pool.block_bytes_of(2) == bytes(LAYOUT.block_bytes)  # nothing else written
    assert stats.blocks == 2
    receiver.blocks.free(dst)


async def test_stale_handle_after_release(pair):
    holder, receiver = pair
    h = holder.export("h3", [1])
    dst, _ = await receiver.pull(h, h.block_ids, [0])
    receiver.blocks.free(dst)
    err = await expect_failure(FailureKind.STALE_HANDLE, receiver.pull(h, h.block_ids, [0]), receiver)
    assert "released" in str(err)


async def test_another_worker_may_not_read(pair):
    holder, _ = pair
    h = holder.export("h4", [1, 2])
    thief = Receiver(worker_id="dec-2")
    await expect_failure(FailureKind.NOT_OWNER, thief.pull(h, h.block_ids, [0, 1]), thief)
    await thief.transport.close()
    assert holder.leases.held == 1  # still there for its owner


async def test_layout_mismatch_before_and_during_the_stream(pair):
    holder, _ = pair
    h = holder.export("h5", [1, 2])
    other = KvLayout(2, 2, 16, "float16", 4)
    wrong = Receiver(layout=other)
    await expect_failure(FailureKind.LAYOUT_MISMATCH, wrong.pull(h, h.block_ids, [0, 1]), wrong)
    # A handle that lies about its layout: the holder's byte count gives it away.
    liar = BlockHandle(
        h.handle_id, h.agent_name, other, h.block_ids, h.num_tokens, h.kv_source_address, "dec-1"
    )
    await expect_failure(FailureKind.LAYOUT_MISMATCH, wrong.pull(liar, liar.block_ids, [0, 1]), wrong)
    await wrong.transport.close()


async def test_dead_holder_address_is_peer_dead(pair):
    holder, receiver = pair
    h = holder.export("h6", [1])
    with socket.socket() as s:  # a port that was free a moment ago; nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = BlockHandle(h.handle_id, h.agent_name, LAYOUT, h.block_ids, 4, f"127.0.0.1:{port}", "dec-1")
    await expect_failure(FailureKind.PEER_DEAD, receiver.pull(gone, gone.block_ids, [0]), receiver)


class ShortSource(kvtransfer_pb2_grpc.KvSourceServiceServicer):
    """Speaks the contract through the generated protobuf code, but misbehaves."""

    def __init__(self, mode):
        self.mode = mode

    async def ReadBlocks(self, request, context):
        total = 2 * LAYOUT.block_bytes
        if self.mode == "gap":
            yield kvtransfer_pb2.ReadBlocksResponse(offset=100, data=b"x" * 10, total_bytes=total)
        else:  # ends cleanly after half of the bytes
            yield kvtransfer_pb2.ReadBlocksResponse(offset=0, data=b"x" * (total // 2), total_bytes=total)


@pytest.mark.parametrize("mode", ["short", "gap"])
async def test_truncated_streams_are_detected(mode):
    server = grpc.aio.server()
    kvtransfer_pb2_grpc.add_KvSourceServiceServicer_to_server(ShortSource(mode), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    receiver = Receiver()
    h = BlockHandle("t", "holder", LAYOUT, (0, 1), 8, f"127.0.0.1:{port}", "dec-1")
    await expect_failure(FailureKind.TRUNCATED, receiver.pull(h, h.block_ids, [3, 4]), receiver)
    await receiver.transport.close()
    await server.stop(0)
    assert receiver.blocks.num_free == N


async def test_a_stalled_stream_times_out_and_frees_both_sides():
    never = asyncio.Event()

    async def stall(sent):
        await never.wait()

    holder = Holder(on_chunk=stall)
    await holder.server.start()
    receiver = Receiver()
    h = holder.export("slow", [0, 1, 2, 3])
    await expect_failure(
        FailureKind.TIMEOUT, receiver.pull(h, h.block_ids, [0, 1, 2, 3], deadline_s=0.3), receiver
    )
    assert receiver.blocks.num_free == N
    # The holder keeps the lease (the receiver may retry) until released.
    assert holder.leases.release("slow")
    await receiver.transport.close()
    await holder.server.stop()
    # The stalled read still pins the released lease; its handler's clean-up (which unpins and
    # frees) runs once grpc has cancelled it, which may be just after stop() returns.
    await eventually(lambda: holder.blocks.num_free == N, what="the pinned blocks to come back")


async def test_a_lease_that_ends_mid_read_stops_the_stream_and_frees_after():
    holder = None

    async def expire_everything(sent):
        holder.leases.expire(now=float("inf"))
        assert holder.blocks.num_free < N  # pinned by the reader

    holder = Holder(on_chunk=expire_everything)
    await holder.server.start()
    receiver = Receiver()
    h = holder.export("mid", [0, 1, 2, 3])
    err = await expect_failure(
        FailureKind.STALE_HANDLE, receiver.pull(h, h.block_ids, [0, 1, 2, 3]), receiver
    )
    assert "expired during the read" in str(err)
    await receiver.transport.close()
    await holder.server.stop()
    assert holder.blocks.num_free == N and receiver.blocks.num_free == N


async def test_a_standard_generated_client_reads_our_stream(pair):
    holder, _ = pair
    holder.export("std", [3, 8, 9])
    async with grpc.aio.insecure_channel(holder.server.address) as ch:
        stub = kvtransfer_pb2_grpc.KvSourceServiceStub(ch)
        req = kvtransfer_pb2.ReadBlocksRequest(handle_id="std", requester_id="dec-1", chunk_bytes=4096)
        chunks = [c async for c in stub.ReadBlocks(req)]
    assert [c.offset for c in chunks] == [0, 4096]
    assert all(c.total_bytes == 3 * LAYOUT.block_bytes for c in chunks)
    data = b"".join(c.data for c in chunks)
    assert data == b"".join(bytes(m) for m in holder.pool.read([3, 8, 9], 0, 3 * LAYOUT.block_bytes))
    assert holder.leases.release("std")  # release_after was not asked for


async def test_only_the_requested_blocks_cross_the_wire():
    sent = []

    async def on_chunk(upto):
        sent.append(upto)

    holder = Holder(on_chunk=on_chunk)
    await holder.server.start()
    receiver = Receiver()
    try:
        h = holder.export("sub", [3, 4, 5, 6, 7, 8])
        dst, _ = await receiver.pull(h, h.block_ids[4:], [0, 1])
        assert sent[-1] == 2 * LAYOUT.block_bytes  # two blocks streamed, not six
        assert checksum(receiver.pool, dst) == expected_checksum(LAYOUT.block_bytes, SEED, [7, 8])
        receiver.blocks.free(dst)
    finally:
        await receiver.transport.close()
        await holder.server.stop()
        holder.leases.close()
    assert receiver.blocks.num_free == N and holder.blocks.num_free == N


async def test_same_block_bytes_but_another_layout_is_refused_by_the_source(pair):
    holder, _ = pair
    h = holder.export("same-bytes", [1, 2])
    other = KvLayout(2, 4, 16, "float16", 4)  # 2048-byte blocks too, different heads and dtype
    assert other.block_bytes == LAYOUT.block_bytes
    wrong = Receiver(layout=other)
    handle = BlockHandle(
        h.handle_id, h.agent_name, other, h.block_ids, h.num_tokens, h.kv_source_address, "dec-1"
    )
    err = await expect_failure(
        FailureKind.LAYOUT_MISMATCH, wrong.pull(handle, handle.block_ids, [0, 1]), wrong
    )
    assert "reader's pool" in str(err)
    await wrong.transport.close()


@pytest.mark.parametrize(
    "other",
    [
        KvLayout(2, 2, 16, "float32", 4, quant="int8"),  # receiver's pool is int8, holder's fp32
        KvLayout(2, 2, 16, "float32", 4, fingerprint="other-model"),
    ],
    ids=["quant", "fingerprint"],
)
async def test_pull_into_another_scheme_or_model_is_refused_before_any_byte(pair, other):
    holder, _ = pair
    h = holder.export("q-" + other.quant, [1, 2])
    if other.fingerprint:  # the holder's engine names its model; the reader's names another
        h = BlockHandle(
            h.handle_id,
            h.agent_name,
            KvLayout(2, 2, 16, "float32", 4, fingerprint="holder-model"),
            h.block_ids,
            h.num_tokens,
            h.kv_source_address,
            "dec-1",
        )
    wrong = Receiver(layout=other)
    err = await expect_failure(FailureKind.LAYOUT_MISMATCH, wrong.pull(h, h.block_ids, [0, 1]), wrong)
    assert ("quant" if other.quant != "none" else "fingerprint") in str(err)
    assert wrong.blocks.num_free == N
    await wrong.transport.close()
