"""STAND-IN for TensorRT-LLM's cache transceiver (NIXL/UCX in the real library).

Not part of TensorRT-LLM's API: how the fake moves a context-only request's KV
from one process to another. The context side keeps the request's KV blocks
held in its torch engine and serves them on a loopback TCP socket; the
`opaque_state` it hands out (JSON bytes) says where and what:

    {"v": 1, "endpoint": "127.0.0.1:PORT", "ctx_request_id": N,
     "num_tokens": T, "layout": {num_layers, num_kv_heads, head_dim, dtype, block_size}}

The generation side connects, sends one JSON line {"op": "pull", "ctx_request_id": N,
"first_block": k}, and gets a JSON header line {"ok": true, "shape": [...], "dtype": ...}
followed by the raw bytes of blocks k.. (or {"ok": false, "error": ...}). The context
side frees the blocks once they are sent, when the request is aborted, or when
`kv_transfer_timeout_ms` passes without a pull, as the real transceiver does.
"""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvtransfer.layout import KvLayout
from services.engine.api import HeldKv

VERSION = 1


@dataclass(frozen=True)
class HandoffState:
    endpoint: str
    ctx_request_id: int
    num_tokens: int
    layout: KvLayout

    def to_bytes(self) -> bytes:
        d = {"v": VERSION, **asdict(self), "layout": asdict(self.layout)}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> HandoffState:
        """Parse opaque_state; ValueError when it is not one of ours."""
        if not isinstance(data, bytes | bytearray) or not data:
            raise ValueError("opaque_state is missing")
        try:
            d = json.loads(bytes(data))
            if d.get("v") != VERSION:
                raise ValueError(f"unknown opaque_state version {d.get('v')!r}")
            return cls(
                str(d["endpoint"]), int(d["ctx_request_id"]), int(d["num_tokens"]), KvLayout(**d["layout"])
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed opaque_state: {e}") from e


@dataclass
class _Held:
    torch_request_id: str
    held: HeldKv
    timer: asyncio.TimerHandle | None


class ContextServer:
    """Context side: holds KV of finished context-only requests and serves it once."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        export_blocks: Callable[[list[int]], torch.Tensor],
        release: Callable[[str], object],
        timeout_s: float | None,
    ):
        self._loop = loop
        self._export = export_blocks  # runs on the caller's thread, blocking
        self._release = release  # called on the engine loop
        self._timeout_s = timeout_s
        self._held: dict[int, _Held] = {}  # engine loop only
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                server._serve_one(self.rfile, self.wfile)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.endpoint = f"{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="fake-transceiver"
        )
        self._thread.start()

    def hold(self, ctx_request_id: int, torch_request_id: str, held: HeldKv) -> None:
        """Engine loop: keep the blocks until pulled, aborted or timed out."""
        timer = None
        if self._timeout_s is not None:
            timer = self._loop.call_later(self._timeout_s, self.drop, ctx_request_id)
        self._held[ctx_request_id] = _Held(torch_request_id, held, timer)

    def drop(self, ctx_request_id: int) -> bool:
        """Engine loop: free held blocks; False when none are held under that id."""
        entry = self._held.pop(ctx_request_id, None)
        if entry is None:
            return False
        if entry.timer is not None:
            entry.timer.cancel()
        self._release(entry.torch_request_id)
        return True

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve_one(self, rfile, wfile) -> None:
        try:
            msg = json.loads(rfile.readline())
            ctx_id, first = int(msg["ctx_request_id"]), int(msg["first_block"])
        except (ValueError, KeyError, TypeError) as e:
            _send_error(wfile, f"bad request: {e}")
            return
        entry = asyncio.run_coroutine_threadsafe(self._take(ctx_id), self._loop).result()
        if entry is None:
            _send_error(wfile, f"no KV held for context request {ctx_id} (released or timed out)")
            return
        try:
            ids = list(entry.held.block_ids[first:])
            blocks = self._export(ids) if ids else entry.held.layout.allocate_pool(0)
            header = {"ok": True, "shape": list(blocks.shape), "dtype": entry.held.layout.dtype}
            wfile.write(json.dumps(header).encode() + b"\n")
            wfile.write(blocks.contiguous().view(torch.uint8).numpy().tobytes())
        finally:
            self._loop.call_soon_threadsafe(self._release, entry.torch_request_id)

    async def _take(self, ctx_id: int) -> _Held | None:
        entry = self._held.pop(ctx_id, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        return entry


def pull_blocks(state: HandoffState, first_block: int, timeout_s: float | None) -> torch.Tensor:
    """Generation side (blocking): fetch blocks first_block.. of the held request."""
    host, _, port = state.endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(
                json.dumps({"ctx_request_id": state.ctx_request_id, "first_block": first_block}).encode()
            )
            sock.sendall(b"\n")
            f = sock.makefile("rb")
            header = json.loads(f.readline() or b"{}")
            if not header.get("ok"):
                raise RuntimeError(f"KV transfer refused: {header.get('error', 'connection closed')}")
            shape = [int(x) for x in header["shape"]]
            dtype = KvLayout(**{**asdict(state.layout), "dtype": header["dtype"]}).torch_dtype
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            data = f.read(nbytes)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"KV transfer from {state.endpoint} failed: {e}") from e
    if len(data) != nbytes:
        raise RuntimeError(f"KV transfer from {state.endpoint} ended after {len(data)} of {nbytes} bytes")
    if nbytes == 0:  # every block was already cached on the generation side
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _send_error(wfile, message: str) -> None:
    wfile.write(json.dumps({"ok": False, "error": message}).encode() + b"\n")
