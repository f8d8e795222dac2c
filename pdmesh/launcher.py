"""Start pdmesh services as local processes and stop them cleanly.

Used by `pdmesh up`, the e2e tests and the compose launch test. Each service
is started with `--port-file`; the launcher learns the bound port from it (so
everything can bind port 0), then waits until grpc.health.v1 reports the
service's ready name SERVING. Stopping sends SIGTERM (the services drain) and
escalates to SIGKILL after a grace period. Only processes this launcher
started are ever signalled, by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.client import health_check
from services.common.server import PARENT_PID_ENV
from services.common.tls import TlsConfig, client_tls

# Native libraries write their own plain-text lines to stderr (gRPC C-core's "I1201 ...
# chttp2_transport.cc" lines, NIXL's and UCX's INFO/WARN lines); the services' logs are
# JSON, so these are off, errors excepted where the library allows. A value in the
# caller's environment wins (GRPC_VERBOSITY=debug, NIXL_LOG_LEVEL=INFO to see them again).
QUIET_NATIVE_LOGS = {"GRPC_VERBOSITY": "NONE", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}


class LaunchError(RuntimeError):
    """A service exited or did not become healthy in time."""


@dataclass(frozen=True)
class ServiceSpec:
    """One process to start: `python -m <module> <args>` plus its ready name."""

    name: str
    module: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    ready_service: str = ""
    host: str = "127.0.0.1"


@dataclass
class RunningService:
    spec: ServiceSpec
    proc: subprocess.Popen
    port_file: Path
    log_path: Path
    port: int = 0
    metrics_port: int | None = None
    internal_port: int | None = None  # the router's internal listener (membership), from its port file
    http_port: int | None = None  # the router's OpenAI-compatible HTTP door (--http-port), if on

    @property
    def address(self) -> str:
        return f"{self.spec.host}:{self.port}"

    @property
    def internal_address(self) -> str:
        """Where workers register with a router (its --internal-port)."""
        if not self.internal_port:
            raise LaunchError(f"{self.spec.name} reported no internal port")
        return f"{self.spec.host}:{self.internal_port}"

    @property
    def http_address(self) -> str:
        """The router's OpenAI-compatible HTTP door (its --http-port)."""
        if not self.http_port:
            raise LaunchError(f"{self.spec.name} reported no HTTP port")
        return f"{self.spec.host}:{self.http_port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Launcher:
    """Owns the processes it starts; `close()` stops them all (reverse order)."""

    def __init__(
        self,
        workdir: str | os.PathLike | None = None,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
        tls: TlsConfig | None = None,
    ):
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="pdmesh-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.services: list[RunningService] = []
        self._tls = client_tls(tls)  # readiness checks of a TLS mesh (any mesh certificate)

    def start(self, spec: ServiceSpec) -> RunningService:
        """Start a process (does not wait; see `wait_ready`)."""
        port_file = self.workdir / f"{spec.name}.port.json"
        port_file.unlink(missing_ok=True)
        log_path = self.workdir / f"{spec.name}.log"
        env = {
            **QUIET_NATIVE_LOGS,  # JSON logs only: gRPC C-core lines off unless the caller asks
            **self.base_env,
            **spec.env,
            "PYTHONUNBUFFERED": "1",
            PARENT_PID_ENV: str(os.getpid()),
        }
        argv = [self.python, "-m", spec.module, *spec.args, "--port-file", str(port_file)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        svc = RunningService(spec, proc, port_file, log_path)
        self.services.append(svc)
        return svc

    def poll_ready(self, svc: RunningService) -> bool:
        """One look: True once the service reports SERVING; LaunchError if it exited."""
        if svc.proc.poll() is not None:
            raise LaunchError(f"{svc.spec.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        if not svc.port and svc.port_file.exists():
            data = json.loads(svc.port_file.read_text())
            svc.port, svc.metrics_port = int(data["port"]), data.get("metrics_port")
            svc.internal_port = data.get("internal_port")
            svc.http_port = data.get("http_port")
        # A router's public port may be shared (SO_REUSEPORT, `--routers N`): a check there can
        # reach another router, which is already SERVING, and call this one ready before it has a
        # worker (its first requests then got 503). Its internal port is its own.
        where = svc.internal_address if svc.internal_port else svc.address
        return (
            bool(svc.port)
            and health_check(where, svc.spec.ready_service, timeout=1.0, tls=self._tls)[0] == "SERVING"
        )

    def wait_ready(
        self, svc: RunningService, timeout_s: float = 120.0, on_poll: Callable[[], None] | None = None
    ) -> RunningService:
        """Wait for the port file, then for health SERVING on the ready name."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while not self.poll_ready(svc):
            if time.monotonic() > deadline:
                raise LaunchError(f"{svc.spec.name} not ready after {timeout_s:.0f}s:\n{svc.log_tail()}")
            if on_poll is not None:
                on_poll()
            # Polling a child's readiness: backoff, not synchronisation on time.
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        return svc

    def start_ready(self, spec: ServiceSpec, timeout_s: float = 120.0) -> RunningService:
        return self.wait_ready(self.start(spec), timeout_s)

    def find(self, name: str) -> RunningService:
        for svc in self.services:
            if svc.spec.name == name:
                return svc
        raise KeyError(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one of our own processes (fault injection, tests)."""
        svc = self.find(name)
        if svc.proc.poll() is None:
            svc.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                svc.proc.wait()

    def stop(self, svc: RunningService, grace_s: float = 15.0) -> int | None:
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
            try:
                svc.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        return svc.proc.returncode

    def close(self, grace_s: float = 15.0) -> None:
        for svc in reversed(self.services):
            self.stop(svc, grace_s)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flags(**values: object) -> tuple[str, ...]:
    """`flags(max_local_prefill_tokens=512)` -> ("--max-local-prefill-tokens", "512"); None is skipped."""
    out: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        out += ["--" + key.replace("_", "-"), str(value)]
    return tuple(out)


def wait_all(
    launcher: Launcher,
    services: Sequence[RunningService],
    timeout_s: float = 120.0,
    on_ready: Callable[[RunningService], None] | None = None,
) -> None:
    """Wait until every one of `services` (started together) is SERVING."""
    pending = list(services)
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while pending:
        for svc in [s for s in pending if launcher.poll_ready(s)]:
            pending.remove(svc)
            if on_ready is not None:
                on_ready(svc)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.spec.name for s in pending)
            raise LaunchError(f"{names} not ready after {timeout_s:.0f}s:\n{pending[0].log_tail()}")
        time.sleep(delay)  # polling children's readiness, with backoff
        delay = min(delay * 1.5, 0.25)
