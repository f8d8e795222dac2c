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

`RouterListeners` owns both MeshServers: it starts the internal one first
(workers may register as soon as the port file appears), writes one port file
with both ports, drains the public one on SIGTERM (in-flight requests finish
while workers can still heartbeat) and stops the internal one last.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.router.router import Router
from services.router.servicer import (
    SERVICE_NAME,
    RouterServicer,
    add_internal_to_server,
    add_public_to_server,
)

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

    @property
    def address(self) -> str:
        return self.public.address

    @property
    def internal_address(self) -> str:
        return self.internal.address

    async def start(self) -> None:
        await self.internal.start()
        await self.public.start()
        self._write_port_file()

    def _write_port_file(self) -> None:
        if not self.port_file:
            return
        pub = self.public
        data = {
            "port": pub.port,
            "internal_port": self.internal.port,
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

    async def stop(self) -> None:
        await self.public.stop()
        await self.internal.stop()
