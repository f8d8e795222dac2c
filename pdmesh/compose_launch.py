"""Run compose.yaml as local processes on loopback, so the file is tested, not trusted.

Docker cannot run on every machine that tests pdmesh, so this module reads
compose.yaml (the single source of truth) and starts each service's declared
command and environment as a local process. Only what must differ between
containers and processes on one host is rewritten, in `local_env`:

  - `PDMESH_HOST` -> 127.0.0.1 and `PDMESH_PORT` -> 0 (every container listens on
    the same port; processes sharing loopback cannot), `PDMESH_METRICS_PORT` -> 0
    when metrics are on, `PDMESH_INTERNAL_PORT` (the router's internal listener)
    and `PDMESH_HTTP_PORT` (its OpenAI-compatible HTTP door) -> 0; the launcher
    adds `--port-file` to learn the ports;
  - every `service:port` naming a compose service and its in-container port (or
    its internal port) -> the real loopback address(es) of that service's
    processes on that port (all replicas, comma-separated, as a DNS name with
    several A records would give).

Start order follows `depends_on` the way compose does: a service starts once
each dependency is *started* (its port is known) or *healthy* (its healthcheck
passes), whichever its condition says; services start as soon as they may, not
one after another, so a file whose conditions would deadlock under compose
times out here too. A service may only use the address of a service it depends
on. Healthchecks are read from the file: `pdmesh health ADDR NAME` means
grpc.health.v1 readiness of NAME; `python -m services.gateway.healthcheck URL`
means GET of URL's path answering 200. `${VAR:-default}` is interpolated from
the mapping given (not the caller's environment, unless passed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from pdmesh.client import health_check
from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec

CONDITIONS = ("service_started", "service_healthy")
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")
_ADDRESS = re.compile(r"(?<![\w.-])(?P<host>[a-z][a-z0-9_-]*):(?P<port>\d+)\b")


class ComposeError(ValueError):
    """compose.yaml says something this launcher (or compose) cannot run."""


@dataclass(frozen=True)
class Readiness:
    kind: str  # "grpc" (target = grpc.health.v1 service name) or "http" (target = URL path)
    target: str
    port: int  # the in-container port the healthcheck talks to


@dataclass(frozen=True)
class ComposeService:
    name: str
    module: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    ready: Readiness
    depends_on: Mapping[str, str] = field(default_factory=dict)
    port: int = 0  # in-container listening port (PDMESH_PORT)
    internal_port: int = 0  # the router's internal listener (PDMESH_INTERNAL_PORT), 0 = none


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group("name"), m.group("op"), m.group("default") or ""
        if name in environ and (environ[name] != "" or op != ":-"):
            return environ[name]
        return default if op else ""

    return _VAR.sub(sub, value)


def _command(name: str, raw: Any) -> tuple[str, tuple[str, ...]]:
    argv = shlex.split(raw) if isinstance(raw, str) else [str(a) for a in raw or ()]
    if len(argv) < 3 or argv[0] != "python" or argv[1] != "-m":
        raise ComposeError(f"{name}: command must be ['python', '-m', <module>, ...], got {argv}")
    return argv[2], tuple(argv[3:])


def _readiness(name: str, raw: Any) -> Readiness:
    test = (raw or {}).get("test")
    argv = shlex.split(test) if isinstance(test, str) else list(test or ())
    if argv[:1] in (["CMD"], ["CMD-SHELL"]):
        argv = argv[1:] if argv[0] == "CMD" else shlex.split(argv[1])
    if argv[:2] == ["pdmesh", "health"] and len(argv) >= 4:
        return Readiness("grpc", argv[3], int(argv[2].rsplit(":", 1)[1]))
    if argv[:3] == ["python", "-m", "services.gateway.healthcheck"] and len(argv) == 4:
        url = urlparse(argv[3])
        return Readiness("http", url.path or "/", url.port or 80)
    raise ComposeError(
        f"{name}: healthcheck.test must be `pdmesh health ADDR NAME` or the gateway's, got {argv}"
    )


def load_compose(
    path: str | os.PathLike, environ: Mapping[str, str] | None = None, profiles: Sequence[str] = ()
) -> dict[str, ComposeService]:
    """The services of a compose file, interpolated with `environ` (default: none set).

    As in Docker Compose, a service with `profiles:` is active only when one of its
    profiles is given (compose.yaml's `gpu` services are skipped by default)."""
    environ = {} if environ is None else environ
    doc = yaml.safe_load(Path(path).read_text())
    services: dict[str, ComposeService] = {}
    for name, raw in (doc.get("services") or {}).items():
        if raw.get("profiles") and not set(raw["profiles"]) & set(profiles):
            continue
        env_raw = raw.get("environment") or {}
        if isinstance(env_raw, list):
            env_raw = dict(item.split("=", 1) for item in env_raw)
        env = {str(k): interpolate(str(v), environ) for k, v in env_raw.items()}
        module, args = _command(name, raw.get("command"))
        deps_raw = raw.get("depends_on") or {}
        deps = {d: "service_started" for d in deps_raw} if isinstance(deps_raw, list) else {}
        if isinstance(deps_raw, dict):
            deps = {d: (c or {}).get("condition", "service_started") for d, c in deps_raw.items()}
        for dep, cond in deps.items():
            if cond not in CONDITIONS:
                raise ComposeError(f"{name}: depends_on {dep}: condition {cond!r} not in {CONDITIONS}")
        if "PDMESH_PORT" not in env:
            raise ComposeError(f"{name}: environment must set PDMESH_PORT (its in-container port)")
        ready = _readiness(name, raw.get("healthcheck"))
        services[name] = ComposeService(
            name,
            module,
            args,
            env,
            ready,
            deps,
            int(env["PDMESH_PORT"]),
            int(env.get("PDMESH_INTERNAL_PORT", 0)),
        )
    for svc in services.values():
        for dep in svc.depends_on:
            if dep not in services:
                raise ComposeError(f"{svc.name}: depends_on unknown service {dep!r}")
    start_order(services)
    return services


def start_order(services: Mapping[str, ComposeService]) -> list[str]:
    """A topological order of depends_on (raises ComposeError on a cycle)."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ComposeError(f"depends_on cycle: {' -> '.join((*path, name))}")
        state[name] = "visiting"
        for dep in services[name].depends_on:
            visit(dep, (*path, name))
        state[name] = "done"
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def local_env(
    svc: ComposeService,
    services: Mapping[str, ComposeService],
    addresses: Mapping[str, list[str]],
    internal: Mapping[str, list[str]] | None = None,
) -> dict[str, str]:
    """`svc`'s declared environment with the loopback rewrites (see the module docstring);
    `internal` holds the internal-port addresses of the services that have one."""
    internal = internal or {}
    out: dict[str, str] = {}
    for key, value in svc.env.items():
        if key == "PDMESH_HOST":
            value = "127.0.0.1"
        elif key in ("PDMESH_PORT", "PDMESH_INTERNAL_PORT", "PDMESH_HTTP_PORT") or (
            key == "PDMESH_METRICS_PORT" and int(value) >= 0
        ):
            value = "0"
        else:

            def sub(m: re.Match[str], key: str = key) -> str:
                host, port = m.group("host"), int(m.group("port"))
                target = services.get(host)
                if target is None or port not in (target.port, target.internal_port or -1):
                    return m.group(0)
                if host not in svc.depends_on:
                    raise ComposeError(f"{svc.name}: {key} uses {host}:{port} but does not depend on {host}")
                return ",".join(internal[host] if port != target.port else addresses[host])

            value = _ADDRESS.sub(sub, value)
        out[key] = value
    return out


class ComposeLaunch:
    """Starts the services of one compose file as processes through a `Launcher`."""

    def __init__(
        self,
        launcher: Launcher,
        services: Mapping[str, ComposeService],
        scale: Mapping[str, int] | None = None,
    ):
        self.launcher = launcher
        self.services = services
        self.scale = {name: (scale or {}).get(name, 1) for name in services}
        self.replicas: dict[str, list[RunningService]] = {}
        self._healthy: set[str] = set()

    def up(self, timeout_s: float = 120.0) -> dict[str, list[RunningService]]:
        """Start everything as depends_on allows; return once every service is healthy."""
        pending = start_order(self.services)
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            for name in list(pending):
                if all(self._satisfied(dep, cond) for dep, cond in self.services[name].depends_on.items()):
                    self._start(name)
                    pending.remove(name)
            if not pending and all(self._satisfied(n, "service_healthy") for n in self.services):
                return self.replicas
            self._check_alive()
            if time.monotonic() > deadline:
                waiting = [n for n in self.services if n not in self._healthy]
                raise LaunchError(
                    f"compose launch: not started {pending}, not healthy {waiting}:\n{self._tails()}"
                )
            time.sleep(delay)  # polling children's ports and health, with backoff
            delay = min(delay * 1.5, 0.25)

    def address(self, name: str, replica: int = 0) -> str:
        return self.replicas[name][replica].address

    def http_address(self, name: str, replica: int = 0) -> str:
        """Where a router replica serves the OpenAI-compatible HTTP API (PDMESH_HTTP_PORT)."""
        return self.replicas[name][replica].http_address

    def _start(self, name: str) -> None:
        svc = self.services[name]
        addresses = {dep: [r.address for r in self.replicas[dep]] for dep in svc.depends_on}
        internal = {
            dep: [r.internal_address for r in self.replicas[dep]]
            for dep in svc.depends_on
            if self.services[dep].internal_port
        }
        env = local_env(svc, self.services, addresses, internal)
        count = self.scale[name]
        self.replicas[name] = [
            self.launcher.start(
                ServiceSpec(
                    name if count == 1 else f"{name}-{i + 1}",
                    svc.module,
                    svc.args,
                    env,
                    ready_service=svc.ready.target if svc.ready.kind == "grpc" else "",
                )
            )
            for i in range(count)
        ]

    def _satisfied(self, name: str, condition: str) -> bool:
        replicas = self.replicas.get(name)
        if not replicas or not all(_read_port(r) for r in replicas):
            return False
        if condition == "service_started":
            return True
        if name not in self._healthy and all(self._probe(name, r) for r in replicas):
            self._healthy.add(name)
        return name in self._healthy

    def _probe(self, name: str, svc: RunningService) -> bool:
        ready = self.services[name].ready
        if ready.kind == "grpc":
            return health_check(svc.address, ready.target, timeout=1.0)[0] == "SERVING"
        from services.common.http_probe import http_ready

        return http_ready(f"http://{svc.address}{ready.target}", timeout=1.0)[0]

    def _check_alive(self) -> None:
        for replicas in self.replicas.values():
            for r in replicas:
                if r.proc.poll() is not None:
                    raise LaunchError(f"{r.spec.name} exited with code {r.proc.returncode}:\n{r.log_tail()}")

    def _tails(self) -> str:
        return "\n".join(f"--- {r.spec.name}\n{r.log_tail(10)}" for rs in self.replicas.values() for r in rs)


def _read_port(svc: RunningService) -> bool:
    if not svc.port and svc.port_file.exists():
        data = json.loads(svc.port_file.read_text())
        svc.port, svc.metrics_port = int(data["port"]), data.get("metrics_port")
        svc.internal_port = data.get("internal_port")
        svc.http_port = data.get("http_port")
    return bool(svc.port)
