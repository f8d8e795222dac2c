"""The `Engine` protocol: what prefill and decode workers need from an engine.

Backends (torch, sim, trtllm) implement this and are chosen by name in
`services.engine.factory.create_engine`. Everything here is a boundary type: the
services never see an engine's sequences, block tables or scheduler.

Lifecycle of a request inside an engine (one owner of transitions: the engine):
    WAITING -> PREFILLING -> DECODING -> FINISHED / ABORTED          (generate)
    WAITING -> PREFILLING -> HELD -> released                        (prefill)
    WAITING_FOR_REMOTE_KV -> DECODING -> FINISHED / ABORTED          (external KV)
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import grpc

from kvtransfer.layout import KvLayout

# Re-exported: the engine boundary speaks them, the model layer owns them (one set of rules).
from services.model.sampling import FinishReason, SamplingParams

if TYPE_CHECKING:  # the router imports this module and must not load torch
    import torch


class EngineError(Exception):
    """Base of the engine's typed errors.

    A subclass that a client may cause names its gRPC status in `status_code`;
    `services.common.errors.status_of` reads it at the edge (common cannot
    import the engine). The others are INTERNAL there."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (bad field value, too long, ...).

    `field` names the offending request field, for INVALID_ARGUMENT messages.
    """

    status_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineCapacityError(EngineError):
    """Not enough KV blocks to admit the request now (RESOURCE_EXHAUSTED)."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnknownRequestError(EngineError, KeyError):
    """No request / held KV with that id (already released, finished or aborted)."""

    status_code = grpc.StatusCode.NOT_FOUND

    def status_message(self) -> str:
        # str() of a KeyError is the repr of its argument (quoted); the client gets the text
        return str(self.args[0] if self.args else self)


class InvalidHandoffError(EngineError):
    """An engine_state handed over by another worker is malformed or not this engine's."""


@dataclass(frozen=True)
class EngineRequest:
    """A tokenized request.

    `resume_token_ids` are output tokens an earlier attempt already produced
    (migration): the engine treats prompt + resume as context, samples the next
    token at output position len(resume_token_ids), counts them against
    max_tokens, and does not emit them again.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    resume_token_ids: Sequence[int] = ()
    priority: int = 0
    # Agent workflow this request is a step of (WorkflowContext.workflow_id; "" =
    # none): with EngineConfig.workflow_pin_ttl_s its cached blocks stay pinned
    # for the next step. `workflow_final`: the last step; its end releases the pin.
    workflow_id: str = ""
    workflow_final: bool = False
    # Seconds already spent waiting for a first token in earlier attempts elsewhere
    # (the router's retries after a first-token timeout, hedge copies): the scheduler's on-time-first admission
    # (EngineConfig.queue_late_after_s) counts the wait from then.
    waited_s: float = 0.0
    # Queued ahead of every waiting request of its priority but moved or preempted ones (the
    # router sets it for a stream moved off another worker: DecodeServiceGenerateRequest.front).
    front: bool = False
    # Called once when the engine first schedules the request's computation (its
    # prefill begins), on the thread the engine delivers outputs on (the event loop
    # for the async engines), before that pass runs: the router ties a hedged
    # request's copies by it. Not called for a request that never starts.
    on_started: Callable[[], None] | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request after one engine step (possibly none when finished).

    Treat as immutable. Not frozen: one is built per request per engine step, and a
    frozen dataclass's __init__ sets each field through object.__setattr__ (1.6 us
    against 0.6 us here, of the ~10 us the sim engine's step thread spends per token
    in bench/worker_core.py)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Set on the first output of a request:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Prompt tokens this engine computed for the request so far (prefill work).
    num_computed_prompt_tokens: int = 0


@dataclass(frozen=True)
class HeldKv:
    """KV blocks an engine holds for another worker after a prefill-only request."""

    block_ids: tuple[int, ...]
    num_tokens: int
    layout: KvLayout


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    finished: bool
    finish_reason: FinishReason | None
    cached_prefix_tokens: int
    computed_tokens: int
    # None when `finished` (nothing is held) or when the engine moves KV itself.
    held: HeldKv | None
    # Engine-specific handoff state when the engine moves KV itself (trtllm's
    # DisaggregatedParams fields). Keys are field names of the pdmesh.v1.EngineState
    # proto ("backend" included); None when `finished` or when blocks are `held`.
    engine_state: dict | None = None


@dataclass(frozen=True)
class ExternalKvReservation:
    """Blocks reserved for a request whose prompt KV arrives from outside.

    `block_ids[i]` receives block i of the prompt. The first
    `num_cached_tokens // block_size` blocks are already filled from this
    engine's own prefix cache and need no transfer: `transfer_block_ids` are the
    ones to write (with `first_transfer_block` the prompt block index of the first).
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    first_transfer_block: int

    @property
    def transfer_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.first_transfer_block :]


class KvEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class KvTier(enum.IntEnum):
    """Where a cached block lives: the engine's KV pool, or the host tier behind it
    (services/engine/host_tier.py). Values match the proto's KvTier."""

    DEVICE = 0
    HOST = 1


@dataclass(frozen=True)
class KvEvent:
    """A prefix-cache event; `seq` grows by 1 per event of one engine."""

    seq: int
    kind: KvEventKind
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None
    tier: KvTier = KvTier.DEVICE  # STORED / REMOVED: which tier gained / lost the blocks


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    held_blocks: int
    tokens_waiting: int
    active_decode_blocks: int
    prompt_tokens_computed: int
    decode_tokens_computed: int
    prompt_tokens_cached: int
    prompt_tokens_transferred: int
    preemptions: int
    # Admissions ahead of a late request at the head of the queue (EngineConfig.queue_late_after_s).
    admitted_ahead: int = 0
    # Admissions of an overdue request (EngineConfig.queue_late_max_s), and moved streams
    # (EngineRequest.front) queued ahead of at least one waiting request.
    admitted_overdue: int = 0
    moved_ahead: int = 0
    # Quantization (issue 22): the linears' scheme, their bytes as stored and the worst
    # relative round-trip error over them; the KV pool's scheme and bytes.
    weight_scheme: str = "fp"
    weight_bytes: int = 0
    weight_quant_error: float = 0.0
    kv_scheme: str = "none"
    kv_pool_bytes: int = 0
    # Workflow KV pins (BlockManager): blocks held now, lifetime pins released
    # under pressure and on their TTL.
    pinned_blocks: int = 0
    pins_evicted: int = 0
    pins_expired: int = 0
    # Host tier (issue 22; all 0 when off): capacity and use now, prompt tokens
    # restored from it instead of recomputed, restores taken and their time,
    # restores declined (predicted slower than recomputing), blocks the frequency
    # filter refused, blocks it evicted (LRU).
    host_capacity_blocks: int = 0
    host_blocks: int = 0
    host_bytes: int = 0
    prompt_tokens_restored: int = 0
    host_restores: int = 0
    host_restore_s: float = 0.0
    host_restores_declined: int = 0
    host_rejected: int = 0
    host_evicted: int = 0
    # What the host tier's restore-vs-recompute rule measured (0 = not yet):
    # seconds to restore one block, and to prefill one block's tokens.
    host_restore_s_per_block: float = 0.0
    prefill_s_per_block: float = 0.0


