"""One request's journey across attempts: retries, migrations and their cost.

Owns the bookkeeping of a single client request inside the router: its prompt,
the output tokens already delivered to the client, and every attempt (worker,
tokens generated and computed, outcome). The servicer creates one
`RequestJourney` per request and drives it:

    plan = journey.next_attempt()               # what to send, which workers to avoid
    journey.start_attempt(worker_id, cached_tokens=overlap * block_size)
    journey.record_tokens(ids)                  # for every delta forwarded to the client
    journey.succeed(usage.computed_tokens)      # -> RequestCost for the CostLedger
    decision = journey.fail_attempt()           # worker failed: RETRY / MIGRATE / COMPLETE / GIVE_UP

A failure before the client saw any token is a *retry* (the same request again;
the caller also asks the retry budget). A failure after it is a *migration*:
the next worker gets prompt + delivered tokens as `resume_token_ids` and
continues at output position len(delivered), so the client sees one stream
with no duplicate or missing token. Both are capped per request.

Tokens computed by an attempt are what its worker reported (the final
`Usage.computed_tokens`) when it reported; otherwise an estimate:
(input tokens - tokens expected from the prefix cache) + tokens generated.
For an attempt that died before its first token the estimate assumes its
prefill ran, so it is an upper bound there.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.cost import RequestCost, RequestOutcome


class JourneyError(Exception):
    """The journey was driven out of order (a bug in the caller or a worker
    that sent more than max_tokens)."""


class AttemptKind(enum.Enum):
    FIRST = "first"
    RETRY = "retry"  # after a failure before the first delivered token
    MIGRATION = "migration"  # after a failure mid-stream: resumes from delivered tokens


class AttemptOutcome(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Recovery(enum.Enum):
    RETRY = "retry"  # start a retry (if the retry budget grants one)
    MIGRATE = "migrate"  # start a migration
    COMPLETE = "complete"  # every max_tokens token was delivered: finish with succeed()
    GIVE_UP = "give_up"  # finish with give_up()


@dataclass(frozen=True)
class RecoveryDecision:
    action: Recovery
    reason: str


@dataclass(frozen=True)
class JourneyConfig:
    max_retries: int = setting(2, "retries of a request that failed before its first token")
    max_migrations: int = setting(3, "times a request may move to another worker mid-stream")

    def __post_init__(self) -> None:
        require(self.max_retries >= 0, "max_retries must be >= 0")
        require(self.max_migrations >= 0, "max_migrations must be >= 0")


@dataclass
class Attempt:
    index: int
    kind: AttemptKind
    worker_id: str
    resume_tokens: int  # output tokens delivered before this attempt started
    input_tokens: int  # prompt + resume tokens the worker had to have KV for
    cached_tokens: int  # input tokens expected from the worker's prefix cache
    generated_tokens: int = 0  # new output tokens this attempt delivered
    outcome: AttemptOutcome = AttemptOutcome.RUNNING
    computed_tokens: int = 0  # set when the attempt ends

    def estimate_computed(self) -> int:
        return max(self.input_tokens - self.cached_tokens, 0) + self.generated_tokens


@dataclass(frozen=True)
class AttemptPlan:
    """What the next attempt sends (DecodeServiceGenerateRequest fields)."""

    kind: AttemptKind
    index: int
    prompt_token_ids: tuple[int, ...]
    resume_token_ids: tuple[int, ...]
    max_tokens: int  # the original budget: the proto's max_tokens counts resume tokens
    max_tokens_remaining: int  # what is left to generate
    exclude_workers: frozenset[str]  # workers whose attempt failed


class RequestJourney:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        config: JourneyConfig | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.config = config or JourneyConfig()
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.max_tokens = max_tokens
        self._delivered: list[int] = []
        self._attempts: list[Attempt] = []
        self._outcome: RequestOutcome | None = None

    # ---- views --------------------------------------------------------------

    @property
    def delivered_token_ids(self) -> tuple[int, ...]:
        return tuple(self._delivered)

    @property
    def attempts(self) -> tuple[Attempt, ...]:
        return tuple(self._attempts)

    @property
    def current(self) -> Attempt | None:
        """The running attempt, if any."""
        if self._attempts and self._attempts[-1].outcome is AttemptOutcome.RUNNING:
            return self._attempts[-1]
        return None

    @property
    def retries(self) -> int:
        return sum(a.kind is AttemptKind.RETRY for a in self._attempts)

    @property
    def migrations(self) -> int:
        return sum(a.kind is AttemptKind.MIGRATION for a in self._attempts)

    @property
    def done(self) -> bool:
        return self._outcome is not None

    @property
    def computed_tokens(self) -> int:
        """Tokens computed by every attempt so far (the running one estimated)."""
        return sum(a.estimate_computed() if a is self.current else a.computed_tokens for a in self._attempts)

    # ---- driving ------------------------------------------------------------

    def next_attempt(self) -> AttemptPlan:
        """What the next attempt should send."""
        self._require_idle()
        if not self._attempts:
            kind = AttemptKind.FIRST
        else:
            kind = AttemptKind.MIGRATION if self._delivered else AttemptKind.RETRY
        failed = frozenset(a.worker_id for a in self._attempts if a.outcome is AttemptOutcome.FAILED)
        return AttemptPlan(
            kind=kind,
            index=len(self._attempts),
            prompt_token_ids=self.prompt_token_ids,
            resume_token_ids=tuple(self._delivered),
            max_tokens=self.max_tokens,
            max_tokens_remaining=self.max_tokens - len(self._delivered),
            exclude_workers=failed,
        )

    def start_attempt(self, worker_id: str, cached_tokens: int = 0) -> Attempt:
        """The next attempt was sent to `worker_id`. `cached_tokens`: input tokens
        the router expects that worker to have cached (for the cost estimate)."""
        plan = self.next_attempt()
        if plan.kind is AttemptKind.RETRY and self.retries >= self.config.max_retries:
            raise JourneyError(f"retry limit {self.config.max_retries} reached")
        if plan.kind is AttemptKind.MIGRATION and self.migrations >= self.config.max_migrations:
            raise JourneyError(f"migration limit {self.config.max_migrations} reached")
        input_tokens = len(self.prompt_token_ids) + len(self._delivered)
        attempt = Attempt(
            index=plan.index,
            kind=plan.kind,
            worker_id=worker_id,
            resume_tokens=len(self._delivered),
            input_tokens=input_tokens,
            cached_tokens=min(max(cached_tokens, 0), input_tokens),
        )
        self._attempts.append(attempt)
        return attempt

    def record_tokens(self, token_ids: Iterable[int]) -> None:
        """Tokens of the running attempt, forwarded to the client."""
        attempt = self._require_running()
        ids = list(token_ids)
        if len(self._delivered) + len(ids) > self.max_tokens:
            raise JourneyError(
                f"worker {attempt.worker_id} sent {len(self._delivered) + len(ids)} tokens, "
                f"over max_tokens {self.max_tokens}"
            )
        self._delivered.extend(ids)
        attempt.generated_tokens += len(ids)

    def succeed(self, computed_tokens: int | None = None) -> RequestCost:
        """The running attempt finished the request; `computed_tokens` as its
        worker reported them (None: estimate)."""
        self._end_attempt(AttemptOutcome.SUCCEEDED, computed_tokens)
        return self._finish(RequestOutcome.SUCCEEDED)

    def cancel(self, computed_tokens: int | None = None) -> RequestCost:
        """The client cancelled (or its deadline passed); ends the running attempt if any."""
        if self.current is not None:
            self._end_attempt(AttemptOutcome.CANCELLED, computed_tokens)
        return self._finish(RequestOutcome.CANCELLED)

    def fail_attempt(self, retryable: bool = True, computed_tokens: int | None = None) -> RecoveryDecision:
        """The running attempt failed on its worker. What next?"""
        self._end_attempt(AttemptOutcome.FAILED, computed_tokens)
        if not retryable:
            return RecoveryDecision(Recovery.GIVE_UP, "error is not retryable")
        if not self._delivered:
            if self.retries >= self.config.max_retries:
                return RecoveryDecision(Recovery.GIVE_UP, f"retry limit {self.config.max_retries} reached")
            return RecoveryDecision(Recovery.RETRY, "failed before the first token")
        if len(self._delivered) >= self.max_tokens:
            return RecoveryDecision(Recovery.COMPLETE, "every token was delivered before the failure")
        if self.migrations >= self.config.max_migrations:
            return RecoveryDecision(Recovery.GIVE_UP, f"migration limit {self.config.max_migrations} reached")
        return RecoveryDecision(Recovery.MIGRATE, f"failed after {len(self._delivered)} tokens")

    def complete(self) -> RequestCost:
        """Finish as a success after Recovery.COMPLETE (no attempt running)."""
        self._require_idle()
        return self._finish(RequestOutcome.SUCCEEDED)

    def give_up(self) -> RequestCost:
        """Finish as failed (after GIVE_UP, a denied retry budget or no eligible worker)."""
        if self.current is not None:
            self._end_attempt(AttemptOutcome.FAILED, None)
        return self._finish(RequestOutcome.FAILED)

    # ---- internals ----------------------------------------------------------

    def _require_idle(self) -> None:
        if self._outcome is not None:
            raise JourneyError(f"request {self.request_id} already finished ({self._outcome.value})")
        if self.current is not None:
            raise JourneyError(f"request {self.request_id} has an attempt running")

    def _require_running(self) -> Attempt:
        attempt = self.current
        if attempt is None or self._outcome is not None:
            raise JourneyError(f"request {self.request_id} has no attempt running")
        return attempt

    def _end_attempt(self, outcome: AttemptOutcome, computed_tokens: int | None) -> None:
        attempt = self._require_running()
        if computed_tokens is not None and computed_tokens < 0:
            raise ValueError(f"computed_tokens must be >= 0, got {computed_tokens}")
        attempt.computed_tokens = attempt.estimate_computed() if computed_tokens is None else computed_tokens
        attempt.outcome = outcome

    def _finish(self, outcome: RequestOutcome) -> RequestCost:
        if self._outcome is not None:
            raise JourneyError(f"request {self.request_id} already finished ({self._outcome.value})")
        self._outcome = outcome
        computed = sum(a.computed_tokens for a in self._attempts)
        if outcome is RequestOutcome.SUCCEEDED:
            # The last attempt finished the request (it succeeded, or delivered every
            # token before dying); the work of earlier ones was thrown away.
            wasted = computed - (self._attempts[-1].computed_tokens if self._attempts else 0)
        else:
            wasted = computed
        return RequestCost(
            outcome=outcome,
            computed_tokens=computed,
            wasted_tokens=wasted,
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=len(self._delivered),
            retries=self.retries,
            migrations=self.migrations,
        )
