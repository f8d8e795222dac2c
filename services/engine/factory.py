"""create_engine: the one place that maps a backend name to an Engine class.

Adding a backend = one module under services/engine/ + one line here.
"""

from __future__ import annotations

from services.engine.api import Engine
from services.engine.config import EngineConfig


def create_engine(config: EngineConfig) -> Engine:
    """An unstarted engine for `config.backend` (call `await engine.start()`)."""
    if config.backend == "torch":
        from services.engine.async_engine import TorchEngine

        return TorchEngine(config)
    if config.backend == "sim":
        from services.engine.sim.engine import SimEngine

        return SimEngine(config)
    if config.backend == "trtllm":
        from services.engine.trtllm.engine import TrtllmEngine  # imports tensorrt_llm only in start()

        return TrtllmEngine(config)
    raise ValueError(f"unknown engine backend {config.backend!r}")
