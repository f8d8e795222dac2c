"""Facts about the repository that deployment files must agree with, derived from
the code so that a renamed flag, module or service name fails the deploy tests.

`flag_env_names(module)` captures the argparse parser a service's `main([])` builds
(from its config dataclasses, through services.common.config) and returns the
`PDMESH_*` variable of every flag.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[3]
GRPC_MODULES = (
    "services.kvtransfer.main",
    "services.prefill.main",
    "services.decode.main",
    "services.router.main",
)
GATEWAY_MODULE = "services.gateway.main"
ADDRESS = re.compile(r"(?<![\w.-])([a-z][a-z0-9-]*):(\d+)\b")


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def image() -> str:
    return f"pdmesh:{version()}"


def module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.cache
def parser_of(module: str) -> argparse.ArgumentParser:
    """The argument parser `module.main([])` would parse with (nothing is started)."""

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    mod = importlib.import_module(module)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            mod.main([])
        except _Captured as c:
            return c.parser
    raise AssertionError(f"{module}.main did not parse arguments")


@functools.cache
def flag_env_names(module: str) -> frozenset[str]:
    names = set()
    for action in parser_of(module)._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                names.add("PDMESH_" + opt[2:].replace("-", "_").upper())
    return frozenset(names)


def known_env_names(module: str) -> frozenset[str]:
    """Variables the deploy files may set for `module`: its flags."""
    return flag_env_names(module)


def ready_name(module: str) -> str:
    """The grpc.health.v1 readiness name a gRPC service sets (its SERVICE_NAME)."""
    return importlib.import_module(module).SERVICE_NAME


def accepts(module: str, args: list[str]) -> bool:
    """Whether `module`'s parser knows every flag in `args` (nothing is started)."""
    try:
        _, extra = parser_of(module).parse_known_args(args)
    except SystemExit:
        return False
    return not extra
