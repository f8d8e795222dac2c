"""The raw token link's wire: length-prefixed protobuf frames on a TCP stream.

DecodeService.Link's frames (`DecodeServiceLinkRequest` router -> worker,
`DecodeServiceLinkResponse` back) can also travel on a plain stream, without
gRPC: a frame is a 4-byte big-endian length, then that many bytes of one
serialized message. Why (BENCHMARKS.md, "the raw link"): on grpc.aio every
frame is a write the loop awaits until the C core's poller thread reports it
done, and a read it is handed by that thread; under load the router's opens
queued behind those awaited writes and the writer task's wake-up (3-4 ms of
the 9-10 ms the router added to TTFT against Dynamo's frontend). On a stream a
write is a buffer append that is sent at once, and a read is one callback.

The same trust rules as the gRPC port: a worker that serves TLS serves the
link over TLS with the same certificate (reloaded on rotation); with
`require_client_cert` a caller must present a certificate of the mesh CA
whose `pdmesh://<role>` may call DecodeService.Link (call_guards.POLICY).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections import deque
from typing import Any

from services.common.call_guards import allowed_roles
from services.common.tls import MeshIdentity, TlsConfig, _HttpsWatcher, parse_identity

HEADER = struct.Struct(">I")
LINK_METHOD = "/pdmesh.v1.DecodeService/Link"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DOUBLE = struct.Struct("<d")


def encode_open(link_id: int, request: bytes, timeout_s: float, notify_started: bool = False) -> bytes:
    """The frame `DecodeServiceLinkRequest(open=LinkOpen(link_id, request, timeout_s,
    notify_started))` with its length prefix, from the request's serialized bytes: what `encode`
    gives for that message (tests/unit/common/test_link_wire.py), without copying the request
    into a LinkOpen first (~90 us for a 2k-token prompt, a third of the message's cost).
    Fields: LinkOpen 1 link_id (varint), 2 request (bytes), 3 timeout_s (double, left out at 0),
    4 notify_started (bool, left out when false)."""
    body = b"\x08" + _varint(link_id) + b"\x12" + _varint(len(request)) + request
    if timeout_s:
        body += b"\x19" + _DOUBLE.pack(timeout_s)
    if notify_started:
        body += b"\x20\x01"
    frame = b"\x0a" + _varint(len(body)) + body  # DecodeServiceLinkRequest field 1, `open`
    return HEADER.pack(len(frame)) + frame


class FrameTooLarge(Exception):
    """A frame's length prefix is above the limit: the stream is not a link, or is hostile."""


def encode(msg: Any) -> bytes:
    body = msg.SerializeToString()
    return HEADER.pack(len(body)) + body


class FrameBuffer:
    """Bytes in, whole frames out (a frame's bytes may arrive in any number of pieces)."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while n - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame_bytes:
                raise FrameTooLarge(f"a frame of {size} bytes (the limit is {self.max_frame_bytes})")
            end = pos + 4 + size
            if end > n:
                break
            out.append(bytes(buf[pos + 4 : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


class FrameInbox:
    """Frames handed from a protocol's callbacks to one consuming task (an async iterator);
    `close(error)` ends it after the frames already in, raising `error` if given."""

    def __init__(self) -> None:
        self._frames: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: BaseException | None = None

    def put(self, frame: Any) -> None:
        self._frames.append(frame)
        self._wake()

    def close(self, error: BaseException | None = None) -> None:
        if not self._closed:
            self._closed, self._error = True, error
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> FrameInbox:
        return self

    async def __anext__(self) -> Any:
        while not self._frames:
            if self._closed:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The worker's link listener: its certificate (followed on rotation); with mTLS the
    caller's certificate must chain to `ca_file`."""
    return _HttpsWatcher(tls, client_ca=tls.ca_file if tls.require_client_cert else "").context


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """The router's side: verify the worker against `ca_file`, present our certificate."""
    ctx = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


def peer_identity(ssl_object: Any) -> MeshIdentity | None:
    """The mesh identity in a TLS connection's verified client certificate (None: none)."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind == "URI":
            ident = parse_identity(value)
            if ident is not None:
                return ident
    return None


def refusal(tls: TlsConfig | None, ssl_object: Any) -> str | None:
    """Why a new link connection may not call Link (None: it may)."""
    if tls is None or not tls.require_client_cert:
        return None
    ident = peer_identity(ssl_object)
    if ident is None:
        return f"{LINK_METHOD}: the client certificate names no pdmesh:// role"
    if ident.role not in allowed_roles(LINK_METHOD):
        return f"{LINK_METHOD} is not open to role {ident.role!r}"
    return None
