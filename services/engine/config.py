"""EngineConfig: everything an engine is built from, validated once.

Made once by a worker's `main()` from flags and environment (fields carry help
text for `services.common.config.add_arguments` / `build`, e.g. with prefix
"engine_") and passed to `services.engine.factory.create_engine`. Nothing
below reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import setting
from services.model.model_config import PRESETS

BACKENDS = ("torch", "sim", "trtllm")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_SCHEMES = ("fp", "int8", "int4")  # services/engine/quantize.py
KV_SCHEMES = ("none", "int8", "fp8")  # kvtransfer/layout.py KV_QUANT


@dataclass(frozen=True)
class EngineConfig:
    backend: str = setting("torch", f"engine backend, one of {BACKENDS}")
    model_path: str | None = setting(
        None,
        "Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or a Llama .gguf file; "
        "unset = built-in preset",
    )
    preset: str = setting("tiny", f"built-in model when no model_path, one of {tuple(PRESETS)}")
    model_id: str | None = setting(None, "model id to report; default: preset or folder name")
    dtype: str = setting("float32", f"weights and KV dtype, one of {DTYPES}")
    device: str = setting("cpu", "torch device: cpu or cuda[:n]")
    block_size: int = setting(16, "tokens per KV block (must match the router's)")
    num_blocks: int | None = setting(
        None,
        "KV pool size in blocks; unset = what kv_cache_bytes allows, capped at max_num_seqs full contexts",
    )
    kv_cache_bytes: int = setting(256 * 2**20, "KV pool memory budget when num_blocks is unset")
    max_num_seqs: int = setting(64, "most sequences in the running batch")
    max_num_batched_tokens: int = setting(
        1024, "token budget of one step (decodes + prompt chunks); longer prompts are chunked"
    )
    queue_late_after_s: float = setting(
        0.0,
        "a request waiting this long without starting yields the next free slot to one that can "
        "still start in time (the deployment's TTFT target; goodput under overload); 0 = first come, "
        "first served",
    )
    queue_late_max_s: float = setting(
        0.0,
        "with queue_late_after_s: a late request that has waited this long is overdue and takes its "
        "first-come place again (bounds how long on-time requests may pass it); 0 = no bound",
    )
    max_model_len: int | None = setting(None, "context limit (prompt + output); unset = the model's")
    num_threads: int = setting(0, "torch intra-op threads of the step loop; 0 = torch's default")
    adapt_threads: bool = setting(
        True,
        "each class of step size (<= 8, 9-64, 65-512, more tokens) runs on 1 thread or all, whichever "
        "measures faster (thread_tuner.py: on a shared CPU each OpenMP region waits for a descheduled "
        "thread, SmolLM2 int4 batch 1 on 2 vCPUs beside one busy process: 547 ms a step on 2 threads, "
        "42 ms on 1); only where a step's result does not depend on its thread count, which the engine "
        "checks at start on this CPU (it did on bf16 with AMX): otherwise off, so tokens never depend "
        "on timing",
    )
    weights: str = setting(
        "fp",
        f"linear weights, one of {WEIGHT_SCHEMES}: fp = dtype; int8 / int4 = weight-only quantized (CPU)",
    )
    kv_cache_quant: str = setting(
        "none",
        f"KV pool scheme, one of {KV_SCHEMES}: int8 / fp8 (e4m3) = 1-byte K/V with per-block, per-head scales",
    )
    pack_weights: bool = setting(True, "prepack linear weights with oneDNN on CPU (faster small batches)")
    seed: int = setting(0, "seed of the built-in model's random weights")
    enable_prefix_caching: bool = setting(True, "reuse KV of cached prompt prefixes")
    kv_event_buffer: int = setting(4096, "KV events kept for subscribers that fall behind")
    workflow_pin_ttl_s: float = setting(
        0.0, "keep a workflow step's cached blocks for its next step this long (0 = off)"
    )
    host_tier_bytes: int = setting(
        0,
        "host KV tier behind the pool, in bytes (0 = off): evicted cached blocks are kept there and "
        "restored on a prefix hit when that beats recomputing; the sim backend counts its profile's bytes",
    )
    host_tier_quant: str = setting(
        "none",
        "host tier storage for a full-precision pool (torch backend): none, or int8 / fp8 = 1-byte "
        "K/V with per-block, per-head scales, quantized on offload and dequantized on restore",
    )
    sim_profile: str = setting("dynamo-mocker", "sim backend: timing profile in services/model/profiles.json")
    sim_speedup: float = setting(1.0, "sim backend: wall time = modeled time / this factor")
    sim_slowdown_file: str | None = setting(
        None,
        "sim backend: a file holding a factor that multiplies every pass's wall time, reread at most "
        "every 0.1 s (missing or unreadable: 1): a degraded accelerator, for fault studies",
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.model_path is None and self.preset not in PRESETS:
            raise ValueError(f"EngineConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        for name, allowed in (
            ("weights", WEIGHT_SCHEMES),
            ("kv_cache_quant", KV_SCHEMES),
            ("host_tier_quant", KV_SCHEMES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"EngineConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.weights != "fp" and self.device != "cpu":
            raise ValueError("EngineConfig.weights int8/int4 uses torch's CPU kernels: device must be 'cpu'")
        positive = (
            "block_size",
            "kv_cache_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_event_buffer",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {value}")
        if not (self.workflow_pin_ttl_s >= 0 and math.isfinite(self.workflow_pin_ttl_s)):
            raise ValueError(f"EngineConfig.workflow_pin_ttl_s must be >= 0, got {self.workflow_pin_ttl_s}")
        if not (self.queue_late_after_s >= 0 and math.isfinite(self.queue_late_after_s)):
            raise ValueError(f"EngineConfig.queue_late_after_s must be >= 0, got {self.queue_late_after_s}")
        if not (self.queue_late_max_s >= 0 and math.isfinite(self.queue_late_max_s)):
            raise ValueError(f"EngineConfig.queue_late_max_s must be >= 0, got {self.queue_late_max_s}")
        if self.queue_late_max_s and not 0 < self.queue_late_after_s < self.queue_late_max_s:
            raise ValueError(
                "EngineConfig.queue_late_max_s bounds on-time-first admission: it needs "
                f"0 < queue_late_after_s < queue_late_max_s, got {self.queue_late_after_s} and "
                f"{self.queue_late_max_s}"
            )
        if self.host_tier_bytes < 0:
            raise ValueError(f"EngineConfig.host_tier_bytes must be >= 0, got {self.host_tier_bytes}")
        if self.num_threads < 0:
            raise ValueError(f"EngineConfig.num_threads must be >= 0, got {self.num_threads}")
        if not (self.sim_speedup > 0 and math.isfinite(self.sim_speedup)):
            raise ValueError(f"EngineConfig.sim_speedup must be a finite number > 0, got {self.sim_speedup}")
        if self.backend == "sim":  # only sim workers read the profile table
            from services.model.timing import load_profiles

            if self.sim_profile not in load_profiles():
                raise ValueError(
                    f"EngineConfig.sim_profile must be one of {sorted(load_profiles())}, "
                    f"got {self.sim_profile!r}"
                )

    @property
    def resolved_model_id(self) -> str:
        if self.model_id:
            return self.model_id
        if self.model_path is not None:
            return self.model_path.rstrip("/").rsplit("/", 1)[-1]
        return f"builtin-{self.preset}"
