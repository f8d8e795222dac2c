"""KV handoff between separate OS processes over loopback, with both transports.

Processes: the KV-transfer service (`python -m services.kvtransfer.main`), KV
holders (`tests/e2e/kv_peer.py`, one per scenario that kills or stalls one),
and the receiver: this test process. Bytes are checked by sha256 against the
holder's own checksum; after every test both sides' block pools are back to
their initial free counts (the holder is asked, and waits on its own events).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.agents import AgentDirectory
from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.grpc_transport import GrpcTransport
from kvtransfer.layout import KvLayout
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import PoolView
from kvtransfer.testing import BlockPool, checksum, expected_checksum
from kvtransfer.transport import BlockHandle
from pdmesh.v1 import common_pb2, kvtransfer_pb2_grpc
from tests.e2e.kv_peer import REPO, Peer, parse_layout
from tests.support.poll import eventually, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

LAYOUT_ARG = "8,4,64,bfloat16,16"  # the `small` preset's KV shape: 128 KiB blocks
LAYOUT = parse_layout(LAYOUT_ARG)
N = 64  # blocks in each pool
SEED = 11


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def kv_service(tmp):
    port_file = tmp / "kvtransfer.json"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.kvtransfer.main", "--port", "0", "--port-file", str(port_file)),
            *("--log-level", "warning", "--expiry-interval-s", "0.1"),
        ],
        cwd=REPO,
    )
    wait_until(
        lambda: port_file.exists() or proc.poll() is not None, timeout=60, what="kvtransfer's port file"
    )
    assert proc.poll() is None, "kvtransfer service exited"
    address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service="pdmesh.v1.KvTransferService")
        assert stub.Check(req, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    yield address
    proc.send_signal(signal.SIGTERM)  # drains and exits cleanly
    assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def holder(tmp, kv_service):
    peer = Peer(tmp, kv_service, "holder-main", seed=SEED, num_blocks=N, layout=LAYOUT_ARG)
    peer.wait_ready()
    yield peer
    peer.stop()


class Receiver:
    """The decode side: one pool, both transports, a free-list standing in for the engine."""

    def __init__(self, kv_service: str, name: str, layout: KvLayout = LAYOUT):
        self.channel = grpc.aio.insecure_channel(kv_service)
        stub = kvtransfer_pb2_grpc.KvTransferServiceStub(self.channel)
        self.directory = AgentDirectory(stub, max_age_s=3600)  # cached records go stale on purpose
        self.pool = PoolView(layout.allocate_pool(N), layout)
        self.blocks = BlockPool(N)
        self.nixl = NixlTransport(name, self.pool, self.directory, worker_id="dec-1")
        self.grpc = GrpcTransport(name, self.pool, worker_id="dec-1")
        self.name = name

    async def pull(self, kind, handle, src=None, dst=None, deadline_s=20.0):
        src = list(handle.block_ids if src is None else src)
        dst = self.blocks.alloc(len(src)) if dst is None else self.blocks.take(dst)
        transport = self.nixl if kind == "nixl" else self.grpc
        stats = await transport.pull(
            handle, src, dst, deadline_s=deadline_s, on_failure=lambda: self.blocks.free(dst)
        )
        return dst, stats

    async def close(self):
        await self.nixl.close()
        await self.grpc.close()
        await self.channel.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver(kv_service):
    r = Receiver(kv_service, f"decode-{os.getpid()}")
    await r.nixl.start()
    yield r
    await r.close()


@pytest.fixture(autouse=True)
def pools_return_to_initial(request):
    yield
    if "receiver" in request.fixturenames:
        assert request.getfixturevalue("receiver").blocks.num_free == N, "receiver leaked blocks"


async def export(peer, handle_id, ids, issued_to="dec-1", requester_agent="", ttl_s=30.0):
    reply = await peer.request(
        op="export",
        handle_id=handle_id,
        block_ids=ids,
        issued_to=issued_to,
        requester_agent=requester_agent,
        ttl_s=ttl_s,
    )
    handle = BlockHandle.from_proto(common_pb2.KvHandle.FromString(base64.b64decode(reply["handle"])))
    return handle, reply["checksum"]


async def holder_back_to_full(peer):
    reply = await peer.request(op="wait_free", free=N, timeout_s=15)
    assert reply["ok"], f"holder still holds {N - reply['free']} blocks"


async def expect(kind, coro):
    with pytest.raises(KvTransferFailed) as e:
        await coro
    assert e.value.kind == kind, e.value
    return e.value


SCATTERED_SRC = [40, 3, 27, 11, 59, 0, 33]
SCATTERED_DST = [50, 2, 63, 17, 9, 61, 30]


@pytest.mark.parametrize("kind", ["nixl", "grpc"])
@pytest.mark.parametrize("shape", ["contiguous", "scattered"])
async def test_blocks_arrive_byte_identical(holder, receiver, kind, shape):
    src = list(range(8, 16)) if shape == "contiguous" else SCATTERED_SRC
    handle, held_sum = await export(holder, f"ok-{kind}-{shape}", src, requester_agent=receiver.name)
    dst_ids = None if shape == "contiguous" else SCATTERED_DST
    dst, stats = await receiver.pull(kind, handle, dst=dst_ids)
    assert checksum(receiver.pool, dst) == held_sum == expected_checksum(LAYOUT.block_bytes, SEED, src)
    assert stats.bytes == len(src) * LAYOUT.block_bytes and stats.transport == kind
    receiver.blocks.free(dst)
    await holder_back_to_full(holder)  # NIXL: the done notification; gRPC: release_after


@pytest.mark.parametrize("kind", ["nixl", "grpc"])
async def test_a_suffix_pull_moves_only_the_missing_blocks(holder, receiver, kind):
    src = [20, 5, 21, 6, 22]
    handle, _ = await export(holder, f"suffix-{kind}", src)
    dst, stats = await receiver.pull(kind, handle, src=src[2:])
    assert stats.blocks == 3
    assert checksum(receiver.pool, dst) == expected_checksum(LAYOUT.block_bytes, SEED, src[2:])
    receiver.blocks.free(dst)
    await holder_back_to_full(holder)


async def test_layout_mismatch_is_refused_before_any_byte_moves(holder, receiver, kv_service):
    handle, _ = await export(holder, "layout", [1, 2])
    other = KvLayout(8, 4, 32, "bfloat16", 16)  # half the head_dim: another model
    wrong = Receiver(kv_service, f"decode-other-{os.getpid()}", layout=other)
    await wrong.nixl.start()
    try:
        for kind in ("nixl", "grpc"):
            err = await expect(FailureKind.LAYOUT_MISMATCH, wrong.pull(kind, handle))
            assert "head_dim" in str(err)
            # A handle that claims our layout: the holder's registered layout (NIXL)
            # or its byte count (gRPC) still gives it away.
            liar = BlockHandle(
                handle.handle_id,
                handle.agent_name,
                other,
                handle.block_ids,
                handle.num_tokens,
                handle.kv_source_address,
                "dec-1",
                handle.lease_expires_unix_ms,
            )
            await expect(FailureKind.LAYOUT_MISMATCH, wrong.pull(kind, liar))
            assert wrong.blocks.num_free == N
    finally:
        await wrong.close()
    # Whatever the holder saw (the gRPC liar read the whole stream, which releases
    # the lease), the decode service's Release or the TTL frees its side.
    await holder.request(op="release", handle_id="layout")
    await holder_back_to_full(holder)


async def test_unknown_agent_and_unreachable_source(holder, receiver):
    handle, _ = await export(holder, "unknown", [7])
    nobody = BlockHandle(handle.handle_id, "no-such-agent", LAYOUT, handle.block_ids, 16, "", "dec-1")
    await expect(FailureKind.UNKNOWN_AGENT, receiver.pull("nixl", nobody))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    gone = BlockHandle(handle.handle_id, handle.agent_name, LAYOUT, handle.block_ids, 16, dead, "dec-1")
    await expect(FailureKind.PEER_DEAD, receiver.pull("grpc", gone))
    assert (await holder.request(op="release", handle_id="unknown"))["released"]
    await holder_back_to_full(holder)


@pytest.mark.parametrize("kind", ["nixl", "grpc"])
async def test_stale_handles_released_or_expired(holder, receiver, kind):
    handle, _ = await export(holder, f"stale-{kind}", [30, 31])
    dst, _ = await receiver.pull(kind, handle)
    receiver.blocks.free(dst)
    await holder_back_to_full(holder)
    err = await expect(FailureKind.STALE_HANDLE, receiver.pull(kind, handle))  # already released
    assert "released" in str(err)
    short, _ = await export(holder, f"expired-{kind}", [32, 33], ttl_s=0.5)
    await holder_back_to_full(holder)  # the holder's lease keeper expired it
    await expect(FailureKind.STALE_HANDLE, receiver.pull(kind, short))
    state = await holder.request(op="state")
    assert state["counters"]["expired"] >= 1


async def test_only_the_issued_worker_may_read_over_grpc(holder, receiver):
    handle, _ = await export(holder, "theirs", [12], issued_to="dec-2")
    await expect(FailureKind.NOT_OWNER, receiver.pull("grpc", handle))
    assert (await holder.request(op="release", handle_id="theirs"))["released"]
    await holder_back_to_full(holder)


async def test_the_holder_frees_leases_of_a_dead_requester(holder):
    before = (await holder.request(op="state"))["counters"]["agent_dead"]
    await export(holder, "orphan", [44, 45, 46], requester_agent="decode-that-died")
    await holder_back_to_full(holder)  # its LeaseKeeper asked the directory, long before the 30 s TTL
    assert (await holder.request(op="state"))["counters"]["agent_dead"] == before + 1


async def test_killing_the_holder_mid_grpc_stream_fails_fast_and_frees(tmp, kv_service, receiver):
    peer = Peer(
        tmp,
        kv_service,
        "holder-grpc-stall",
        "--stall-grpc-after-first-chunk",
        seed=SEED,
        num_blocks=N,
        layout=LAYOUT_ARG,
        chunk_bytes=LAYOUT.block_bytes,
    )
    try:
        await peer.ready()
        handle, _ = await export(peer, "cut", list(range(16)))
        pull = asyncio.create_task(receiver.pull("grpc", handle, deadline_s=60))
        event = await peer.next_event()
        assert event["event"] == "stalled"  # one chunk is out, the stream hangs
        assert not pull.done()
        peer.kill()
        await expect(FailureKind.PEER_DEAD, pull)
    finally:
        peer.kill()
        peer.stop()


async def test_a_stalled_nixl_read_times_out_then_dies_with_its_holder(tmp, kv_service, receiver):
    peer = Peer(
        tmp, kv_service, "holder-nixl-stall", "--stall-nixl", seed=SEED, num_blocks=N, layout=LAYOUT_ARG
    )
    try:
        await peer.ready()
        # Deadline: the READ is cancelled and released before our blocks are freed.
        handle, _ = await export(peer, "slow", list(range(8)), ttl_s=1.5)
        await expect(FailureKind.TIMEOUT, receiver.pull("nixl", handle, deadline_s=0.5))
        assert receiver.nixl.reads_in_flight == 0
        await holder_back_to_full(peer)  # the holder's lease expired on its side
        # Death mid-READ: posted, in flight (the holder never progresses), then killed.
        handle, _ = await export(peer, "cut", list(range(8)))
        pull = asyncio.create_task(receiver.pull("nixl", handle, deadline_s=60))
        await eventually(lambda: receiver.nixl.reads_in_flight == 1 or pull.done(), timeout=30.0)
        assert not pull.done()
        peer.kill()
        await expect(FailureKind.PEER_DEAD, pull)
        assert receiver.nixl.reads_in_flight == 0

        # Once its liveness lease lapses the dead holder is unknown, and forgotten by our agent.
        async def expired() -> bool:
            return await receiver.directory.is_alive(peer.name) is False

        await eventually(expired, timeout=30, what="the dead holder's agent to expire")
        await expect(FailureKind.UNKNOWN_AGENT, receiver.pull("nixl", handle))
        assert peer.name not in receiver.nixl.loaded_agents
    finally:
        peer.kill()
        peer.stop()


async def test_a_restarted_holder_under_the_same_name_is_reloaded(tmp, kv_service, receiver):
    first = Peer(tmp, kv_service, "holder-restart", seed=1, num_blocks=N, layout=LAYOUT_ARG)
    second = None
    try:
        await first.ready()
        old, _ = await export(first, "before", [1, 2, 3])
        dst, _ = await receiver.pull("nixl", old)
        receiver.blocks.free(dst)
        old2, _ = await export(first, "orphaned", [4])
        first.kill()
        second = Peer(tmp, kv_service, "holder-restart", seed=2, num_blocks=N, layout=LAYOUT_ARG)
        await second.ready()
        assert second.info["incarnation"] > first.info["incarnation"]
        reloads = receiver.nixl.reloads
        # Our cached metadata is the dead process's. A handle without a KvSource
        # address gives no hint: the first READ fails, we refresh and retry.
        new, held_sum = await export(second, "after", [5, 6])
        bare = BlockHandle(
            new.handle_id,
            new.agent_name,
            LAYOUT,
            new.block_ids,
            new.num_tokens,
            "",
            "dec-1",
            new.lease_expires_unix_ms,
        )
        dst, _ = await receiver.pull("nixl", bare)
        assert checksum(receiver.pool, dst) == held_sum == expected_checksum(LAYOUT.block_bytes, 2, [5, 6])
        assert receiver.nixl.reloads == reloads + 1
        receiver.blocks.free(dst)
        await holder_back_to_full(second)
        # A handle of the dead incarnation is stale, not a read of someone else's blocks.
        await expect(FailureKind.STALE_HANDLE, receiver.pull("nixl", old2))
        for kind in ("nixl", "grpc"):
            h, held_sum = await export(second, f"after-{kind}", [7, 8])
            dst, _ = await receiver.pull(kind, h)
            assert checksum(receiver.pool, dst) == held_sum
            receiver.blocks.free(dst)
            await holder_back_to_full(second)
    finally:
        first.kill()
        first.stop()
        if second is not None:
            second.stop()
