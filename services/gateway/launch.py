"""Starting the gateway as a local process (`pdmesh up`, compose launch, tests).

The gateway speaks HTTP, so `Launcher.wait_ready` (grpc.health.v1) cannot tell
when it is ready; `wait_ready` here reads the same port file and waits for
/health to answer 200 instead.
"""

from __future__ import annotations

import json
import time

from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec, flags
from services.common.http_probe import http_ready

MODULE = "services.gateway.main"
HEALTH_PATH = "/health"


def gateway_spec(
    router_address: str,
    *,
    name: str = "gateway",
    host: str = "127.0.0.1",
    port: int = 0,
    model_path: str | None = None,
    preset: str | None = None,
    extra: tuple[str, ...] = (),
) -> ServiceSpec:
    args = flags(host=host, port=port, router_address=router_address, model_path=model_path, preset=preset)
    return ServiceSpec(name, MODULE, args + extra, host=host)


def wait_ready(
    launcher: Launcher, svc: RunningService, timeout_s: float = 120.0, path: str = HEALTH_PATH
) -> RunningService:
    """Wait for the port file, then for GET `path` to answer 200."""
    deadline = time.monotonic() + timeout_s
    delay, status = 0.02, "no port file yet"
    while True:
        if svc.proc.poll() is not None:
            raise LaunchError(f"{svc.spec.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        if not svc.port and svc.port_file.exists():
            data = json.loads(svc.port_file.read_text())
            svc.port, svc.metrics_port = int(data["port"]), data.get("metrics_port")
        if svc.port:
            ok, status = http_ready(f"http://{svc.address}{path}", timeout=1.0)
            if ok:
                return svc
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{svc.spec.name} not ready after {timeout_s:.0f}s ({status}):\n{svc.log_tail()}"
            )
        time.sleep(delay)  # polling a child's readiness with backoff, as Launcher.wait_ready does
        delay = min(delay * 1.5, 0.25)


def start_ready(launcher: Launcher, spec: ServiceSpec, timeout_s: float = 120.0) -> RunningService:
    return wait_ready(launcher, launcher.start(spec), timeout_s)
