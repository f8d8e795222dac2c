"""Actuators: how a planner decision becomes running workers.

One protocol, `Actuator` (read the replica counts per role, set one), and one
factory (`make_actuator`). Implementations:

- `kubernetes`: the `scale` subresource of each role's Deployment through the
  official `kubernetes` client (GET and PATCH
  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale, an autoscaling/v1
  `Scale`); needs the Role in deploy/k8s/overlays/planner/planner-rbac.yaml. The client is
  synchronous, so calls run in a thread.
- `metrics-only`: sets `pdmesh_planner_desired_replicas{role}` for HPA/KEDA and
  changes nothing itself.
- `dry-run`: logs what it would do.
- `local`: lives with the launcher that owns the processes (`pdmesh up
  --planner`, pdmesh/local_actuator.py), which implements `Actuator` over its
  own processes; this package names no launcher (the planner sits below the CLI).

Roles are "prefill" and "decode".
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Gauge

from services.common.config import require, setting

log = structlog.get_logger()

ROLES = ("prefill", "decode")
ACTUATORS = ("kubernetes", "metrics-only", "dry-run", "local")


class ActuatorError(Exception):
    """A scale call failed (the planner logs it, counts it and tries again next interval)."""


class Actuator(Protocol):
    async def replicas(self) -> dict[str, int]:
        """Desired replicas per role as the platform has them now."""
        ...

    async def scale(self, role: str, replicas: int) -> None: ...


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str = setting("pdmesh", "planner kubernetes actuator: namespace of the role Deployments")
    prefill_deployment: str = setting("pdmesh-prefill", "planner: Deployment of the prefill workers")
    decode_deployment: str = setting("pdmesh-decode", "planner: Deployment of the decode workers")
    api_host: str | None = setting(None, "planner: API server URL; unset = in-cluster service account")
    api_token: str | None = setting(None, "planner: bearer token for api_host (unset = none)")
    verify_tls: bool = setting(True, "planner: verify the API server's certificate")

    def __post_init__(self) -> None:
        require(bool(self.namespace), "namespace must not be empty")

    def deployments(self) -> dict[str, str]:
        return {"prefill": self.prefill_deployment, "decode": self.decode_deployment}


class KubernetesActuator:
    def __init__(self, config: KubernetesConfig, api: Any = None):
        self.config = config
        self._api = api if api is not None else _apps_api(config)

    async def replicas(self) -> dict[str, int]:
        out = {}
        for role, name in self.config.deployments().items():
            scale = await self._call(self._api.read_namespaced_deployment_scale, name, self.config.namespace)
            out[role] = int(scale.spec.replicas or 0)
        return out

    async def scale(self, role: str, replicas: int) -> None:
        name = self._deployment(role)
        # A JSON patch (the client's default content type for a list body): replace only the count.
        body = [{"op": "replace", "path": "/spec/replicas", "value": int(replicas)}]
        await self._call(self._api.patch_namespaced_deployment_scale, name, self.config.namespace, body)
        log.info("planner.scaled", role=role, deployment=name, replicas=replicas)

    def _deployment(self, role: str) -> str:
        try:
            return self.config.deployments()[role]
        except KeyError:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}") from None

    async def _call(self, fn, *args):
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args)
        except ApiException as e:
            raise ActuatorError(f"kubernetes {fn.__name__} {args[:2]}: {e.status} {e.reason}") from e
        except OSError as e:
            raise ActuatorError(f"kubernetes {fn.__name__}: {e}") from e


def _apps_api(config: KubernetesConfig):
    from kubernetes import client
    from kubernetes import config as kube_config

    if config.api_host is None:
        kube_config.load_incluster_config()
        return client.AppsV1Api()
    conf = client.Configuration(host=config.api_host)
    conf.verify_ssl = config.verify_tls
    if config.api_token:
        conf.api_key = {"authorization": config.api_token}
        conf.api_key_prefix = {"authorization": "Bearer"}
    return client.AppsV1Api(client.ApiClient(conf))


class MetricsOnlyActuator:
    """Publishes the desired counts; an HPA or KEDA scaler acts on them."""

    def __init__(self, registry: CollectorRegistry, initial: Mapping[str, int]):
        self.gauge = Gauge(
            "pdmesh_planner_desired_replicas",
            "Workers per role the planner wants",
            ["role"],
            registry=registry,
        )
        self._desired = dict(initial)
        for role, n in self._desired.items():
            self.gauge.labels(role=role).set(n)

    async def replicas(self) -> dict[str, int]:
        return dict(self._desired)

    async def scale(self, role: str, replicas: int) -> None:
        self._desired[role] = replicas
        self.gauge.labels(role=role).set(replicas)


@dataclass
class DryRunActuator:
    desired: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 1))
    calls: list[tuple[str, int]] = field(default_factory=list)

    async def replicas(self) -> dict[str, int]:
        return dict(self.desired)

    async def scale(self, role: str, replicas: int) -> None:
        self.calls.append((role, replicas))
        self.desired[role] = replicas
        log.info("planner.dry_run", role=role, replicas=replicas)
