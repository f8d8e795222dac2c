"""Failure kinds across a gRPC edge, and the free-on-failure contract of every pull."""

import asyncio

import grpc
import pytest

from kvtransfer.errors import FAILURE_METADATA_KEY, FailureKind, KvTransferFailed, from_rpc_error
from kvtransfer.layout import KvLayout
from kvtransfer.pool import PoolView
from kvtransfer.transport import BlockHandle, Quarantined, check_pull, guarded_pull

LAYOUT = KvLayout(1, 1, 4, "float32", 2)


def rpc_error(code, trailing=()):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details="boom")


def test_kind_comes_from_the_trailer_first_then_the_status():
    e = from_rpc_error(rpc_error(grpc.StatusCode.NOT_FOUND, [(FAILURE_METADATA_KEY, "not_owner")]), "read")
    assert e.kind == FailureKind.NOT_OWNER
    assert from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE), "read").kind == FailureKind.PEER_DEAD
    assert from_rpc_error(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), "r").kind == FailureKind.TIMEOUT
    assert from_rpc_error(rpc_error(grpc.StatusCode.INTERNAL), "read").kind == FailureKind.TRANSPORT
    garbage = rpc_error(grpc.StatusCode.NOT_FOUND, [(FAILURE_METADATA_KEY, "nonsense")])
    assert from_rpc_error(garbage, "read").kind == FailureKind.STALE_HANDLE


def test_every_kind_has_a_status_and_survives_the_round_trip():
    for kind in FailureKind:
        err = KvTransferFailed(kind, "x")
        back = from_rpc_error(rpc_error(err.status_code, err.trailing_metadata()), "w")
        assert back.kind == kind and err.reason == kind.value


def handle(ids=(0, 1, 2)):
    return BlockHandle("h", "agent", LAYOUT, tuple(ids), 6, "addr", "dec")


@pytest.mark.parametrize(
    ("src", "dst", "deadline", "kind"),
    [
        ([0, 1], [0], 1.0, FailureKind.INVALID),
        ([], [], 1.0, FailureKind.INVALID),
        ([0, 7], [0, 1], 1.0, FailureKind.INVALID),  # 7 is not in the handle
        ([0], [8], 1.0, FailureKind.INVALID),  # outside our pool
        ([0, 1], [3, 3], 1.0, FailureKind.INVALID),
        ([0], [0], 0.0, FailureKind.TIMEOUT),
    ],
)
def test_pull_arguments_are_checked(src, dst, deadline, kind):
    pool = PoolView(LAYOUT.allocate_pool(8), LAYOUT)
    with pytest.raises(KvTransferFailed) as e:
        check_pull(pool, handle(), src, dst, deadline)
    assert e.value.kind == kind


def test_layout_mismatch_is_checked_first():
    other = KvLayout(1, 1, 4, "float16", 2)
    pool = PoolView(other.allocate_pool(8), other)
    with pytest.raises(KvTransferFailed) as e:
        check_pull(pool, handle(), [0], [0], 1.0)
    assert e.value.kind == FailureKind.LAYOUT_MISMATCH and "dtype" in str(e.value)


class Recorder:
    def __init__(self):
        self.records = []

    def record(self, **kw):
        self.records.append(kw)


async def run(move):
    freed = []
    rec = Recorder()
    result = None
    try:
        result = await guarded_pull("t", "me", handle(), 3, 64, move, lambda: freed.append(1), rec)
    except BaseException as e:  # the test inspects whatever came out
        result = e
    return result, freed, rec.records


async def test_success_does_not_free_and_reports_bytes():
    async def move():
        return None

    stats, freed, records = await run(move)
    assert stats.bytes == 192 and stats.blocks == 3 and freed == []
    assert records[0]["nbytes"] == 192 and records[0]["error"] == ""


async def test_failure_frees_once_then_raises_the_typed_error():
    async def move():
        raise KvTransferFailed(FailureKind.PEER_DEAD, "gone")

    err, freed, records = await run(move)
    assert isinstance(err, KvTransferFailed) and err.kind == FailureKind.PEER_DEAD
    assert freed == [1] and records[0]["error"] == "peer_dead"


async def test_unexpected_errors_become_transport_failures_and_still_free():
    async def move():
        raise ZeroDivisionError

    err, freed, _ = await run(move)
    assert isinstance(err, KvTransferFailed) and err.kind == FailureKind.TRANSPORT
    assert isinstance(err.__cause__, ZeroDivisionError) and freed == [1]


async def test_cancelled_pull_frees_its_blocks():
    freed = []
    started = asyncio.Event()

    async def move():
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(guarded_pull("t", "me", handle(), 3, 64, move, lambda: freed.append(1), None))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert freed == [1]


async def test_quarantined_blocks_are_not_freed():
    async def move():
        raise Quarantined(KvTransferFailed(FailureKind.TRANSPORT, "stuck"))

    err, freed, records = await run(move)
    assert isinstance(err, KvTransferFailed) and freed == [] and records[0]["error"] == "transport"
