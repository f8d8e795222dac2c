"""`python -m services.planner.main`: the planner process.

    python -m services.planner.main --router-address router:50061 --actuator kubernetes \\
        --interval-s 10 --ttft-slo-s 2 --itl-slo-s 0.05 --max-workers 8 --port 0 --port-file F

Every `--interval-s` it reads the router's internal listener (Stats,
ListWorkers) and the workers' Stats, decides both pools' sizes
(services/planner/planner.py) and applies them through the actuator
(`kubernetes`: the role Deployments' scale subresource; `metrics-only`: the
`pdmesh_planner_desired_replicas{role}` gauge for an HPA/KEDA; `dry-run`: logs).
It serves grpc.health.v1 ("" live; "pdmesh.planner" ready once it has read the
router once), Prometheus metrics (`--metrics-port`), JSON logs, and drains on
SIGTERM (the loop stops after the step in progress). Every flag also reads a
`PDMESH_*` environment variable (`--help` lists them).

With mTLS the planner calls the router and the workers' Stats with an
`admin` or `planner` certificate (services/common/call_guards.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from services.common.logging import configure_logging
from services.common.server import MeshServer, run
from services.common.tls import client_tls
from services.planner.actuators import DryRunActuator, KubernetesActuator, MetricsOnlyActuator
from services.planner.capacity import profile_model
from services.planner.config import PlannerSettings, make_parser, parse_settings, sections
from services.planner.loop import PlannerLoop
from services.planner.metrics import PlannerMetrics
from services.planner.planner import Planner
from services.planner.stats_reader import StatsReader

SERVICE_NAME = "pdmesh.planner"  # the readiness name (the planner serves no RPC of its own)
CONFIGS = sections()
__all__ = ["CONFIGS", "SERVICE_NAME", "main", "make_parser", "serve"]


def make_actuator(settings: PlannerSettings, registry: CollectorRegistry, initial: dict[str, int]):
    kind = settings.service.actuator
    if kind == "kubernetes":
        return KubernetesActuator(settings.kubernetes)
    if kind == "metrics-only":
        return MetricsOnlyActuator(registry, initial)
    return DryRunActuator(dict(initial))


async def serve(settings: PlannerSettings) -> None:
    log = configure_logging("planner", settings.server.log_level)
    cfg = settings.service
    model = profile_model(cfg.profile, cfg.profile_file)
    planner = Planner(settings.planner, model)
    registry = CollectorRegistry()
    tls = client_tls(settings.tls)
    reader = StatsReader(cfg.router_address, tls, cfg.stats_timeout_s, cfg.worker_stats)
    initial = {"prefill": settings.planner.min_prefill, "decode": settings.planner.min_decode}
    actuator = make_actuator(settings, registry, initial)
    metrics = PlannerMetrics(registry, getattr(actuator, "gauge", None))
    loop = PlannerLoop(planner, reader, actuator, metrics)
    server = MeshServer(settings.server, SERVICE_NAME, registry=registry, tls=settings.tls)
    await server.start()
    server.install_signal_handlers()
    stop = asyncio.Event()
    runner = asyncio.create_task(loop.run(stop))

    async def ready_after_first_read() -> None:
        while loop._prev is None and not stop.is_set():
            await asyncio.sleep(0.1)  # polling the loop's first read, not synchronisation
        await server.set_ready(True)

    readiness = asyncio.create_task(ready_after_first_read())
    log.info(
        "planner_started",
        router=cfg.router_address,
        actuator=cfg.actuator,
        profile=model.profile.name,
        interval_s=settings.planner.interval_s,
    )
    try:
        await server.wait_stopped()
    finally:
        stop.set()
        readiness.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await readiness
        await runner  # the step in progress ends; no scale call is cut in half
        await reader.close()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    run(lambda: serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
