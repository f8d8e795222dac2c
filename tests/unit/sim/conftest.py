"""Sim engine test helpers: LLMEngines with a SimRunner that records its waits instead of sleeping."""

from __future__ import annotations

from functools import partial

import pytest

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sim.runner import SimRunner
from services.engine.sim.spec import sim_spec
from services.model.timing import load_profile
from tests.unit.engine.conftest import assert_pool_restored, make_engine  # noqa: F401 (fixture)


def sim_config(**overrides) -> EngineConfig:
    values = {"backend": "sim", "num_blocks": 128, "max_num_batched_tokens": 256}
    values.update(overrides)
    return EngineConfig(**values)


class FakeClock:
    """A wall clock that moves only when the runner sleeps (recorded in `waits`) or a test advances it."""

    def __init__(self, waits: list[float]):
        self.now = 0.0
        self.waits = waits

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def sim_core(
    waits: list[float] | None = None,
    profile: str = "dynamo-mocker",
    clock: FakeClock | None = None,
    slowdown=None,
    **overrides,
) -> LLMEngine:
    """A synchronous sim LLMEngine on a fake clock; its runner appends each wall wait to `waits`."""
    config = sim_config(sim_profile=profile, **overrides)
    prof = load_profile(profile)
    spec = sim_spec(config, prof)
    prof = prof.scaled_to(spec.num_blocks, config.block_size)
    clock = clock or FakeClock(waits if waits is not None else [])
    factory = partial(
        SimRunner, profile=prof, speedup=config.sim_speedup, slowdown=slowdown, sleep=clock.sleep, clock=clock
    )
    return LLMEngine(config, spec, factory)


@pytest.fixture
def make_core():
    """Factory of sim LLMEngines; each must have its pool back when the test ends."""
    cores: list[LLMEngine] = []

    def make(**kw) -> LLMEngine:
        core = sim_core(**kw)
        cores.append(core)
        return core

    yield make
    for core in cores:
        assert_pool_restored(core)
