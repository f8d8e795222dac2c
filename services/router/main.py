"""`python -m services.router.main`: the router process.

    python -m services.router.main --port 0 --internal-port 0 --port-file F \
        --decode-workers a:1,b:2 --prefill-workers c:3 [--policy kv_aware] [--so-reuseport 1]

Serves pdmesh.v1.RouterService on two listeners (services/router/listeners.py):
the public port (Generate, Cancel) and the internal one (`--internal-port`:
worker membership, ListWorkers, Stats), each with health ("" = live;
"pdmesh.v1.RouterService" = ready once at least one decode worker is healthy)
and reflection; with `--http-port` also the OpenAI-compatible HTTP API
(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) on the
same event loop, calling the request flow in-process (services/router/http_door.py);
Prometheus metrics (`--metrics-port`); drains both doors on SIGTERM. The port
file holds every port ("port", "internal_port", "http_port"). Every flag also reads a
`PDMESH_*` environment variable (`--help` lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Sequence

from services.common.gc_tuning import tune_gc
from services.common.logging import configure_logging
from services.common.server import run
from services.common.tracing import Tracing, client_interceptors
from services.common.tracing import shutdown as shutdown_tracing
from services.router.config import ModelSpec, RouterSettings, make_parser, parse_settings, sections
from services.router.listeners import RouterListeners
from services.router.router import Router
from services.router.servicer import SERVICE_NAME

# What docs/CONFIG.md and `--help` are made from (the same sections parse_settings builds).
CONFIGS = sections()
__all__ = ["CONFIGS", "SERVICE_NAME", "main", "make_parser", "serve"]


async def _follow_readiness(router: Router, server: RouterListeners) -> None:
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
    server = RouterListeners(router, tracing=tracing)
    await server.start()
    # SIGTERM drains the public port and the HTTP door; workers can still heartbeat until
    # the router closes.
    server.install_signal_handlers(on_drain=router.close)
    await router.start()
    follower = asyncio.create_task(_follow_readiness(router, server))
    tune_gc()  # start-up's objects frozen, collections rarer (services/common/gc_tuning.py)
    log.info(
        "router_started",
        model=model.model_id,
        policy=settings.router.policy,
        decode_workers=list(settings.router.decode_workers),
        prefill_workers=list(settings.router.prefill_workers),
        api_keys=router.auth is not None,
        internal_address=server.internal_address,
        http_address=server.http_address,
    )
    try:
        await server.wait_stopped()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await router.close()
        if server.http is not None:
            await server.http.stop()  # a no-op after a drain
        await server.internal.stop()
        shutdown_tracing(tracing)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    run(lambda: serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
