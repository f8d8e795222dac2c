"""LLMEngine: the synchronous core of the torch engine.

Owns the Scheduler (and through it the BlockManager), the ModelRunner (model +
KV pool) and every live Sequence. `step()` = schedule -> run -> postprocess.
Not thread-safe: one thread drives it (the async engine's step thread, or a
test / benchmark directly). Methods marked thread-safe only read structures
that guard themselves (prefix cache map, event log).

Request paths (api.py has the lifecycle):
- generate: `add_request`, then `step()` until its output is finished;
- prefill-only: `add_request(prefill_only=True)`; after the first token the
  sequence is HELD with its blocks (`held_kv`) until `release`;
- external KV: `reserve_external` -> (KV written into the reserved blocks)
  -> `commit_external(first_token)` -> `step()` as for generate.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvtransfer.layout import KvLayout, LayoutMismatch
from services.engine.api import (
    EngineCapacityError,
    EngineRequest,
    EngineStats,
    ExternalKvReservation,
    FinishReason,
    HeldKv,
    InvalidRequestError,
    KvEvent,
    RequestOutput,
    UnknownRequestError,
)
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.engine.host_tier import HostTier, ModeledTierCost, TierCost
from services.engine.model_runner import ModelRunner, scratch_sequence
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.validation import check_token_ids, validate_request
from services.model.sampling import draw_seed
from services.model.tokenizer import IncrementalDetokenizer

# Builds what runs a step from the spec: ModelRunner (the default), or the sim
# engine's SimRunner (same run / kv_pool / import_blocks / export_blocks surface).
RunnerFactory = Callable[[EngineSpec], Any]


# Prompt-chunk sizes of the thread tuner's probe: a decode-sized batch, a short and a long chunk
# (the test's three prompts in one step are 141 tokens).
THREAD_PROBE_ROWS = (3, 48, 141)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        spec: EngineSpec | None = None,
        runner_factory: RunnerFactory | None = None,
    ):
        self.spec = spec or EngineSpec.resolve(config)
        self.config = config
        self.info = self.spec.info
        self.tokenizer = self.spec.tokenizer
        self.block_size = config.block_size
        self.runner = (runner_factory or ModelRunner)(self.spec)
        block_manager = BlockManager(
            self.spec.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_event_buffer,
            pin_ttl_s=config.workflow_pin_ttl_s,
        )
        if config.host_tier_bytes > 0 and config.enable_prefix_caching:
            self._attach_host_tier(block_manager, config)
        self.scheduler = Scheduler(
            block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            late_after_s=config.queue_late_after_s,
            late_max_s=config.queue_late_max_s,
        )
        # The Scheduler drives it (allocation, freeing, the prefix cache); this class
        # reads it (lookups, events, stats) and borrows scratch blocks in
        # prompt_logits, freed before that call returns.
        self.block_manager = block_manager
        # Held by the driving thread while it changes block accounting (schedule, the
        # step's postprocess, commands), not while the forward pass runs, so another
        # thread may take it for `hold_prefix` without waiting for a step to end.
        self.mutex = threading.RLock()
        self._seqs: dict[str, Sequence] = {}
        # Requests whose first scheduled pass is reported (EngineRequest.on_started):
        # each callback is handed to `started_sink` once, before that pass runs.
        self._watch_start: dict[str, Callable[[], None]] = {}
        self.started_sink: Callable[[list[Callable[[], None]]], None] = call_each
        self.prompt_tokens_computed = 0
        self.decode_tokens_computed = 0
        self.prompt_tokens_transferred = 0
        # False when the last step could neither compute nor preempt anything: only
        # an outside change (release, abort, cancel) can unblock the queue then.
        self.last_step_progressed = True
        report = getattr(self.runner, "quant_report", None)  # a SimRunner has none
        self._quant_stats = {
            "weight_scheme": config.weights,
            "weight_bytes": report.quant_bytes if report is not None else 0,
            "weight_quant_error": report.max_rel_error if report is not None else 0.0,
            "kv_scheme": self.spec.layout.quant,
            "kv_pool_bytes": self.spec.num_blocks * self.spec.layout.block_bytes,
        }
        # Why the thread tuner is off on this CPU, if the probe turned it off (None: on, or never on).
        self.thread_tuner_off: str | None = None
        if getattr(self.runner, "thread_tuner", None) is not None:
            self._probe_thread_invariance()

    def _attach_host_tier(self, block_manager: BlockManager, config: EngineConfig) -> None:
        """A host tier of config.host_tier_bytes in the pool's block layout. A runner
        that models time (sim) sizes it in its modeled model's bytes and prices
        restores from its profile; otherwise both are measured."""
        pool = self.runner.kv_pool
        profile = getattr(self.runner, "profile", None)
        if profile is not None:
            block_bytes = profile.kv_bytes_per_token * config.block_size
            cost = ModeledTierCost(
                config.block_size, profile.restore_s(config.block_size), profile.prefill_ms
            )
        else:
            block_bytes = self.spec.layout.block_bytes
            cost = TierCost(config.block_size)
        quant = config.host_tier_quant
        if quant != "none":
            if profile is not None or self.spec.layout.quant != "none":
                raise ValueError(
                    "EngineConfig.host_tier_quant needs the torch backend and a full-precision pool "
                    "(kv_cache_quant none: a quantized pool's blocks are stored as they are)"
                )
            block_bytes = dataclasses.replace(self.spec.layout, quant=quant).block_bytes
        capacity = config.host_tier_bytes // block_bytes
        if capacity <= 0:
            raise ValueError(
                f"EngineConfig.host_tier_bytes {config.host_tier_bytes} holds no block of {block_bytes} bytes"
            )
        tier = HostTier(capacity, tuple(pool.shape[1:]), pool.dtype, block_bytes, quant)
        write = getattr(self.runner, "restore_blocks", self.runner.import_blocks)
        block_manager.attach_host_tier(tier, cost, self.runner.export_blocks, write)

    # ---- requests -------------------------------------------------------

    def validate(self, request: EngineRequest) -> None:
        validate_request(request, self.info)
        if request.request_id in self._seqs:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")

    def add_request(self, request: EngineRequest, *, prefill_only: bool = False) -> None:
        """Queue a request (validated first; nothing is allocated when it is bad)."""
        self.validate(request)
        seq = self._new_sequence(request, prefill_only)
        self._seqs[seq.request_id] = seq
        if request.on_started is not None:
            self._watch_start[seq.request_id] = request.on_started
        self.scheduler.add(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        with self.mutex:
            out = self.scheduler.schedule()
        self.last_step_progressed = bool(out.scheduled or out.preempted)
        if not out.scheduled:
            return []
        if self._watch_start:
            self._report_started(out.scheduled)
        prompt_before = self.prompt_tokens_computed
        t0 = time.perf_counter()
        sampled = self.runner.run(out.scheduled)
        elapsed = time.perf_counter() - t0
        outputs = []
        with self.mutex:
            for (seq, n), token in zip(out.scheduled, sampled, strict=True):
                self._account(seq, n)
                self.scheduler.computed(seq, n)
                if token is not None:
                    outputs.append(self._append(seq, token))
        cost = self.block_manager.tier_cost
        if cost is not None and self.prompt_tokens_computed > prompt_before:
            # The whole pass over its prompt tokens: decodes in it make this an
            # overestimate of recompute time, which only errs towards restoring.
            cost.observe_prefill(self.prompt_tokens_computed - prompt_before, elapsed)
        return outputs

    def _report_started(self, scheduled) -> None:
        """Hand the start callbacks of the watched requests in this pass to `started_sink`
        (before the pass runs: a tied copy elsewhere can be cancelled while still queued)."""
        watch = self._watch_start
        started = [cb for seq, _ in scheduled if (cb := watch.pop(seq.request_id, None)) is not None]
        if started:
            self.started_sink(started)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state and free its blocks; False if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.ABORTED, FinishReason.ABORT)
        return True

    def abort_all(self) -> list[str]:
        """Abort every request (shutdown); the ids that were live."""
        ids = list(self._seqs)
        for rid in ids:
            self.abort(rid)
        return ids

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[int]]:
        """Run `requests` (and anything already queued) to completion; output ids per request."""
        for r in requests:
            self.add_request(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        while self.has_unfinished_requests():
            for o in self.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if not self.last_step_progressed:
                raise EngineCapacityError("no request can be scheduled: KV blocks are held")
        return tokens

    # ---- prefill-only (HELD) ---------------------------------------------

    def held_kv(self, request_id: str) -> HeldKv | None:
        seq = self.scheduler.held.get(request_id)
        if seq is None:
            return None
        return HeldKv(tuple(seq.block_table), seq.num_computed_tokens, self.spec.layout)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a HELD request; False if none is held under that id."""
        seq = self.scheduler.held.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED, seq.finish_reason)
        return True

    # ---- cached prefixes served to / pulled from other workers (issue 17) -----

    def hold_prefix(self, request: EngineRequest) -> HeldKv | None:
        """Hold the leading blocks of `request`'s prompt that are cached here, as a
        HELD request (freed by `release`), computing nothing; None when none is cached.
        Thread-safe (takes `mutex`): a holder busy with a long step answers without
        waiting for it, since cached full blocks are never written by the step."""
        with self.mutex:
            return self._hold_prefix(request)

    def _hold_prefix(self, request: EngineRequest) -> HeldKv | None:
        self.validate(request)
        seq = self._new_sequence(request, prefill_only=True)
        cached = self.block_manager.match_prefix(seq, seq.num_tokens)
        if not cached:
            return None
        num_tokens = len(cached) * self.block_size
        # Only cache hits: nothing new is allocated, so this cannot run short.
        ok = self.block_manager.allocate_slots(seq, num_tokens, cached)
        assert ok, "holding cached blocks needs no free block"
        seq.num_computed_tokens = seq.num_cached_tokens = num_tokens
        self.scheduler.hold_cached(seq)
        self._seqs[seq.request_id] = seq
        return HeldKv(tuple(seq.block_table), num_tokens, self.spec.layout)

    def commit_prefix(self, request_id: str) -> int:
        """The blocks reserved for a prefix (`reserve_external` of whole blocks) hold its
        KV, pulled from another worker: offer them to the prefix cache and free the
        reservation (they stay cached). Returns the tokens that were pulled."""
        seq = self._remote(request_id)
        pulled = seq.num_tokens - seq.num_cached_tokens
        self.prompt_tokens_transferred += pulled
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_full_blocks(seq)
        self._finish(seq, SequenceStatus.FINISHED, None)
        return pulled

    # ---- external KV ------------------------------------------------------

    def reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        """Blocks for the request's context (prompt + resume), own cached prefix reused.
        Thread-safe (takes `mutex`), as `hold_prefix`: a worker busy with a long step reserves
        without waiting for it (the pass only writes blocks its own sequences hold; this takes
        free ones, evicting free cached blocks)."""
        with self.mutex:
            return self._reserve_external(request)

    def _reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        self.validate(request)
        seq = self._new_sequence(request, prefill_only=False)
        if not self.scheduler.reserve_remote(seq):
            needed = self.block_manager.blocks_for(seq.num_tokens)
            raise EngineCapacityError(
                f"request {seq.request_id!r} needs up to {needed} KV blocks, "
                f"{self.block_manager.num_free_blocks} free"
            )
        self._seqs[seq.request_id] = seq
        first = seq.num_cached_tokens // self.block_size
        return ExternalKvReservation(seq.request_id, tuple(seq.block_table), seq.num_cached_tokens, first)

    def commit_external(self, request_id: str, first_token_id: int) -> RequestOutput:
        """The reserved blocks hold the context's KV; emit the remotely sampled first token."""
        seq = self._remote(request_id)
        check_token_ids("first_token_id", [first_token_id], self.info.vocab_size)
        self.prompt_tokens_transferred += seq.num_tokens - seq.num_cached_tokens
        self.scheduler.commit_remote(seq)
        return self._append(seq, first_token_id)

    def cancel_external(self, request_id: str) -> bool:
        seq = self.scheduler.remote.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.ABORTED, FinishReason.ABORT)
        return True

    def import_blocks(self, block_ids: Seq[int], blocks: torch.Tensor, layout: KvLayout) -> None:
        """Write transferred KV into blocks reserved for transfer (layout checked first)."""
        layout.check_compatible(self.spec.layout)
        expected = (len(block_ids), *self.spec.layout.block_shape)
        if tuple(blocks.shape) != expected or blocks.dtype != self.spec.layout.storage_dtype:
            raise LayoutMismatch(
                f"KV blocks {tuple(blocks.shape)} {blocks.dtype} != {expected} {self.spec.layout.storage_dtype}"
            )
        writable = {
            b
            for s in self.scheduler.remote.values()
            for b in s.block_table[s.num_cached_tokens // self.block_size :]
        }
        stray = [b for b in block_ids if b not in writable]
        if stray:
            raise InvalidRequestError("block_ids", f"blocks {stray[:8]} are not reserved for a KV transfer")
        self.runner.import_blocks(list(block_ids), blocks)

    def export_blocks(self, block_ids: Seq[int]) -> torch.Tensor:
        """A copy [len(block_ids), *layout.block_shape] of the blocks' KV."""
        bad = [b for b in block_ids if not 0 <= b < self.spec.num_blocks]
        if bad:
            raise InvalidRequestError("block_ids", f"blocks {bad[:8]} not in [0, {self.spec.num_blocks})")
        return self.runner.export_blocks(list(block_ids))

    # ---- views (thread-safe unless noted) ----------------------------------

    def kv_pool(self) -> torch.Tensor:
        return self.runner.kv_pool

    def prefix_lookup(self, token_ids: Seq[int]) -> int:
        return self.block_manager.cached_prefix_tokens(token_ids)

    def kv_events_since(self, seq: int) -> list[KvEvent]:
        return self.block_manager.events.since(seq)

    def kv_snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        return self.block_manager.snapshot()

    def stats(self) -> EngineStats:
        """Counters and queue sizes. Thread-safe: walks copies of the queues (copied under the GIL)."""
        sched, bm = self.scheduler, self.block_manager
        waiting, running, held = list(sched.waiting), list(sched.running), list(sched.held.values())
        pins = bm.pin_stats()
        return EngineStats(
            running=len(running),
            waiting=len(waiting),
            total_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            cached_blocks=bm.num_cached_blocks,
            held_blocks=sum(len(s.block_table) for s in held),
            # Prompt backlog: what waiting requests still need plus the rest of
            # prompts being prefilled in chunks (a long prompt mid-prefill keeps a
            # worker busy as surely as a queued one).
            tokens_waiting=sum(s.num_tokens - s.num_computed_tokens for s in waiting)
            + sum(n for s in running if (n := s.num_tokens - s.num_computed_tokens) > 1),
            active_decode_blocks=sum(len(s.block_table) for s in running),
            prompt_tokens_computed=self.prompt_tokens_computed,
            decode_tokens_computed=self.decode_tokens_computed,
            prompt_tokens_cached=sched.prompt_tokens_cached,
            prompt_tokens_transferred=self.prompt_tokens_transferred,
            preemptions=sched.num_preemptions,
            admitted_ahead=sched.num_admitted_ahead,
            admitted_overdue=sched.num_admitted_overdue,
            moved_ahead=sched.num_moved_ahead,
            **self._quant_stats,
            pinned_blocks=pins.pinned_blocks,
            pins_evicted=pins.pins_evicted,
            pins_expired=pins.pins_expired,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        bm = self.block_manager
        if bm.host is None:
            return {}
        h = bm.host.stats()
        return {
            "host_capacity_blocks": h.capacity_blocks,
            "host_blocks": h.blocks,
            "host_bytes": h.bytes,
            "prompt_tokens_restored": bm.prompt_tokens_restored,
            "host_restores": bm.restores,
            "host_restore_s": bm.restore_s,
            "host_restores_declined": bm.tier_cost.declined,
            "host_rejected": h.rejected,
            "host_evicted": h.evicted,
            "host_restore_s_per_block": bm.tier_cost.restore_s(1),
            "prefill_s_per_block": (bm.tier_cost.prefill_s_per_token or 0.0) * bm.block_size,
        }

    def kv_snapshot_tiers(self):
        """(seq, pool pairs, host-tier pairs): the prefix cache in every tier. Thread-safe."""
        return self.block_manager.snapshot_tiers()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [S, V] of every prompt position (scratch blocks, not cached)."""
        check_token_ids("prompt_token_ids", token_ids, self.info.vocab_size)
        if len(token_ids) > self.info.max_model_len:  # RoPE tables stop at the context limit
            raise InvalidRequestError(
                "prompt_token_ids",
                f"{len(token_ids)} tokens exceed the context limit of {self.info.max_model_len}",
            )
        seq = scratch_sequence(token_ids, self.block_size)
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise EngineCapacityError(f"{len(token_ids)} tokens do not fit in the free KV blocks")
        try:
            return self.runner.chunk_logits(seq, seq.num_tokens)
        finally:
            self.block_manager.free(seq)

    def _probe_thread_invariance(self) -> None:
        """The thread tuner (thread_tuner.py) picks a step's thread count by timing, which keeps
        tokens independent of timing only where a step's result does not depend on its thread
        count. That is not a property of the code but of the CPU's kernels: on an Intel Xeon
        with AMX, bf16 steps of the `small` preset gave other logits on 1 thread than on 2
        (test_thread_tuner.py), and an fp32 linear of 120 rows did too. So it is checked here,
        for this CPU, dtype and weights: prompt chunks of THREAD_PROBE_ROWS tokens on scratch
        blocks (nothing cached, no KV event), on all threads and on one; any difference turns
        the tuner off (steps keep all threads) and says why in `thread_tuner_off`. A probe of a
        few shapes cannot prove every shape alike; it catches a CPU whose kernels split work by
        thread count."""
        runner = self.runner
        vocab = self.info.vocab_size
        for rows in THREAD_PROBE_ROWS:
            if rows > self.info.max_model_len:
                break
            seq = scratch_sequence([(10 + i) % vocab for i in range(rows)], self.block_size)
            if not self.block_manager.allocate_slots(seq, rows):
                break
            try:
                every = runner.chunk_logits(seq, rows)
                one = runner.chunk_logits(seq, rows, threads=1)
            finally:
                self.block_manager.free(seq)
            if not torch.equal(every, one):
                runner.thread_tuner = None
                self.thread_tuner_off = (
                    f"a {rows}-token step's logits differ on 1 thread and on {runner.max_threads} on this CPU "
                    f"({self.config.dtype}, {self.config.weights} weights): every step keeps "
                    f"{runner.max_threads} threads, so tokens do not depend on timing"
                )
                return

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    # ---- internals ----------------------------------------------------------

    def _new_sequence(self, request: EngineRequest, prefill_only: bool) -> Sequence:
        seed = request.sampling.seed
        if seed is None and not request.sampling.greedy:
            seed = draw_seed()  # fixed from here on, across preemption and handoff
        detok = IncrementalDetokenizer(self.tokenizer) if request.sampling.stop else None
        return Sequence(request, self.block_size, seed, prefill_only=prefill_only, detokenizer=detok)

    def _remote(self, request_id: str) -> Sequence:
        seq = self.scheduler.remote.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no KV reservation for request {request_id!r}")
        return seq

    def _account(self, seq: Sequence, n: int) -> None:
        c = seq.num_computed_tokens
        prompt = max(0, min(c + n, seq.prefill_target) - c)
        seq.num_computed_prompt_tokens += prompt
        self.prompt_tokens_computed += prompt
        self.decode_tokens_computed += n - prompt

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.append_token(token)
        reason = seq.check_stop(token, self.info.eos_token_ids, self.info.max_model_len)
        if reason is not None:
            self._finish(seq, SequenceStatus.FINISHED, reason)
        elif seq.prefill_only:
            self.scheduler.hold(seq)
        else:
            self.scheduler.decoding(seq)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.take_new_output(),
            finished=seq.status.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_computed_prompt_tokens=seq.num_computed_prompt_tokens,
        )

    def _finish(self, seq: Sequence, status: SequenceStatus, reason: FinishReason | None) -> None:
        self.scheduler.finish(seq, status)
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        self._watch_start.pop(seq.request_id, None)


def call_each(callbacks: list[Callable[[], None]]) -> None:
    """`started_sink` of an engine driven in-process: the callbacks run at once."""
    for cb in callbacks:
        cb()
