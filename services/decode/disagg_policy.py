"""The conditional disaggregation rule, as a pure function of what the decode
worker knows when a request arrives.

Local prefill when the *uncached* prompt is short (at most
`max_local_prefill_tokens`), when no prefill candidate is healthy, or when the
best candidate's estimated wait exceeds the local estimate and this worker
would prefill the prompt quickly (in at most `max_busy_local_prefill_s` at its
measured prefill rate: a long local prefill stalls every running decode for its
whole length, which is what disaggregation exists to avoid; seconds, not
tokens, so one setting fits a CPU at 700 tokens/s and a GPU at 20,000);
otherwise remote.
Forced modes (tests, benchmarks, operators) override the length and wait tests
but never send a request to a candidate that does not exist. Every decision
carries a reason that the decode service counts
(`pdmesh_disagg_decisions_total{path,reason}`) and logs.

Dynamo's equivalent (`lib/kv-router/src/conditional_disagg.rs`) keeps a
request local when its effective (uncached) prompt is under 2,048 tokens;
TensorRT-LLM's disaggregated server has a similar threshold. That suits a GPU,
where 2,048 tokens prefill in tens of milliseconds. The default here is 128,
for the embedded CPU engine: a local prefill stalls every running decode for
its whole length (~1.5 ms a token for the `small` preset in fp32), and
bench/disagg.py measured conditional goodput on the long-prompt mix at 1.5
req/s with 128 against 0.5 req/s with 512 (BENCHMARKS.md). GPU deployments
(compose's `gpu` profile, the k8s `gpu` overlay) set 2,048.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import require, setting


class Path(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


class Mode(enum.Enum):
    AUTO = "auto"
    LOCAL = "local"
    REMOTE = "remote"


class Reason(enum.Enum):
    SHORT_PROMPT = "short_prompt"  # uncached tokens <= threshold
    LONG_PROMPT = "long_prompt"  # uncached tokens > threshold: remote
    NO_CANDIDATE = "no_candidate"  # no healthy prefill worker
    PREFILL_BUSY = "prefill_busy"  # best candidate would start later than local
    FORCED_LOCAL = "forced_local"
    FORCED_REMOTE = "forced_remote"
    FALLBACK = "fallback"  # the remote path failed; local once


@dataclass(frozen=True)
class DisaggConfig:
    max_local_prefill_tokens: int = setting(
        128, "prefill locally when the uncached prompt has at most this many tokens"
    )
    max_busy_local_prefill_s: float = setting(
        0.5,
        "when the prefill workers are busy, prefill locally only prompts this worker computes within this "
        "many seconds (at its measured prefill rate); longer ones wait for a prefill worker",
    )
    busy_margin_s: float = setting(
        0.0, "go local when a prefill worker's wait exceeds the local estimate by more than this"
    )
    default_mode: str = setting(
        "auto", "mode of requests that ask for none: auto (the rule), local or remote (benchmarks, operators)"
    )

    def __post_init__(self) -> None:
        require(
            self.default_mode in {m.value for m in Mode},
            f"default_mode must be auto, local or remote, got {self.default_mode!r}",
        )
        require(self.max_local_prefill_tokens >= 0, "max_local_prefill_tokens must be >= 0")
        require(self.busy_margin_s >= 0, "busy_margin_s must be >= 0")
        require(self.max_busy_local_prefill_s >= 0, "max_busy_local_prefill_s must be >= 0")


@dataclass(frozen=True)
class Candidate:
    """A prefill worker as ranked by the router (best first)."""

    worker_id: str
    address: str
    estimated_wait_s: float = 0.0
    healthy: bool = True


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: Reason
    candidate: Candidate | None = None

    @property
    def label(self) -> str:
        return f"{self.path.value}/{self.reason.value}"


class DisaggregationPolicy:
    def __init__(self, config: DisaggConfig):
        self.config = config

    def decide(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        candidates: Sequence[Candidate],
        local_wait_s: float,
        mode: Mode = Mode.AUTO,
        local_tokens_per_s: float = math.inf,
    ) -> Decision:
        """Where to prefill. `cached_tokens`: prompt tokens already in this
        worker's prefix cache; `local_wait_s`: estimated wait before a local
        prefill would start; `local_tokens_per_s`: this worker's prefill rate."""
        if mode is Mode.LOCAL:
            return Decision(Path.LOCAL, Reason.FORCED_LOCAL)
        uncached = max(prompt_tokens - cached_tokens, 0)
        if mode is Mode.AUTO and uncached <= self.config.max_local_prefill_tokens:
            return Decision(Path.LOCAL, Reason.SHORT_PROMPT)
        best = next((c for c in candidates if c.healthy), None)
        if best is None:
            return Decision(Path.LOCAL, Reason.NO_CANDIDATE)
        if mode is Mode.REMOTE:
            return Decision(Path.REMOTE, Reason.FORCED_REMOTE, best)
        busy = best.estimated_wait_s > local_wait_s + self.config.busy_margin_s
        if busy and uncached / local_tokens_per_s <= self.config.max_busy_local_prefill_s:
            return Decision(Path.LOCAL, Reason.PREFILL_BUSY)
        return Decision(Path.REMOTE, Reason.LONG_PROMPT, best)
