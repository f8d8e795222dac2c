"""The gRPC door's pre-encoded deltas are byte-for-byte what protobuf would send."""

import pytest

from pdmesh.v1 import router_pb2
from services.router.servicer import _serialize_response, delta_bytes


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([65], "A"),
        ([], "held back text"),
        ([], ""),
        ([0], ""),
        ([1, 127, 128, 300, 16383, 16384, 49151, 2**21, 2**32 - 1], "héllo wörld ✓"),
        (list(range(300)), "x" * 1000),
    ],
)
def test_delta_bytes_equal_the_protobuf_encoding(ids, text):
    want = router_pb2.GenerateResponse(delta=router_pb2.TokenDelta(token_ids=ids, text=text))
    got = delta_bytes(ids, text)
    assert got == want.SerializeToString()
    assert router_pb2.GenerateResponse.FromString(got) == want


def test_the_serializer_passes_bytes_and_serializes_messages():
    final = router_pb2.GenerateResponse(final=router_pb2.GenerateFinal(request_id="r"))
    assert _serialize_response(b"\x0a\x00") == b"\x0a\x00"
    assert _serialize_response(final) == final.SerializeToString()
