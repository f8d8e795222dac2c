"""Wire codec of `KvSourceService.ReadBlocks` chunks that skips protobuf copies.

`ReadBlocksResponse` is {1: uint64 offset, 2: bytes data, 3: uint64 total_bytes}.
Going through the generated message costs two extra copies of every chunk:
the holder copies pool bytes into a `bytes` for the message, then serializes
it into another; the receiver parses into a fresh `bytes` before copying it
into its pool. These functions write and read the same wire format by hand:
the holder joins the pool views straight into the outgoing buffer (one copy)
and the receiver gets a memoryview into the received buffer (no copy). The
bytes on the wire are exactly those of `ReadBlocksResponse.SerializeToString`,
so any standard client or server of the contract interoperates (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_OFFSET_TAG = b"\x08"  # field 1, varint
_DATA_TAG = b"\x12"  # field 2, length-delimited
_TOTAL_TAG = b"\x18"  # field 3, varint


class WireError(ValueError):
    """A chunk is not a well-formed ReadBlocksResponse."""


@dataclass(frozen=True)
class SourceChunk:
    """A chunk as the holder yields it: the data is still views of its pool."""

    offset: int
    total_bytes: int
    parts: Sequence[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class ReceivedChunk:
    offset: int
    total_bytes: int
    data: memoryview


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(chunk: SourceChunk) -> bytes:
    """Serialize like ReadBlocksResponse (proto3: zero scalars are omitted)."""
    head = (_OFFSET_TAG + _varint(chunk.offset) if chunk.offset else b"") + _DATA_TAG + _varint(chunk.nbytes)
    tail = _TOTAL_TAG + _varint(chunk.total_bytes) if chunk.total_bytes else b""
    return b"".join((head, *chunk.parts, tail))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def decode_chunk(raw: bytes) -> ReceivedChunk:
    """Parse a ReadBlocksResponse; `data` is a view into `raw` (no copy).

    Fields may come in any order and unknown fields are skipped, as protobuf
    requires, so chunks from any conforming server parse."""
    buf = memoryview(raw)
    pos = offset = total = 0
    data = buf[0:0]
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
            elif field == 3:
                total = value
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise WireError("length-delimited field runs past the end")
            if field == 2:
                data = buf[pos : pos + n]
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {wire}")
    if pos != len(buf):
        raise WireError("fixed-width field runs past the end")
    return ReceivedChunk(offset=offset, total_bytes=total, data=data)
