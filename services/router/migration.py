"""One request's journey across attempts: retries, migrations and their cost.

Owns the bookkeeping of a single client request inside the router: its prompt,
the output tokens already delivered to the client, and every attempt (worker,
tokens generated and computed, outcome). The servicer creates one
`RequestJourney` per request and drives it:

    plan = journey.next_attempt()               # what to send, which workers to avoid
    journey.start_attempt(worker_id, cached_tokens=overlap * block_size)
    journey.record_tokens(ids)                  # for every delta forwarded to the client
    journey.succeed(usage.computed_tokens)      # -> RequestCost for the CostLedger
    decision = journey.fail_attempt(err.retryable, another_worker=..., retry_budget=...)
                                                # worker failed: RETRY / MIGRATE / COMPLETE / GIVE_UP

A failure before the client saw any token is a *retry* (the same request again,
if the router's retry budget grants one). A failure after it is a *migration*:
the next worker gets prompt + delivered tokens as `resume_token_ids` and
continues at output position len(delivered), so the client sees one stream
with no duplicate or missing token. Both are capped per request.

What to do after a failure is decided in one place, `decide_recovery`, a pure
function of `RecoveryInputs`: the error, the journey's counts and limits, and
the two facts only the caller knows (is there another decode worker, would the
retry budget grant a retry). The caller applies the decision: it spends the
budget on RETRY and counts a denial on `Cause.RETRY_BUDGET`.

Tokens computed by an attempt are what its worker reported (the final
`Usage.computed_tokens`) when it reported; otherwise an estimate:
(input tokens - tokens expected from the prefix cache) + tokens generated.
For an attempt that died before its first token the estimate assumes its
prefill ran, so it is an upper bound there.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.cost import RequestCost, RequestOutcome
from services.router.workflow_sched import WorkflowSchedConfig, sunk_cost_extra


class JourneyError(Exception):
    """The journey was driven out of order (a bug in the caller or a worker
    that sent more than max_tokens)."""


class AttemptKind(enum.Enum):
    FIRST = "first"
    RETRY = "retry"  # after a failure before the first delivered token
    MIGRATION = "migration"  # after a failure mid-stream: resumes from delivered tokens
    HEDGE = "hedge"  # a copy that started first and replaced the running attempt (hedge.py)


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


class Cause(enum.Enum):
    """Why a RecoveryDecision went the way it did (`reason` is its text for people)."""

    BEFORE_FIRST_TOKEN = "before_first_token"  # RETRY
    MID_STREAM = "mid_stream"  # MIGRATE
    ALL_DELIVERED = "all_delivered"  # COMPLETE
    NOT_RETRYABLE = "not_retryable"  # GIVE_UP from here on
    RETRY_LIMIT = "retry_limit"
    MIGRATION_LIMIT = "migration_limit"
    NO_OTHER_WORKER = "no_other_worker"
    RETRY_BUDGET = "retry_budget"


@dataclass(frozen=True)
class RecoveryDecision:
    action: Recovery
    reason: str
    cause: Cause


@dataclass(frozen=True, kw_only=True)
class RecoveryInputs:
    """Everything the retry / migrate / give-up decision depends on."""

    retryable: bool  # the error allows another attempt (AttemptError.retryable)
    delivered: int  # output tokens the client already has
    max_tokens: int
    retries: int  # retries this request has had
    max_retries: int
    migrations: int  # migrations this request has had
    max_migrations: int
    another_worker: bool = True  # an eligible decode worker this request has not tried
    retry_budget: bool = True  # the router's retry budget would grant a retry now
    # Tokens the request's workflow already spent on earlier steps (WorkflowContext):
    # they are lost with it, so they earn up to `max_sunk_extra` more retries and
    # migrations (workflow_sched.sunk_cost_extra; bounded).
    sunk_tokens: int = 0
    sunk_unit_tokens: int = 4_000
    max_sunk_extra: int = 2


def decide_recovery(f: RecoveryInputs) -> RecoveryDecision:
    """Retry, migrate, complete or give up after a failed attempt. Pure."""
    extra = sunk_cost_extra(
        f.sunk_tokens,
        WorkflowSchedConfig(sunk_unit_tokens=f.sunk_unit_tokens, max_sunk_extra=f.max_sunk_extra),
    )
    max_retries, max_migrations = f.max_retries + extra, f.max_migrations + extra
    if not f.retryable:
        return RecoveryDecision(Recovery.GIVE_UP, "error is not retryable", Cause.NOT_RETRYABLE)
    if f.delivered == 0:
        if f.retries >= max_retries:
            return RecoveryDecision(Recovery.GIVE_UP, f"retry limit {max_retries} reached", Cause.RETRY_LIMIT)
        if not f.another_worker:
            return RecoveryDecision(Recovery.GIVE_UP, "no other decode worker to try", Cause.NO_OTHER_WORKER)
        if not f.retry_budget:
            return RecoveryDecision(Recovery.GIVE_UP, "retry budget spent", Cause.RETRY_BUDGET)
        return RecoveryDecision(Recovery.RETRY, "failed before the first token", Cause.BEFORE_FIRST_TOKEN)
    if f.delivered >= f.max_tokens:
        return RecoveryDecision(
            Recovery.COMPLETE, "every token was delivered before the failure", Cause.ALL_DELIVERED
        )
    if f.migrations >= max_migrations:
        return RecoveryDecision(
            Recovery.GIVE_UP, f"migration limit {max_migrations} reached", Cause.MIGRATION_LIMIT
        )
    if not f.another_worker:
        return RecoveryDecision(Recovery.GIVE_UP, "no other decode worker to try", Cause.NO_OTHER_WORKER)
    return RecoveryDecision(Recovery.MIGRATE, f"failed after {f.delivered} tokens", Cause.MID_STREAM)


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
        sunk_tokens: int = 0,
    ):
        """`sunk_tokens`: what the request's workflow already spent on earlier
        steps (WorkflowContext.tokens_spent); it raises the retry and migration
        limits a little (decide_recovery)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.config = config or JourneyConfig()
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.max_tokens = max_tokens
        self.sunk_tokens = max(sunk_tokens, 0)
        extra = sunk_cost_extra(self.sunk_tokens, WorkflowSchedConfig())
        self._max_retries = self.config.max_retries + extra
        self._max_migrations = self.config.max_migrations + extra
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
        if plan.kind is AttemptKind.RETRY and self.retries >= self._max_retries:
            raise JourneyError(f"retry limit {self._max_retries} reached")
        if plan.kind is AttemptKind.MIGRATION and self.migrations >= self._max_migrations:
            raise JourneyError(f"migration limit {self._max_migrations} reached")
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

    def waste_by_cause(self) -> dict[str, int]:
        """The finished request's wasted tokens by why they were thrown away (they add up to
        its RequestCost.wasted_tokens): an attempt replaced by a retry ("retried"), a
        migration ("migrated") or a hedge that started first ("hedged"); every attempt of
        a request that failed ("failed") or was cancelled ("cancelled")."""
        if self._outcome is None:
            raise JourneyError(f"request {self.request_id} has not finished")
        out: dict[str, int] = {}
        attempts = self._attempts
        if self._outcome is not RequestOutcome.SUCCEEDED:
            cause = "failed" if self._outcome is RequestOutcome.FAILED else "cancelled"
            total = sum(a.computed_tokens for a in attempts)
            return {cause: total} if total else {}
        for a, nxt in itertools.pairwise(attempts):
            if a.computed_tokens:
                cause = {AttemptKind.MIGRATION: "migrated", AttemptKind.HEDGE: "hedged"}.get(
                    nxt.kind, "retried"
                )
                out[cause] = out.get(cause, 0) + a.computed_tokens
        return out

    def hedge_won(self, worker_id: str, cached_tokens: int = 0, loser_computed: int | None = None) -> Attempt:
        """A hedge on `worker_id` started before the running attempt, which is cancelled
        (its work is wasted: `loser_computed` tokens, None = estimated) and replaced: the
        hedge is the running attempt now. It counts against neither the retry nor the
        migration limit (the retry budget paid for it)."""
        old = self._require_running()
        self._end_attempt(AttemptOutcome.CANCELLED, loser_computed)
        input_tokens = old.input_tokens
        attempt = Attempt(
            index=len(self._attempts),
            kind=AttemptKind.HEDGE,
            worker_id=worker_id,
            resume_tokens=old.resume_tokens,
            input_tokens=input_tokens,
            cached_tokens=min(max(cached_tokens, 0), input_tokens),
        )
        self._attempts.append(attempt)
        return attempt

    def record_tokens(self, token_ids: Iterable[int]) -> None:
        """Tokens of the running attempt, forwarded to the client."""
        # Once per streamed token: the running attempt's check inlined (`_require_running`).
        attempts = self._attempts
        attempt = attempts[-1] if attempts else None
        if attempt is None or attempt.outcome is not AttemptOutcome.RUNNING or self._outcome is not None:
            raise JourneyError(f"request {self.request_id} has no attempt running")
        ids = token_ids if type(token_ids) is list else list(token_ids)
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

    def fail_attempt(
        self,
        retryable: bool = True,
        computed_tokens: int | None = None,
        *,
        another_worker: bool = True,
        retry_budget: bool = True,
    ) -> RecoveryDecision:
        """The running attempt failed on its worker. What next? (`decide_recovery`;
        `another_worker` and `retry_budget` as in RecoveryInputs.)"""
        self._end_attempt(AttemptOutcome.FAILED, computed_tokens)
        return decide_recovery(
            RecoveryInputs(
                retryable=retryable,
                delivered=len(self._delivered),
                max_tokens=self.max_tokens,
                retries=self.retries,
                max_retries=self.config.max_retries,
                migrations=self.migrations,
                max_migrations=self.config.max_migrations,
                another_worker=another_worker,
                retry_budget=retry_budget,
                sunk_tokens=self.sunk_tokens,
            )
        )

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
