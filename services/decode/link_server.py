"""The raw token link: DecodeService.Link's frames on a plain TCP (or TLS) stream.

The worker listens on `--link-port` (any free port by default) beside its gRPC
port and says so in its WorkerInfo (`link_port`); a router that sees it opens
the link here instead of over gRPC (services/router/link.py, `RawDecodeLink`).
The wire is services/common/link_wire.py: a 4-byte length, then one message.

Each connection is one `LinkSession` (services/decode/link.py), exactly the
session a gRPC Link call runs: the same opens, cancels, validation, batching,
drain and malformed-frame rules. What differs is only the transport:
- the router's frames are parsed in the protocol's callback and handed to the
  session's reader; a frame that does not parse, or a length above
  `max_message_bytes`, is malformed like a bad frame over gRPC;
- the session's frames are written with `transport.write` (a buffer append,
  sent at once), not awaited; when the router stops reading and the socket's
  buffer passes its high-water mark the writer waits, and meanwhile the
  session batches every request's new tokens into the next frame (as a slow
  gRPC write does), so the link's memory is bounded by its requests;
- where gRPC would end the call with a status, the last frame carries it
  (`DecodeServiceLinkResponse.status`: OK when the worker drained, INVALID_
  ARGUMENT for a malformed frame, PERMISSION_DENIED for a caller whose
  certificate may not call Link, UNAVAILABLE while the worker drains), then
  the connection closes. A connection that drops cancels the session's
  requests (KV freed at once), as a cancelled gRPC call does.
- a session counts as an in-flight call of the worker's MeshServer, so the
  drain waits for it (up to its grace) as for a gRPC Link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from pdmesh.v1 import decode_pb2
from services.common import link_wire
from services.common.server import MeshServer
from services.common.tls import TlsConfig
from services.decode.link import LinkMalformed, LinkSession

log = structlog.get_logger()


class LinkServer:
    """The worker's raw link listener (see the module docstring)."""

    def __init__(
        self,
        sessions: Callable[[], LinkSession],
        server: MeshServer,
        host: str,
        port: int,
        tls: TlsConfig | None = None,
        max_frame_bytes: int = 64 * 1024 * 1024,
    ):
        self.sessions = sessions
        self.server = server
        self.host = host
        self.port = port
        self.tls = tls if tls is not None and tls.serves_tls else None
        self.max_frame_bytes = max_frame_bytes
        self._listener: asyncio.base_events.Server | None = None
        self.connections: set[_LinkConnection] = set()

    async def start(self) -> int:
        """Listen; returns the port (the one chosen when `port` is 0)."""
        ssl_ctx = link_wire.server_context(self.tls) if self.tls is not None else None
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: _LinkConnection(self), self.host, self.port, ssl=ssl_ctx, reuse_address=True
        )
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("link_listening", port=self.port, tls=self.tls is not None)
        return self.port

    async def close(self) -> None:
        """Stop listening and drop the connections left (after the drain, whose grace they had)."""
        if self._listener is not None:
            self._listener.close()
        conns = list(self.connections)
        for conn in conns:
            conn.abort()
        await asyncio.gather(*(c.done for c in conns if c.done is not None), return_exceptions=True)
        if self._listener is not None:
            await self._listener.wait_closed()


def _status_frame(code: grpc.StatusCode, message: str = "") -> bytes:
    return link_wire.encode(
        decode_pb2.DecodeServiceLinkResponse(
            status=decode_pb2.LinkStatus(code=code.value[0], message=message)
        )
    )


class _LinkConnection(asyncio.Protocol):
    """One router's connection: frames in to a LinkSession, its frames out."""

    def __init__(self, owner: LinkServer):
        self.owner = owner
        self.transport: Any = None
        self.done: asyncio.Task[None] | None = None
        self._frames = link_wire.FrameBuffer(owner.max_frame_bytes)
        self._inbox = link_wire.FrameInbox()
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        owner = self.owner
        why = link_wire.refusal(owner.tls, transport.get_extra_info("ssl_object"))
        if why is not None:
            log.warning("link_refused", reason=why, peer=transport.get_extra_info("peername"))
            self._refuse(grpc.StatusCode.PERMISSION_DENIED, why)
            return
        if owner.server.draining:
            self._refuse(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another instance")
            return
        owner.connections.add(self)
        self.done = asyncio.get_running_loop().create_task(self._serve(owner.server.track_call()))

    def _refuse(self, code: grpc.StatusCode, why: str) -> None:
        self.transport.write(_status_frame(code, why))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.done is None:  # refused: ignore what it sends before the close
            return
        try:
            for body in self._frames.feed(data):
                self._inbox.put(decode_pb2.DecodeServiceLinkRequest.FromString(body))
        except (link_wire.FrameTooLarge, DecodeError) as e:
            # The session ends the link with INVALID_ARGUMENT; nothing after it is read.
            self._inbox.close(LinkMalformed(f"a link frame that does not parse: {e}"))
            self.data_received = _ignore  # type: ignore[method-assign]

    def eof_received(self) -> bool:
        self._inbox.close()  # the router closed its side: no new request; the open ones finish
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._writable.set()
        self._inbox.close()
        self.owner.connections.discard(self)
        if self.done is not None:
            self.done.cancel()  # nobody to deliver to: the session cancels its requests (KV freed)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def _serve(self, end_call: Callable[[], None]) -> None:
        status, message = grpc.StatusCode.OK, ""
        transport, writable = self.transport, self._writable
        try:
            async for frame in self.owner.sessions().run(self._inbox):
                if self._lost:
                    return
                transport.write(link_wire.encode(frame))
                if not writable.is_set():
                    await writable.wait()
        except LinkMalformed as e:
            status, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Exception as e:
            log.error("internal_error", method="DecodeService.Link (raw)", exc_info=e)
            status, message = grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})"
        finally:
            end_call()
        if not self._lost:
            transport.write(_status_frame(status, message))
            transport.close()


def _ignore(data: bytes) -> None:
    pass
