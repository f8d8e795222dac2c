"""The router's configuration: one frozen dataclass per concern, built once in `main()`.

`RouterConfig` holds the router's own settings (workers, model, policy,
timeouts, probe intervals); the cores keep their own configs
(`AdmissionConfig`, `BreakerConfig`, `RetryBudgetConfig`, `JourneyConfig`,
`OutlierConfig`, `HedgeConfig`, `RetryAttachConfig`,
`PrefixIndexConfig`, `RequestLimits`), the public listener is a `ServerConfig`
and the internal one (workers' membership, services/router/listeners.py) an
`InternalListenerConfig`, the OpenAI-compatible HTTP door an `HttpDoorConfig`, their
TLS (server and channels to workers) a `TlsConfig`, API keys an `AuthConfig`,
tracing a `TracingConfig`.
`RouterSettings` bundles them; `parse_settings(argv, env)` builds it from flags
(`--decode-workers`, `--admission-max-inflight`, `--breaker-cooldown-s`, ...)
and `PDMESH_*` environment variables. The model facts the router needs
(vocabulary, context length, tokenizer) come from `ModelSpec.load`, which reads
a preset or a Hugging Face folder's config and never imports torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import add_arguments, build, require, setting
from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.common.tracing import TracingConfig
from services.common.validation import RequestLimits
from services.model.model_config import PRESETS, ModelConfig
from services.model.tokenizer import ByteTokenizer, HfTokenizer
from services.router.admission import AdmissionConfig
from services.router.auth import AuthConfig
from services.router.circuit_breaker import BreakerConfig
from services.router.hedge import HedgeConfig
from services.router.migration import JourneyConfig
from services.router.outlier import OutlierConfig
from services.router.policy import POLICY_NAMES, PolicyConfig
from services.router.prefix_index import PrefixIndexConfig
from services.router.prefix_pull import PrefixPullConfig
from services.router.registry import RegistryConfig, parse_target
from services.router.retries import RetryAttachConfig
from services.router.retry_budget import RetryBudgetConfig
from services.router.worker_profile import WorkerProfileConfig
from services.router.workflow_affinity import WorkflowRoutingConfig


@dataclass(frozen=True)
class RouterConfig:
    decode_workers: tuple[str, ...] = setting(
        (), "static decode workers, host:port,... (a DNS name with several addresses = several workers)"
    )
    prefill_workers: tuple[str, ...] = setting((), "static prefill workers, host:port,...")
    model_path: str | None = setting(
        None, "Hugging Face model folder (config.json, tokenizer.json) or .gguf file"
    )
    preset: str = setting("tiny", f"built-in model when no model_path, one of {tuple(PRESETS)}")
    model_id: str | None = setting(None, "served model id; default builtin-<preset> or the folder name")
    block_size: int = setting(16, "KV block size every worker must use")
    max_model_len: int | None = setting(None, "context limit (prompt + output); unset = the model's")
    policy: str = setting("kv_aware", f"routing policy, one of {POLICY_NAMES}")
    prefill_weight: float = setting(1.0, "kv_aware: weight of a block to prefill against a decode block")
    temperature: float = setting(0.0, "kv_aware: 0 = lowest cost wins; > 0 samples softmax(-cost/T)")
    # 0.1, not Dynamo's 1: an active decode block costs a pass far less than a block to prefill
    # (services/router/policy.py; bench/routing_sim.py: 0.02 and 0.1 alike, 0.25 a little and 1 clearly
    # worse; the real-process runs here could not tell 0.1 from 1: BENCHMARKS.md, issue 17).
    decode_weight: float = setting(
        0.1, "kv_aware, least_loaded: weight of an active decode block against a block to prefill"
    )
    # 30, not 0: a new request on a worker with anything running waits out the pass in
    # progress and shares the next one (the mocker profile's 16.5 ms per prefill pass is ~68
    # blocks of prefill, a decode pass ~25), which a cost in blocks alone does not price; at the
    # Dynamo side by side's x4 load bench/routing_sim.py gave kv_aware p50 66 ms against 69
    # without it (round robin 68) and no change at 15-60 or at the routing study's settings.
    # Off by default after the session-6 merge: its one gain was p50 in one seed of three, and
    # 30 blocks on any worker with work outweighed a workflow's affinity credit (a home with a
    # short queue lost every next step to an idle worker: test_workflow_flow).
    busy_blocks: float = setting(
        0.0, "kv_aware: blocks added to the cost of a worker with a request running or queued"
    )
    # On since issue 17's second pass: with decode_weight 0.1 it is the best or tied variant at
    # 4-32 workers in bench/routing_sim.py (BENCHMARKS.md); with weight 1 it was not.
    load_view: bool = setting(
        True, "score on the router's own account of what it routed (blended with load reports)"
    )
    optimistic_prefix_ttl_s: float = setting(
        0.0,
        "a routed prompt's blocks count as cached on its worker until a KV event confirms them, "
        "for at most this long (0 = off: only KV events)",
    )
    tier_credit: bool = setting(
        True,
        "kv_aware: credit prefix blocks held in a worker's host KV tier by its measured restore vs "
        "prefill time (false: only blocks in its pool count)",
    )
    max_prefill_candidates: int = setting(4, "ranked prefill workers passed with each decode request")
    first_token_timeout_s: float = setting(
        120.0,
        "an attempt with no first message after this long is failed over (0 = only the deadline); "
        "the cap of the predicted-TTFT timeout below",
    )
    # Issue 18: a fixed 120 s let a request sit on a hung worker for most of its client's deadline.
    first_token_timeout_multiple: float = setting(
        10.0,
        "first-token timeout = this many times the worker's predicted TTFT (recent median), within "
        "[first_token_timeout_floor_s, first_token_timeout_s] (0 = always first_token_timeout_s)",
    )
    first_token_timeout_floor_s: float = setting(
        10.0, "shortest first-token timeout the predicted TTFT may give"
    )
    reroute_unstarted: bool = setting(
        True,
        "a request with no first token on a worker that goes unhealthy (not serving, breaker open, "
        "ejected) is moved to another worker at once",
    )
    stall_timeout_s: float = setting(
        10.0, "an attempt with no token for this long after its first is migrated (0 = off)"
    )
    decode_link: bool = setting(
        True,
        "reach decode workers over one multiplexed Link stream each (false: a Generate call per request)",
    )
    raw_link: bool = setting(
        True,
        "run the Link on a decode worker's raw link port when its WorkerInfo offers one (a plain"
        " stream: no awaited gRPC write per frame); false: Link over gRPC",
    )
    max_buffered_tokens: int = setting(
        4096,
        "tokens buffered for a client that is not reading before its request is cancelled (0 = no limit)",
    )
    max_waiting_per_worker: int = setting(
        256, "a decode worker with this many requests waiting is saturated (0 = no limit)"
    )
    max_inflight_per_worker: int = setting(
        0, "a decode worker with this many router requests running is saturated (0 = no limit)"
    )
    saturated_retry_after_s: float = setting(0.5, "retry-after hint when every decode worker is saturated")
    health_interval_s: float = setting(1.0, "grpc.health.v1 probe interval per worker")
    health_timeout_s: float = setting(1.0, "timeout of one health probe")
    health_failure_threshold: int = setting(
        2,
        "consecutive health probes without an answer (timed out, or an error) before a worker is marked "
        "not serving; a NOT_SERVING answer marks it at once, and a failed probe is followed by the next at once",
    )
    stats_interval_s: float = setting(1.0, "Stats poll interval per worker (load, static workers' info)")
    resubscribe_initial_s: float = setting(0.05, "first backoff before re-subscribing to KV events")
    resubscribe_max_s: float = setting(5.0, "longest backoff between KV-event or Stats retries")
    dns_refresh_s: float = setting(30.0, "re-resolve static worker names this often (0 = once)")
    housekeeping_interval_s: float = setting(0.5, "lease expiry check interval")
    default_lease_s: float = setting(10.0, "lease of a registered worker that asks for none")
    max_lease_s: float = setting(300.0, "longest lease granted to a registered worker")
    max_workers: int = setting(1024, "workers the registry holds")
    seed: int | None = setting(None, "seed of the policies' random tie-breaking (unset = random)")

    def __post_init__(self) -> None:
        for t in (*self.decode_workers, *self.prefill_workers):
            try:
                parse_target(t)
            except ValueError as e:
                raise ValueError(str(e)) from None
        require(self.model_path is not None or self.preset in PRESETS, f"unknown preset {self.preset!r}")
        require(self.block_size >= 1, "block_size must be >= 1")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        require(self.policy in POLICY_NAMES, f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        require(self.max_prefill_candidates >= 0, "max_prefill_candidates must be >= 0")
        require(self.optimistic_prefix_ttl_s >= 0, "optimistic_prefix_ttl_s must be >= 0")
        require(self.max_buffered_tokens >= 0, "max_buffered_tokens must be >= 0")
        require(self.first_token_timeout_multiple >= 0, "first_token_timeout_multiple must be >= 0")
        require(self.first_token_timeout_floor_s >= 0, "first_token_timeout_floor_s must be >= 0")
        for name in ("first_token_timeout_s", "stall_timeout_s", "dns_refresh_s", "saturated_retry_after_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "stats_interval_s",
            "resubscribe_initial_s",
            "housekeeping_interval_s",
        ):
            require(getattr(self, name) > 0, f"{name} must be > 0")
        require(self.health_failure_threshold >= 1, "health_failure_threshold must be >= 1")
        require(self.resubscribe_max_s >= self.resubscribe_initial_s, "resubscribe_max_s < initial")
        require(self.max_waiting_per_worker >= 0 and self.max_inflight_per_worker >= 0, "limits must be >= 0")

    @property
    def resolved_model_id(self) -> str:
        if self.model_id:
            return self.model_id
        if self.model_path is not None:
            return self.model_path.rstrip("/").rsplit("/", 1)[-1]
        return f"builtin-{self.preset}"

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(
            model_id=self.resolved_model_id,
            block_size=self.block_size,
            default_lease_s=self.default_lease_s,
            min_lease_s=min(1.0, self.default_lease_s),
            max_lease_s=max(self.max_lease_s, self.default_lease_s),
            max_workers=self.max_workers,
        )

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            self.block_size, self.prefill_weight, self.temperature, self.decode_weight, self.busy_blocks
        )


@dataclass(frozen=True)
class InternalListenerConfig:
    port: int = setting(
        0, "the internal gRPC port: worker membership, ListWorkers, Stats (0 = any free port)"
    )
    host: str = setting("", "address the internal port listens on ('' = the same as --host)")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"internal_port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class HttpDoorConfig:
    """The router's OpenAI-compatible HTTP door (services/router/http_door.py): the
    gateway's app served in the router process, on the router's event loop."""

    port: int = setting(-1, "OpenAI-compatible HTTP port (-1 = no HTTP door, 0 = any free port)")
    host: str = setting("", "address the HTTP port listens on ('' = the same as --host)")
    served_model_name: str = setting(
        "", "model id HTTP clients name (/v1/models); default the router's model id (--model-id)"
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, "largest HTTP request body accepted")
    request_timeout_s: float = setting(600.0, "deadline of one HTTP generation request")

    def __post_init__(self) -> None:
        require(-1 <= self.port <= 65535, f"http_port must be in [-1, 65535], got {self.port}")
        require(self.max_body_bytes >= 1024, "http_max_body_bytes must be >= 1024")
        require(self.request_timeout_s > 0, "http_request_timeout_s must be > 0")


@dataclass(frozen=True)
class ModelSpec:
    """What the router knows of the served model: no weights, just the tokenizer and limits."""

    model_id: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any  # ByteTokenizer | HfTokenizer (encode / decode)

    @classmethod
    def load(cls, config: RouterConfig) -> ModelSpec:
        if config.model_path is None:
            mc = ModelConfig.from_preset(config.preset)
            tokenizer: Any = ByteTokenizer()
        else:
            mc = ModelConfig.from_hf_folder(config.model_path)
            tokenizer = HfTokenizer(Path(config.model_path), mc.vocab_size, mc.eos_token_ids)
        return cls(
            config.resolved_model_id,
            mc.vocab_size,
            config.max_model_len or mc.max_position_embeddings,
            tokenizer,
        )


@dataclass(frozen=True)
class RouterSettings:
    server: ServerConfig = field(default_factory=ServerConfig)
    internal: InternalListenerConfig = field(default_factory=InternalListenerConfig)  # membership etc.
    http: HttpDoorConfig = field(default_factory=HttpDoorConfig)  # OpenAI-compatible HTTP
    router: RouterConfig = field(default_factory=RouterConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry_budget: RetryBudgetConfig = field(default_factory=RetryBudgetConfig)
    journey: JourneyConfig = field(default_factory=JourneyConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    speed: WorkerProfileConfig = field(default_factory=WorkerProfileConfig)  # heterogeneous workers
    hedge: HedgeConfig = field(default_factory=HedgeConfig)
    retry_attach: RetryAttachConfig = field(default_factory=RetryAttachConfig)  # retried arrivals
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    prefix_pull: PrefixPullConfig = field(default_factory=PrefixPullConfig)  # issue 17 item 3
    workflow: WorkflowRoutingConfig = field(default_factory=WorkflowRoutingConfig)  # issue 21
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)


# (field of RouterSettings, config class, flag prefix)
_SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("server", ServerConfig, ""),
    ("internal", InternalListenerConfig, "internal_"),
    ("http", HttpDoorConfig, "http_"),
    ("router", RouterConfig, ""),
    ("limits", RequestLimits, "limits_"),
    ("admission", AdmissionConfig, "admission_"),
    ("breaker", BreakerConfig, "breaker_"),
    ("retry_budget", RetryBudgetConfig, "retry_budget_"),
    ("journey", JourneyConfig, ""),
    ("outlier", OutlierConfig, "outlier_"),
    ("speed", WorkerProfileConfig, "speed_"),
    ("hedge", HedgeConfig, "hedge_"),
    ("retry_attach", RetryAttachConfig, "retry_attach_"),
    ("index", PrefixIndexConfig, "index_"),
    ("prefix_pull", PrefixPullConfig, "prefix_pull_"),
    ("workflow", WorkflowRoutingConfig, "workflow_"),
    ("tls", TlsConfig, "tls_"),
    ("auth", AuthConfig, ""),
    ("tracing", TracingConfig, ""),
)


def sections() -> tuple[tuple[type, str], ...]:
    """(config class, flag prefix) of every flag the router takes, in `--help` order."""
    return tuple((cls, prefix) for _, cls, prefix in _SECTIONS)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.router.main", description="pdmesh router: admission, routing, migration"
    )
    for _, cls, prefix in _SECTIONS:
        add_arguments(parser, cls, prefix)
    return parser


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """Flags win over `PDMESH_*` environment variables, which win over defaults."""
    args = make_parser().parse_args(argv)
    env = os.environ if env is None else env
    parts: dict[str, Any] = {name: build(cls, args, env, prefix) for name, cls, prefix in _SECTIONS}
    return RouterSettings(**parts)
