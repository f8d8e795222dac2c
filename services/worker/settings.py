"""Typed settings of a worker process and the bootstrap decode and prefill share.

A role's settings are one frozen dataclass (`DecodeSettings`, `PrefillSettings`)
that extends `WorkerSettings` with the role's own sections, like the router's
`RouterSettings`. Each role lists its sections as (field, config class, flag
prefix); the same list gives the argparse flags (`make_parser`), the settings
(`parse_settings`: flags win over `PDMESH_*` variables, which win over defaults)
and docs/CONFIG.md (`CONFIGS` of the role's main).

`start_runtime` is the start every worker main begins with (logging, tracing,
the `WorkerRuntime` set up: engine loaded, port bound, KV transport up); the
role adds its servicers, then `runtime.serve(load)`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.common.config import add_arguments, build
from services.common.logging import configure_logging
from services.common.server import ServerConfig, run
from services.common.tls import TlsConfig
from services.common.tracing import Tracing, TracingConfig
from services.common.validation import RequestLimits
from services.engine.config import EngineConfig
from services.worker.runtime import WorkerConfig, WorkerRuntime

# (field of the settings dataclass, config class, flag prefix)
Section = tuple[str, type, str]


@dataclass(frozen=True)
class WorkerSettings:
    """The sections every worker takes."""

    server: ServerConfig = field(default_factory=ServerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)


S = TypeVar("S", bound=WorkerSettings)


def configs(sections: Sequence[Section]) -> tuple[tuple[type, str], ...]:
    """(config class, flag prefix) of every section, in `--help` order (a main's CONFIGS)."""
    return tuple((cls, prefix) for _, cls, prefix in sections)


def make_parser(prog: str, description: str, sections: Sequence[Section]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for _, cls, prefix in sections:
        add_arguments(parser, cls, prefix)
    return parser


def parse_settings(
    settings_type: type[S],
    parser: argparse.ArgumentParser,
    sections: Sequence[Section],
    argv: Sequence[str] | None,
    env: Mapping[str, str],
) -> S:
    args = parser.parse_args(argv)
    parts: dict[str, Any] = {name: build(cls, args, env, prefix) for name, cls, prefix in sections}
    return settings_type(**parts)


async def start_runtime(role: str, service_name: str, settings: WorkerSettings) -> WorkerRuntime:
    """Logging and tracing on, the runtime set up (engine, bound port, KV transport)."""
    configure_logging(role, settings.server.log_level)
    rt = WorkerRuntime(
        role,
        service_name,
        settings.server,
        settings.worker,
        settings.engine,
        tls=settings.tls,
        tracing=Tracing.start(settings.tracing, role),
    )
    await rt.setup()
    return rt


def run_worker(
    parse: Callable[[Sequence[str] | None, Mapping[str, str]], S],
    serve: Callable[[S], Awaitable[None]],
    argv: Sequence[str] | None,
) -> int:
    """A worker main: settings from flags and the environment, then serve until drained."""
    settings = parse(argv, dict(os.environ))
    run(lambda: serve(settings))
    return 0
