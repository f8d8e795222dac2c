"""The planner service's configuration: frozen dataclasses from flags and `PDMESH_*` variables.

`PlannerServiceConfig` is the service's own (where the router is, which
actuator, which timing profile the sizing starts from); the core's
`PlannerConfig` and `HysteresisConfig` and the kubernetes actuator's
`KubernetesConfig` are their modules'; the health/metrics listener is a
`ServerConfig` and the client certificate a `TlsConfig`. `parse_settings`
builds them all once, in `main()` (as services/router/config.py does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.config import add_arguments, build, require, setting
from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.planner.actuators import ACTUATORS, KubernetesConfig
from services.planner.hysteresis import HysteresisConfig
from services.planner.planner import PlannerConfig

SERVICE_ACTUATORS = tuple(a for a in ACTUATORS if a != "local")  # local is `pdmesh up --planner`'s


@dataclass(frozen=True)
class PlannerServiceConfig:
    router_address: str = setting(
        "", "host:port of the router's internal listener (--internal-port): Stats and ListWorkers"
    )
    actuator: str = setting("dry-run", f"how decisions are applied, one of {SERVICE_ACTUATORS}")
    profile: str = setting(
        "splitwise-h100-llama70b", "timing profile the sizing starts from (services/model/profiles.json)"
    )
    profile_file: str | None = setting(None, "a JSON file of timing profiles instead of the built-in ones")
    worker_stats: bool = setting(True, "also read each worker's Stats (prefix hit rate)")
    stats_timeout_s: float = setting(5.0, "deadline of each Stats / ListWorkers call")

    def __post_init__(self) -> None:
        require(bool(self.router_address), "router_address is required (the router's internal host:port)")
        require(self.actuator in SERVICE_ACTUATORS, f"actuator must be one of {SERVICE_ACTUATORS}")
        require(self.stats_timeout_s > 0, "stats_timeout_s must be > 0")


@dataclass(frozen=True)
class PlannerSettings:
    server: ServerConfig = field(default_factory=ServerConfig)
    service: PlannerServiceConfig = field(default_factory=lambda: PlannerServiceConfig("127.0.0.1:50061"))
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)


# (field, class, flag prefix); hysteresis goes into PlannerConfig.hysteresis
_SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("server", ServerConfig, ""),
    ("service", PlannerServiceConfig, ""),
    ("planner", PlannerConfig, ""),
    ("hysteresis", HysteresisConfig, ""),
    ("kubernetes", KubernetesConfig, "k8s_"),
    ("tls", TlsConfig, "tls_"),
)


def sections() -> tuple[tuple[type, str], ...]:
    return tuple((cls, prefix) for _, cls, prefix in _SECTIONS)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.planner.main", description="pdmesh planner: SLO-driven pool sizing"
    )
    for _, cls, prefix in _SECTIONS:
        add_arguments(parser, cls, prefix)
    return parser


def parse_settings(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> PlannerSettings:
    """Flags win over `PDMESH_*` environment variables, which win over defaults."""
    args = make_parser().parse_args(argv)
    env = os.environ if env is None else env
    parts: dict[str, Any] = {name: build(cls, args, env, prefix) for name, cls, prefix in _SECTIONS}
    hysteresis = parts.pop("hysteresis")
    parts["planner"] = dataclasses.replace(parts["planner"], hysteresis=hysteresis)
    return PlannerSettings(**parts)
