"""The router's two gRPC listeners: a public one for clients, an internal one for the mesh.

- public (`--port`): RouterService.Generate and Cancel, health, reflection. Every
  other RouterService method is simply not registered there, so gRPC answers
  UNIMPLEMENTED: membership cannot be reached from outside the mesh whatever
  the keys or certificates. Its largest accepted message is what the request
  limits can need (`public_message_bytes`), not the server-wide 64 MiB, so one
  request cannot make the router allocate more than a prompt's worth.
- internal (`--internal-port` / PDMESH_INTERNAL_PORT, `--internal-host`):
  RegisterWorker, Heartbeat, DeregisterWorker, ListWorkers, Stats, health,
  reflection. With TLS on it is mTLS-only (a caller needs a certificate the mesh
  CA signed, with a role the per-method table allows), whatever
  `--tls-require-client-cert` says for the public port.

- HTTP (`--http-port`, off at -1): the OpenAI-compatible API (services/router/http_door.py),
  the gateway's app on this process's event loop calling the request flow in-process.

`RouterListeners` owns them all: it starts the internal one first (workers may
register as soon as the port file appears), then the public one and the HTTP
door, writes one port file with every port, drains the public one and the HTTP
door together on SIGTERM (in-flight requests finish while workers can still
heartbeat) and stops the internal one last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.router.http_door import HttpDoor
from services.router.router import Router
from services.router.servicer import (
    SERVICE_NAME,
    RouterServicer,
    add_internal_to_server,
    add_public_to_server,
)

log = structlog.get_logger()

# Per message: tags, lengths, the scalars (sampling, priority) and room for new small fields.
_FIXED_OVERHEAD = 4096
_MAX_VARINT32 = 5  # bytes of one uint32 token id on the wire, at most
_MAX_UTF8 = 4  # bytes of one character


def public_message_bytes(limits: RequestLimits, model_id_bytes: int = 1024) -> int:
    """The largest GenerateRequest the request limits allow, in wire bytes.

    The prompt is a oneof: token ids (<= 5 bytes each) or text (parse_generate takes
    <= 8 characters a token, <= 4 bytes each); plus stop strings and ids, ids and
    names. With the default limits about 1 MiB.
    """
    tokens = limits.max_prompt_tokens * _MAX_VARINT32
    text = limits.max_prompt_tokens * 8 * _MAX_UTF8
    stops = limits.max_stop_strings * (limits.max_stop_string_bytes + 8)
    stop_ids = limits.max_stop_token_ids * (_MAX_VARINT32 + 1)
    names = 2 * (limits.max_request_id_bytes + 8) + limits.max_tenant_bytes + 8 + model_id_bytes
    return max(tokens, text) + stops + stop_ids + names + _FIXED_OVERHEAD


class RouterListeners:
    def __init__(self, router: Router, tracing: Any = None):
        settings = router.settings
        server = settings.server
        internal = settings.internal
        self.port_file = server.port_file
        public_cfg = dataclasses.replace(
            server,
            port_file="",  # written here, with both ports
            max_message_bytes=min(server.max_message_bytes, public_message_bytes(settings.limits)),
        )
        internal_cfg = ServerConfig(
            host=internal.host or server.host,
            port=internal.port,
            drain_grace_s=server.drain_grace_s,
            max_message_bytes=server.max_message_bytes,
            log_level=server.log_level,
            so_reuseport=server.so_reuseport,  # a restarted router takes its old ports back at once
        )
        tls = settings.tls
        # TLS on: the internal port takes only mesh certificates (TlsConfig checks there is a CA).
        internal_tls = dataclasses.replace(tls, require_client_cert=True) if tls.serves_tls else None
        self.servicer = RouterServicer(router)
        self.public = MeshServer(
            public_cfg, SERVICE_NAME, registry=router.metrics.registry, tls=tls, tracing=tracing
        )
        self.internal = MeshServer(internal_cfg, SERVICE_NAME, tls=internal_tls, tracing=tracing)
        add_public_to_server(self.servicer, self.public.server)
        add_internal_to_server(self.servicer, self.internal.server)
        http = settings.http
        self.http = HttpDoor(router, http, server, tls) if http.port >= 0 else None
        self._drain_task: asyncio.Future[None] | None = None

    @property
    def address(self) -> str:
        return self.public.address

    @property
    def internal_address(self) -> str:
        return self.internal.address

    @property
    def http_address(self) -> str | None:
        return self.http.address if self.http is not None else None

    async def start(self) -> None:
        await self.internal.start()
        await self.public.start()
        if self.http is not None:
            await self.http.start()
        self._write_port_file()

    def _write_port_file(self) -> None:
        if not self.port_file:
            return
        pub = self.public
        data = {
            "port": pub.port,
            "internal_port": self.internal.port,
            "http_port": self.http.port if self.http is not None else None,
            "metrics_port": pub.metrics.port if pub.metrics else None,
            "health_port": pub.health_port,
            "pid": os.getpid(),
        }
        tmp = self.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.port_file)  # atomic: readers never see half a file

    async def set_ready(self, ready: bool) -> None:
        await self.public.set_ready(ready)
        await self.internal.set_ready(ready)

    async def drain(self) -> None:
        """The public port and the HTTP door together: NOT_SERVING / 503, refuse new
        requests, let in-flight ones finish (each for up to --drain-grace-s)."""
        doors = [self.public.drain()]
        if self.http is not None:
            doors.append(self.http.drain())
        await asyncio.gather(*doors)

    def install_signal_handlers(self, on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """SIGTERM / SIGINT drain both doors, then `on_drain` (closing the router)."""
        loop = asyncio.get_running_loop()

        async def drain_then() -> None:
            await self.drain()
            if on_drain is not None:
                await on_drain()

        def handler(signame: str) -> None:
            log.info("signal", signal=signame, service=SERVICE_NAME)
            if self._drain_task is None:
                self._drain_task = asyncio.ensure_future(drain_then())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig.name)

    async def wait_stopped(self) -> None:
        """Until a drain (or stop) of the doors is over, `on_drain` included."""
        await self.public.wait_stopped()
        if self._drain_task is not None:
            await self._drain_task

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.public.stop()
        await self.internal.stop()
