"""The gateway's settings: one frozen dataclass, flags and `PDMESH_*` env from
`services.common.config` (so `--router-address` is also `PDMESH_ROUTER_ADDRESS`).

The model fields mirror the router's (`--model-path`, `--preset`): the gateway
names the served model the way the router does and reads the model folder's
chat template, but never loads weights or a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting
from services.model.model_config import PRESETS


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "HTTP port (0 = any free port; see --port-file)")
    port_file: str = setting("", "write the bound port as JSON to this file once serving")
    router_address: str = setting("127.0.0.1:50051", "host:port of the router the gateway forwards to")
    served_model_name: str = setting(
        "", "model id clients must name; default builtin-<preset> or the model folder's name"
    )
    model_path: str | None = setting(
        None, "Hugging Face model folder or .gguf file: its chat_template renders chat prompts"
    )
    preset: str = setting("tiny", f"built-in model when no model_path, one of {tuple(PRESETS)}")
    request_timeout_s: float = setting(600.0, "gRPC deadline of one request to the router")
    health_timeout_s: float = setting(1.0, "timeout of the router readiness check behind /health")
    max_body_bytes: int = setting(4 * 1024 * 1024, "largest request body accepted")
    drain_grace_s: float = setting(30.0, "seconds in-flight requests may take to finish on SIGTERM")
    log_level: str = setting("info", "debug, info, warning or error")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        require(":" in self.router_address, f"router_address must be host:port, got {self.router_address!r}")
        require(self.model_path is not None or self.preset in PRESETS, f"unknown preset {self.preset!r}")
        require(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        require(self.health_timeout_s > 0, "health_timeout_s must be > 0")
        require(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        require(self.drain_grace_s >= 0, "drain_grace_s must be >= 0")

    @property
    def model_id(self) -> str:
        """The id `/v1/models` lists and requests must name (the router's rule)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model_path is not None:
            return self.model_path.rstrip("/").rsplit("/", 1)[-1]
        return f"builtin-{self.preset}"
