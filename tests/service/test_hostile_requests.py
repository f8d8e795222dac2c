"""Requests no well-behaved client sends still end with a clear status (found by tests/fuzz).

- bytes that do not parse as the request are INVALID_ARGUMENT, unary and streaming
  alike (gRPC alone answers UNKNOWN "Unexpected <class DecodeError>");
- an error message that quotes a huge field is cut, so the status still reaches the
  client (a status message over the client's 16 KiB header limit arrives as
  RESOURCE_EXHAUSTED "Stream removed" instead);
- the same for KvSource's own aborts, which quote the handle id.
"""

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvtransfer.grpc_transport import READ_BLOCKS, KvSourceServicer, add_kv_source
from kvtransfer.layout import KvLayout
from kvtransfer.leases import LeaseManager
from kvtransfer.pool import PoolView
from pdmesh.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from services.kvtransfer.metrics import KvServiceMetrics
from services.kvtransfer.registry import AgentRegistry
from services.kvtransfer.servicer import SERVICE_NAME, KvTransferServicer
from services.kvtransfer.stats import TransferStatistics

LAYOUT = KvLayout(2, 2, 16, "float32", 4)
CORRUPT = [b"\xff\xff\xff", b"\x0a\x03\xed\xa0\x80", b"\x0a\x05ab"]  # bad varint, a surrogate, truncated


@pytest.fixture
async def served():
    kv = KvTransferServicer(AgentRegistry(), TransferStatistics(), KvServiceMetrics(CollectorRegistry()))
    server = MeshServer(ServerConfig(port=0), SERVICE_NAME)
    kvtransfer_pb2_grpc.add_KvTransferServiceServicer_to_server(kv, server.server)
    pool = PoolView(LAYOUT.allocate_pool(4), LAYOUT)
    add_kv_source(server.server, KvSourceServicer(pool, LeaseManager()))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    yield channel
    await channel.close()
    await server.stop()


@pytest.mark.parametrize("payload", CORRUPT)
async def test_unparsable_unary_request_is_invalid_argument(served, payload):
    call = served.unary_unary("/pdmesh.v1.KvTransferService/GetAgent")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(payload, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in e.value.details() and "GetAgentRequest" in e.value.details()


@pytest.mark.parametrize("payload", CORRUPT)
async def test_unparsable_streaming_request_is_invalid_argument(served, payload):
    call = served.unary_stream(READ_BLOCKS)(payload, timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_status_quoting_a_huge_field_still_arrives(served):
    stub = kvtransfer_pb2_grpc.KvTransferServiceStub(served)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name="\u00e9" * 5000), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(e.value.details()) < 600


async def test_a_kv_source_abort_quoting_a_huge_handle_id_still_arrives(served):
    read = served.unary_stream(
        READ_BLOCKS,
        request_serializer=kvtransfer_pb2.ReadBlocksRequest.SerializeToString,
        response_deserializer=kvtransfer_pb2.ReadBlocksResponse.FromString,
    )
    call = read(kvtransfer_pb2.ReadBlocksRequest(handle_id="\u00e9" * 5000, requester_id="d"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(e.value.details()) < 600
