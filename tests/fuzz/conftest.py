"""One in-process mesh for every fuzz test (see inproc.py), and the fuzzers' budget.

`make test` runs a bounded number of examples per RPC. For a longer run pass
`--hypothesis-profile=long` (registered in tests/conftest.py) or set PDMESH_FUZZ_EXAMPLES=N:

    .venv/bin/pytest tests/fuzz --hypothesis-profile=long
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.fuzz.inproc import InProcessMesh


def examples(short: int) -> int:
    """Examples per test: `short` in `make test`, more under the long profile or the env knob."""
    if env := os.environ.get("PDMESH_FUZZ_EXAMPLES"):
        return int(env)
    if settings.get_current_profile_name() == "long":
        return settings.default.max_examples
    return short


def fuzz_settings(short: int) -> settings:
    return settings(
        max_examples=examples(short),
        deadline=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


@pytest.fixture(scope="session")
def mesh():
    m = InProcessMesh()
    yield m
    m.close()
