"""KV layout on the wire, byte ranges of block lists, and the hand-written chunk codec."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.grpc_wire import SourceChunk, WireError, decode_chunk, encode_chunk
from kvtransfer.layout import KvLayout, LayoutMismatch, check_block_ids, layout_from_proto, layout_to_proto
from kvtransfer.pool import PoolView
from kvtransfer.testing import checksum, expected_block, expected_checksum, fill_blocks
from kvtransfer.transport import BlockHandle
from pdmesh.v1 import common_pb2, kvtransfer_pb2

SMALL = KvLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_size=16)


def test_layout_round_trips_with_block_bytes():
    msg = layout_to_proto(SMALL)
    assert msg.block_bytes == SMALL.block_bytes == 8 * 2 * 16 * 4 * 64 * 2
    assert layout_from_proto(msg) == SMALL


def test_wire_layout_with_wrong_block_bytes_or_bad_fields_is_refused():
    msg = layout_to_proto(SMALL)
    msg.block_bytes += 2
    with pytest.raises(LayoutMismatch, match="block_bytes"):
        layout_from_proto(msg)
    with pytest.raises(LayoutMismatch, match="dtype"):
        layout_from_proto(
            common_pb2.KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="int8", block_size=1)
        )
    with pytest.raises(LayoutMismatch, match="num_layers"):
        layout_from_proto(common_pb2.KvLayout(num_kv_heads=1, head_dim=1, dtype="float16", block_size=1))


def test_mismatch_names_every_differing_field():
    other = KvLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_size=16)
    with pytest.raises(LayoutMismatch) as e:
        SMALL.check_compatible(other)
    assert "num_layers" in str(e.value) and "dtype" in str(e.value) and "head_dim" not in str(e.value)


def test_block_id_checks():
    check_block_ids([0, 5, 2], 6)
    with pytest.raises(ValueError, match="not in"):
        check_block_ids([6], 6)
    with pytest.raises(ValueError, match="twice"):
        check_block_ids([1, 1], 6)


def test_handle_round_trips_and_refuses_engine_state():
    h = BlockHandle("h1", "agent", SMALL, (3, 1, 9), 40, "127.0.0.1:5", "dec", 123)
    assert BlockHandle.from_proto(h.to_proto("m")) == h
    with pytest.raises(KvTransferFailed) as e:
        BlockHandle.from_proto(
            common_pb2.KvHandle(handle_id="x", engine_state=common_pb2.EngineState(backend="t"))
        )
    assert e.value.kind == FailureKind.INVALID
    bad = h.to_proto()
    bad.nixl_blocks.layout.dtype = "int4"
    with pytest.raises(KvTransferFailed) as e:
        BlockHandle.from_proto(bad)
    assert e.value.kind == FailureKind.LAYOUT_MISMATCH


def tiny_pool(n=8):
    layout = KvLayout(1, 1, 4, "float32", 2)  # 1*2*2*1*4*4 = 64-byte blocks
    return PoolView(layout.allocate_pool(n), layout)


def test_segments_merge_physically_adjacent_blocks():
    pool = tiny_pool()
    assert pool.block_bytes == 64
    assert pool.segments([2, 3, 4], 0, 192) == [(128, 320)]
    assert pool.segments([4, 2, 3], 0, 192) == [(256, 320), (128, 256)]
    assert pool.segments([5, 1], 60, 10) == [(380, 384), (64, 70)]
    with pytest.raises(ValueError):
        pool.segments([1], 0, 65)


def test_read_and_write_scattered_blocks_round_trip():
    src, dst = tiny_pool(), tiny_pool()
    fill_blocks(src, seed=7)
    ids = [6, 0, 3]
    data = b"".join(bytes(m) for m in src.read(ids, 0, 3 * 64))
    assert data == b"".join(expected_block(64, 7, b) for b in ids)
    dst.write([1, 7, 4], 0, data[:100])
    dst.write([1, 7, 4], 100, data[100:])
    assert checksum(dst, [1, 7, 4]) == checksum(src, ids) == expected_checksum(64, 7, ids)
    assert dst.block_bytes_of(0) == bytes(64)  # untouched


def test_pool_view_refuses_a_pool_in_another_layout():
    with pytest.raises(LayoutMismatch):
        PoolView(torch.zeros(4, 1, 2, 2, 1, 4, dtype=torch.float16), KvLayout(1, 1, 4, "float32", 2))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=300))
def test_hand_encoding_is_exactly_the_protobuf_encoding(offset, total, data):
    parts = [memoryview(data[: len(data) // 2]), memoryview(data[len(data) // 2 :])]
    ours = encode_chunk(SourceChunk(offset, total, parts))
    theirs = kvtransfer_pb2.ReadBlocksResponse(
        offset=offset, data=data, total_bytes=total
    ).SerializeToString()
    if data:  # proto3 omits empty bytes; we always write the field (still valid wire)
        assert ours == theirs
    parsed = kvtransfer_pb2.ReadBlocksResponse.FromString(ours)
    assert (parsed.offset, parsed.data, parsed.total_bytes) == (offset, data, total)
    got = decode_chunk(theirs)
    assert (got.offset, bytes(got.data), got.total_bytes) == (offset, data, total)


def test_decoder_skips_unknown_fields_and_refuses_garbage():
    msg = kvtransfer_pb2.ReadBlocksResponse(offset=5, data=b"abc", total_bytes=9).SerializeToString()
    unknown = (
        b"\x20\x07" + b"\x2a\x02hi" + b"\x31" + bytes(8) + b"\x3d" + bytes(4)
    )  # fields 4..7, all wire types
    got = decode_chunk(unknown + msg)
    assert (got.offset, bytes(got.data), got.total_bytes) == (5, b"abc", 9)
    for bad in (b"\x12\x05ab", b"\x08", b"\x0b", b"\x31\x00"):
        with pytest.raises(WireError):
            decode_chunk(bad)


# ---- quantized KV and model fingerprints (issue 22) -------------------------------

INT8 = KvLayout(8, 4, 64, "bfloat16", 16, quant="int8", fingerprint="abc123")


def test_quantized_layout_round_trips_with_scheme_scales_and_fingerprint():
    msg = layout_to_proto(INT8)
    assert (msg.kv_quant, msg.kv_scale_layout, msg.model_fingerprint) == (
        "int8",
        INT8.scale_layout,
        "abc123",
    )
    assert msg.block_bytes == INT8.block_bytes == 8 * 2 * 16 * 4 * 64 + 8 * 2 * 4 * 4
    assert layout_from_proto(msg) == INT8
    # A sender from before quantized KV leaves the fields empty: plain, unfingerprinted.
    assert layout_from_proto(layout_to_proto(SMALL)) == SMALL


def test_wire_layout_with_another_scale_layout_or_unknown_scheme_is_refused():
    msg = layout_to_proto(INT8)
    msg.kv_scale_layout = "float16[layer,kv,head,token]/block"
    with pytest.raises(LayoutMismatch, match="scale layout"):
        layout_from_proto(msg)
    msg = layout_to_proto(SMALL)
    msg.kv_scale_layout = INT8.scale_layout  # scales claimed for an unquantized layout
    with pytest.raises(LayoutMismatch, match="scale layout"):
        layout_from_proto(msg)
    msg = layout_to_proto(INT8)
    msg.kv_quant = "fp4"
    with pytest.raises(LayoutMismatch, match="quantization"):
        layout_from_proto(msg)


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (KvLayout(8, 4, 64, "bfloat16", 16, quant="int8", fingerprint="abc123"), None),
        (KvLayout(8, 4, 64, "bfloat16", 16, fingerprint="abc123"), "quant"),
        (KvLayout(8, 4, 64, "bfloat16", 16, quant="int8", fingerprint="def456"), "fingerprint"),
        # An unfingerprinted raw pool (a transport test's) is not refused for want of one.
        (KvLayout(8, 4, 64, "bfloat16", 16, quant="int8"), None),
    ],
)
def test_check_compatible_refuses_another_scheme_or_model(other, field):
    if field is None:
        INT8.check_compatible(other)
        return
    with pytest.raises(LayoutMismatch, match=field):
        INT8.check_compatible(other)
    with pytest.raises(LayoutMismatch, match=field):
        other.check_compatible(INT8)
