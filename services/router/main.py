"""`python -m services.router.main`: the router process.

    python -m services.router.main --port 0 --port-file F \
        --decode-workers a:1,b:2 --prefill-workers c:3 [--policy kv_aware] [--so-reuseport 1]

Serves pdmesh.v1.RouterService with health ("" = live; "pdmesh.v1.RouterService"
= ready once at least one decode worker is healthy), reflection, Prometheus
metrics (`--metrics-port`), and drains on SIGTERM. Every flag also reads a
`PDMESH_*` environment variable (`--help` lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Sequence

from services.common.logging import configure_logging
from services.common.server import MeshServer, run
from services.common.tracing import Tracing, client_interceptors
from services.common.tracing import shutdown as shutdown_tracing
from services.router.config import ModelSpec, RouterSettings, make_parser, parse_settings, sections
from services.router.router import Router
from services.router.servicer import SERVICE_NAME, add_to_server

# What docs/CONFIG.md and `--help` are made from (the same sections parse_settings builds).
CONFIGS = sections()
__all__ = ["CONFIGS", "main", "make_parser", "serve"]


async def _follow_readiness(router: Router, server: MeshServer) -> None:
    ready = None
    while True:
        now = router.ready()
        if now != ready:
            ready = now
            await server.set_ready(now)
        await router.wait_changed()


async def serve(settings: RouterSettings) -> None:
    log = configure_logging("router", settings.server.log_level)
    model = ModelSpec.load(settings.router)
    tracing = Tracing.start(settings.tracing, "router")
    router = Router(
        settings,
        model,
        subscriber=f"router-{socket.gethostname()}-{os.getpid()}",
        interceptors=client_interceptors(tracing),
    )
    server = MeshServer(
        settings.server, SERVICE_NAME, registry=router.metrics.registry, tls=settings.tls, tracing=tracing
    )
    add_to_server(router, server.server)
    await server.start()
    server.install_signal_handlers(on_drain=router.close)
    await router.start()
    follower = asyncio.create_task(_follow_readiness(router, server))
    log.info(
        "router_started",
        model=model.model_id,
        policy=settings.router.policy,
        decode_workers=list(settings.router.decode_workers),
        prefill_workers=list(settings.router.prefill_workers),
        api_keys=router.auth is not None,
    )
    try:
        await server.wait_stopped()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await router.close()
        shutdown_tracing(tracing)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    run(lambda: serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