@dataclass(frozen=True)
class EngineCapabilities:
    # True when the engine moves KV itself (trtllm's cache transceiver): the
    # decode service then skips the kvtransfer pull and forwards engine_state.
    moves_kv_itself: bool = False
    # True when kv_pool() returns a tensor transports can register.
    exports_kv_pool: bool = True


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    model_id: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    layout: KvLayout | None
    eos_token_ids: tuple[int, ...]
    device: str
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities)


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """What a worker needs from an engine. All methods are called from one
    asyncio event loop; the engine runs its step loop on its own thread.

    Every call that takes a request validates it first and raises
    InvalidRequestError (nothing allocated) when it is bad.
    """

    info: EngineInfo
    tokenizer: Tokenizer

    async def start(self) -> None:
        """Load the model and start the step loop."""

    async def close(self) -> None:
        """Abort everything, stop the loop, free the pool."""

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Prefill locally (reusing cached prefix) and stream the output.

        Closing the iterator early (or cancelling the task consuming it) aborts
        the request and frees its blocks.
        """

    def divert(self, request_id: str, sink: Callable[[RequestOutput], None]) -> bool:
        """From now on hand the open stream's unfinished outputs to `sink`, called in
        the loop's delivery callback, instead of waking the stream's consumer for each;
        the finished output (or an error) still ends the stream through its iterator,
        and closing the iterator still aborts. False when the engine or the stream
        cannot (outputs not yet taken, no such stream): keep iterating. A sink that
        raises ends the stream with EngineError. The decode worker's per-token path
        (issue 16): one task wake-up per request per step less."""

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        """Prefill only: compute the prompt's KV, sample the first output token,
        and hold the blocks (state HELD) until `release(request_id)`. If the
        first token finishes the request, nothing is held. Cancelling the call
        frees everything."""

    def release(self, request_id: str) -> bool:
        """Free blocks held by a prefill-only request; False if unknown."""

    async def reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        """Reserve blocks for the request's prompt (+resume) KV, reusing this
        engine's own cached prefix; the request waits in WAITING_FOR_REMOTE_KV.
        Raises EngineCapacityError when the blocks are not free."""

    def generate_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        """The reserved blocks now hold the prompt's KV and `first_token_id` was
        sampled remotely: emit it, then decode the rest. Closing the iterator
        aborts and frees."""

    def cancel_external(self, request_id: str) -> None:
        """Free a reservation that will not be completed (transfer failed)."""

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; False if unknown."""

    def kv_pool(self) -> torch.Tensor | None:
        """The whole KV pool [num_blocks, *layout.block_shape] for transports to
        register once (None when the engine moves KV itself)."""

    def prefix_lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of `token_ids` whose KV is cached here (a multiple of block_size)."""

    def stats(self) -> EngineStats: ...

    def kv_events_since(self, seq: int) -> list[KvEvent]:
        """Buffered events with seq > `seq` (may start later than seq+1 when the
        buffer overflowed: the subscriber must then resync from a snapshot)."""

    def kv_snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        """(last event seq, [(parent_hash, block_hash) for every cached block])."""

    async def wait_kv_events(self, after_seq: int) -> None:
        """Return once an event with seq > after_seq exists."""


@runtime_checkable
class KvHandoffEngine(Engine, Protocol):
    """An Engine whose KV moves through the engine's own transfer machinery
    (`info.capabilities.moves_kv_itself`, e.g. TensorRT-LLM's cache transceiver).

    Its `prefill` returns `PrefillResult.engine_state` instead of `held` blocks, and
    the decode worker, instead of reserve_external / pull / generate_external, hands
    that state to `generate_from_state`. Engines that never report moves_kv_itself
    need not implement it.
    """

    def generate_from_state(self, request: EngineRequest, engine_state: dict) -> AsyncIterator[RequestOutput]:
        """Decode `request` (same prompt and resume tokens as the prefill) from KV that
        another worker's engine computed, described by its `engine_state`.

        Raises InvalidHandoffError (nothing started) when the state is malformed or of
        another backend. The engine fetches the KV itself; a failed or timed-out transfer
        surfaces as an EngineError from the iterator before any token. The first output
        carries the remotely sampled first token (and possibly more). Closing the
        iterator aborts the request and frees its KV.
        """


@runtime_checkable
class PrefixCacheEngine(Engine, Protocol):
    """An Engine whose cached prefix blocks other workers can pull, and that can
    take a prefix pulled from another worker into its own prefix cache (issue 17:
    prefixes pulled instead of recomputed). The torch and sim engines are.
    """

    async def hold_prefix(self, request: EngineRequest) -> HeldKv | None:
        """Hold the leading blocks of the prompt that are cached here (computing
        nothing) until `release(request.request_id)`; None when none is cached."""

    def generate_with_prefix(
        self, request: EngineRequest, prefix_request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`prefix_request_id` was reserved (`reserve_external`, whole blocks) and its
        blocks now hold the pulled prefix's KV: add them to the prefix cache, free that
        reservation, and generate `request` as `generate` does (the prefix a cache hit)."""
