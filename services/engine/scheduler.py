"""Scheduler: which sequences compute how many tokens in the next step.

Owns the waiting queue, the running batch, held (prefill-only) and
remote-KV sequences, and the BlockManager that gives them blocks. Each
`schedule()` serves the running batch first (decodes and unfinished prompt
chunks, in admission order), then admits waiting sequences while the token
budget, `max_num_seqs` and free blocks allow; a prompt longer than what is left
of the budget is computed in chunks over several steps. When a running sequence
cannot get a block, the most recently admitted one is preempted: its blocks are
freed and it recomputes later (its full blocks usually survive as cache hits).

Admission order is first come, first served within a priority, except under
overload when `late_after_s` is set (the deployment's TTFT target): a request
that has waited longer than that without starting yields the next free slot to
one of its priority that can still start in time ("on time first"). Under a
backlog, strict FIFO makes every request wait the whole backlog and miss its
target; serving the on-time ones first keeps them within it, and the late
ones, late whatever happens, follow once the queue has no on-time request
left (Facebook's adaptive LIFO and CoDel make the same trade; see
docs/DESIGN.md). With `late_max_s` a late request is passed over only until
it has waited that long: then it is overdue and takes its first-come place
again, so a sustained overload cannot starve it (and its client's read
timeout, which would send it again as new work, is not reached first).
A request's wait counts from when it began in the mesh
(`EngineRequest.waited_s`: a request retried after a first-token timeout, or a
hedge copy, brings the wait it had elsewhere). Only requests with no token out yet can be late: a resumed
(migrated) stream or a preempted sequence keeps its place. A stream moved off another worker
(`EngineRequest.front`: resumed after a migration, or moved before its first token off a
worker that went unhealthy) is queued ahead of the other requests of its priority, behind
only preempted and other moved ones, first come, first served or not.

The output goes to ModelRunner; LLMEngine reports back with `computed` (the
tokens ran), `decoding` / `hold` / `finish` (what the sampled token meant).
Every change of a sequence's `status` happens here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # (sequence, tokens to compute this step), running order.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        late_after_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        late_max_s: float = 0.0,
    ):
        if late_after_s < 0:
            raise ValueError(f"late_after_s must be >= 0, got {late_after_s}")
        if late_max_s and not 0 < late_after_s < late_max_s:
            raise ValueError(
                f"late_max_s needs 0 < late_after_s < late_max_s, got {late_after_s}, {late_max_s}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.late_after_s = late_after_s  # 0: strict first come, first served
        self.late_max_s = late_max_s  # 0: a late request may be passed for as long as on-time ones come
        self._clock = clock
        # Admissions of an on-time request ahead of a late one at the head of the queue.
        self.num_admitted_ahead = 0
        # Admissions of an overdue request (late_max_s); moved streams queued ahead of others.
        self.num_admitted_overdue = 0
        self.num_moved_ahead = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}
        self.remote: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Prompt tokens served from the prefix cache at first admission / reservation.
        self.prompt_tokens_cached = 0

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind those of equal or higher priority; one moved off
        another worker (`front`) goes ahead of those of its priority that are neither moved
        nor preempted: the mesh owes it its next token soon."""
        if seq.workflow_id:  # the workflow's pinned context must outlive this step's wait
            self.block_manager.touch_pin(seq.workflow_id)
        if self.late_after_s > 0:  # read only by on-time-first admission
            seq.queued_at = self._clock() - seq.waited_s
        waiting, p = self.waiting, seq.priority
        i = len(waiting)
        if seq.front:
            while i > 0 and (
                waiting[i - 1].priority < p
                or (
                    waiting[i - 1].priority == p
                    and not waiting[i - 1].front
                    and not waiting[i - 1].num_preemptions
                )
            ):
                i -= 1
            self.num_moved_ahead += i < len(waiting)
        else:
            while i > 0 and waiting[i - 1].priority < p:
                i -= 1
        waiting.insert(i, seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.expire_pins()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._grow_or_preempt(seq, n, out.preempted):
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        if not out.preempted:  # admitting now would only preempt again
            budget = self._admit(budget, out)
        return out

    def _grow_or_preempt(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Blocks for `n` more tokens of `seq`, preempting from the back; False if `seq` itself went."""
        while not self.block_manager.allocate_slots(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        now = self._clock() if self.late_after_s > 0 else 0.0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            k = self._next_waiting(now) if self.late_after_s > 0 else 0
            seq = self.waiting[k]
            # The last token is always computed: its logits give the next sample.
            cached = bm.match_prefix(seq, seq.num_tokens - 1)
            # Blocks after the pool's hits that the host tier holds (when restoring beats recomputing).
            restore = bm.match_host(seq, seq.num_tokens - 1, len(cached))
            num_cached = (len(cached) + len(restore)) * self.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not bm.allocate_slots(seq, num_cached + n, cached):
                break
            if self._overdue(seq, now):
                self.num_admitted_overdue += 1
            if k:
                del self.waiting[k]
                self.num_admitted_ahead += 1
            else:
                self.waiting.popleft()
            if restore:
                # The allocation's own offloads may have pushed some out of the host tier:
                # restore what is still there; the blocks allocated cover computing the rest.
                restore = restore[: bm.host.match(restore)]
                if restore:
                    bm.restore(seq, len(cached), restore, bm.host.read(restore))
                num_cached = (len(cached) + len(restore)) * self.block_size
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:  # a recompute's hits are its own earlier work
                seq.num_cached_tokens = num_cached
                self.prompt_tokens_cached += num_cached
            seq.prefill_target = seq.num_tokens
            seq.status = SequenceStatus.PREFILLING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    # A queue scan stops after this many entries: under a storm the head's priority
    # band can be thousands long, and an on-time request is near the back anyway.
    MAX_SCAN = 256

    def _late(self, seq: Sequence, now: float) -> bool:
        """Has `seq` waited past `late_after_s` for its first token? A sequence with
        tokens out already (resumed after a migration) or preempted mid-run is not
        waiting for a first token: it is never late."""
        return seq.num_emitted == 0 and seq.num_preemptions == 0 and now - seq.queued_at > self.late_after_s

    def _next_waiting(self, now: float) -> int:
        """Index of the next sequence to admit: the first of the head's priority, in
        queue order, that is on time or overdue (waited past `late_max_s`); the head
        when there is none. Late ones not yet overdue are passed over."""
        waiting = self.waiting
        head = waiting[0]
        if not self._late(head, now):
            return 0
        for k in range(min(len(waiting), self.MAX_SCAN)):
            seq = waiting[k]
            if seq.priority != head.priority:
                break
            if not self._late(seq, now) or self._overdue(seq, now):
                return k
        return 0

    def _overdue(self, seq: Sequence, now: float) -> bool:
        """Waited past `late_max_s` (when set) for a first token: late, and no longer passed over."""
        late_max = self.late_max_s
        return bool(late_max) and now - seq.queued_at > late_max and self._late(seq, now)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def computed(self, seq: Sequence, n: int) -> None:
        """The runner computed `n` more tokens of `seq`; its full blocks join the prefix cache."""
        seq.num_computed_tokens += n
        self.block_manager.cache_full_blocks(seq)

    def decoding(self, seq: Sequence) -> None:
        """A token was sampled for `seq` and it goes on: from here it decodes."""
        seq.status = SequenceStatus.DECODING

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of whatever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.held.pop(seq.request_id, None)
        self.remote.pop(seq.request_id, None)
        if seq.workflow_id:
            if seq.workflow_final:
                self.block_manager.unpin(seq.workflow_id)
            elif status is SequenceStatus.FINISHED:  # a step that ran to its end: keep its context
                self.block_manager.pin(seq.workflow_id, seq)
        self.block_manager.free(seq)
        seq.status = status

    def hold(self, seq: Sequence) -> None:
        """Prefill-only: keep the blocks of a sequence that stops computing."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HELD
        self.held[seq.request_id] = seq

    def hold_cached(self, seq: Sequence) -> None:
        """A sequence made only of cache hits, held for another worker to read (never run)."""
        seq.status = SequenceStatus.HELD
        self.held[seq.request_id] = seq

    def reserve_remote(self, seq: Sequence) -> bool:
        """Blocks for all of `seq`'s tokens, cached prefix reused; False if not enough free."""
        bm = self.block_manager
        cached = bm.match_prefix(seq, seq.num_tokens)
        if not bm.allocate_slots(seq, seq.num_tokens, cached):
            return False
        seq.num_cached_tokens = len(cached) * self.block_size
        self.prompt_tokens_cached += seq.num_cached_tokens
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.remote[seq.request_id] = seq
        return True

    def commit_remote(self, seq: Sequence) -> None:
        """The reserved blocks hold every token's KV: the sequence joins the running batch."""
        del self.remote[seq.request_id]
        seq.num_computed_tokens = seq.prefill_target = seq.num_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.DECODING
        self.running.append(seq)
