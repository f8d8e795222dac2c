"""Settings of a decode worker beyond the shared worker, engine and server ones."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting


@dataclass(frozen=True)
class DecodeConfig:
    prefill_workers: tuple[str, ...] = setting(
        (), "static prefill workers (host:port, comma-separated) for requests that name no candidates"
    )
    prefill_timeout_s: float = setting(30.0, "longest a remote prefill (call + KV pull) may take")
    kv_lease_ms: int = setting(30_000, "lease the prefill worker holds the KV for us")
    max_request_s: float = setting(
        3600.0, "longest a Generate call may run: its deadline when the client set none, and a cap on one"
    )

    def __post_init__(self) -> None:
        require(self.prefill_timeout_s > 0, "prefill_timeout_s must be > 0")
        require(self.kv_lease_ms >= 100, "kv_lease_ms must be >= 100")
        require(self.max_request_s > 0, "max_request_s must be > 0")
