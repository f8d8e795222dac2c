"""BlockManager: who uses which KV block, and which blocks form the prefix cache.

It owns block accounting only (the KV tensor itself belongs to ModelRunner):
reference counts, the free queue, the hash -> block map of the prefix cache, and
the KvEventLog that tells routers what is cached. Created and driven by the
Scheduler; other threads may only call the read methods marked thread-safe.

Free queue = LRU eviction order. A block whose ref count drops to 0 keeps its
hash (it stays a cache hit) and joins the tail; blocks without a hash join the
head, so they are reused before any cached block is evicted. A sequence frees
its blocks last-first, so a chain is evicted from its end and a surviving
prefix stays matchable.

Workflow pins: between two steps of an agent workflow (a tool call, the user
thinking) the engine keeps the workflow's cached blocks out of the free queue
for `pin_ttl_s`, so the next step's prompt (the conversation so far) is still a
cache hit (cf. Continuum). A pin holds one reference per block. It ends on its
TTL (`expire_pins`, counted as expired; the TTL restarts when the workflow's
next step reaches the scheduler, `touch_pin`, so a queued step keeps it), when the workflow ends (`unpin`), when
the next step pins again (replaced), or under pressure: an allocation that
would fail releases pins lowest value first (fewest blocks = least recompute
lost, then the soonest to expire), counted as evicted.

Host tier (optional, `attach_host_tier`): a cached block evicted to reuse its
slot is first offered to a larger HostTier (its KV copied there, a `stored`
event with tier HOST after the pool's `removed`), and a prompt whose chain goes
on past the pool's hits can have the next blocks restored from it
(`match_host` + `restore`) when TierCost predicts that is faster than
recomputing them. The tier is inclusive: a restored block stays there too, so
it is still a hit after the pool evicts it again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from services.engine.api import KvTier
from services.engine.host_tier import HostTier, TierCost
from services.engine.kv_events import KvEventLog
from services.engine.sequence import Sequence
from services.model.hashing import block_hashes


class Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        # Set only while the block is the prefix cache's entry for this hash.
        self.block_hash: int | None = None
        self.parent_hash: int | None = None


@dataclass
class _Pin:
    block_ids: list[int]
    expires_at: float


@dataclass(frozen=True)
class PinStats:
    pinned_blocks: int  # blocks held by pins now
    pinned_workflows: int
    pins_expired: int  # lifetime: released on their TTL
    pins_evicted: int  # lifetime: released under pressure
    pins_released: int  # lifetime: released at the workflow's end


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        event_capacity: int,
        pin_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.events = KvEventLog(event_capacity)
        # Guards `_cached` + the event log together, for readers on other threads.
        self._lock = threading.Lock()
        self.pin_ttl_s = pin_ttl_s  # 0 = workflows are not pinned
        self._clock = clock
        self._pins: dict[str, _Pin] = {}  # workflow id -> its pin
        self._pinned_blocks = 0
        self._pins_expired = self._pins_evicted = self._pins_released = 0
        # Host tier: off until attach_host_tier. `_offload` collects (block id,
        # hash, parent) of blocks evicted by the current allocation.
        self.host: HostTier | None = None
        self.tier_cost: TierCost | None = None
        self._read_blocks: Callable | None = None
        self._write_blocks: Callable | None = None
        self._offload: list[tuple[int, int, int | None]] = []
        self.prompt_tokens_restored = 0
        self.restores = 0
        self.restore_s = 0.0

    def attach_host_tier(
        self, tier: HostTier, cost: TierCost, read_blocks: Callable, write_blocks: Callable
    ) -> None:
        """Back the pool with `tier`; `read_blocks(ids) -> Tensor` / `write_blocks(ids, Tensor)`
        copy KV out of / into pool blocks (the runner's export/import)."""
        self.host, self.tier_cost = tier, cost
        self._read_blocks, self._write_blocks = read_blocks, write_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user: never used, or cached and evictable."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of `seq` within its first `max_tokens` tokens."""
        if not self.enable_prefix_caching:
            return []
        hashes = seq.block_hashes(min(max_tokens, seq.num_tokens) // self.block_size)
        hits: list[int] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.host is not None and hits:
            self.host.record_use(hashes[: len(hits)])
        return hits

    def match_host(self, seq: Sequence, max_tokens: int, start: int) -> list[int]:
        """Hashes of the blocks after the pool's `start` hits that the host tier can
        restore, within `seq`'s first `max_tokens` tokens; [] when restoring them is
        not predicted to be faster than recomputing (counted as declined)."""
        if self.host is None or not self.enable_prefix_caching:
            return []
        limit = min(max_tokens, seq.num_tokens) // self.block_size
        if start >= limit:
            return []
        hashes = seq.block_hashes(limit)[start:]
        n = self.host.match(hashes)
        if n == 0:
            return []
        context = start * self.block_size
        rest = seq.num_tokens - context - n * self.block_size
        if not self.tier_cost.worth_restoring(n, context, rest):
            return []
        self.host.touch(hashes[:n])  # most recent: the allocation's offloads evict others first
        return hashes[:n]

    def restore(self, seq: Sequence, start: int, hashes: list[int], data) -> None:
        """Write host-tier KV `data` of `hashes` into `seq`'s blocks from index `start`
        (allocated by allocate_slots) and make them cached; emits `stored` events."""
        t0 = time.perf_counter()
        ids = seq.block_table[start : start + len(hashes)]
        self._write_blocks(ids, data)
        seconds = time.perf_counter() - t0
        self.tier_cost.observe_restore(len(ids), seconds)
        self.host.record_use(hashes)
        chain = seq.block_hashes(start + len(hashes))
        with self._lock:
            run: list[int] = []
            run_parent: int | None = None
            for i, (block_id, h) in enumerate(zip(ids, hashes, strict=True)):
                parent = chain[start + i - 1] if start + i else None
                if h in self._cached:  # computed again meanwhile: keep that entry
                    self.events.stored(run_parent, run)
                    run = []
                    continue
                block = self.blocks[block_id]
                block.block_hash, block.parent_hash = h, parent
                self._cached[h] = block_id
                if not run:
                    run_parent = parent
                run.append(h)
            self.events.stored(run_parent, run)
        seq.num_registered_blocks = start + len(hashes)
        self.prompt_tokens_restored += len(hashes) * self.block_size
        self.restores += 1
        self.restore_s += seconds

    def cached_prefix_tokens(self, token_ids: Seq[int]) -> int:
        """Leading tokens of `token_ids` cached here, a multiple of block_size. Thread-safe."""
        if not self.enable_prefix_caching:
            return 0
        hashes = block_hashes(token_ids, self.block_size)
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._cached:
                    break
                n += 1
        return n * self.block_size

    def cached_prefix_blocks(self, hashes: Seq[int]) -> int:
        """Leading blocks of the chain `hashes` cached here (hashed once by the caller
        for every worker it asks). Thread-safe."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._cached:
                    break
                n += 1
        return n

    def allocate_slots(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> bool:
        """Grow `seq.block_table` to cover `num_tokens` tokens, first taking the
        prefix-cache hits `cached` (admission only). All or nothing: False, with
        nothing changed, when too few blocks are free."""
        if not cached and num_tokens <= len(seq.block_table) * self.block_size:
            return True  # a decode step inside its last block: most calls, per token per step
        need = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(cached))
        # A hit nobody references sits in the free queue: taking it uses a free slot.
        idle_hits = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        short = need + idle_hits > len(self._free)
        if short and not self._pins:
            return False
        for block_id in cached:  # hold the hits, so releasing pins cannot evict them
            self._ref(block_id)
        if short:
            self._release_pins_for(need)
            if need > len(self._free):
                for block_id in reversed(cached):  # undo: all or nothing
                    self._unref(block_id)
                return False
        if cached:
            seq.block_table.extend(cached)
            seq.num_registered_blocks = len(seq.block_table)
        evicted: list[int] = []
        with self._lock:
            for _ in range(need):
                seq.block_table.append(self._take_free(evicted))
            self.events.removed(evicted)
            if self._offload:
                self._offload_to_host()
        return True

    def _offload_to_host(self) -> None:
        """Copy the blocks just evicted (still holding their KV: nothing has run on
        them yet) into the host tier; events for what it stored and dropped. Lock held."""
        pending, self._offload = self._offload, []
        data = self._read_blocks([block_id for block_id, _, _ in pending])
        stored, dropped = self.host.offer([(h, parent) for _, h, parent in pending], data)
        self.events.removed(dropped, KvTier.HOST)
        if stored:  # one event per chain run, as cache_full_blocks does
            kept = set(stored)
            run: list[int] = []
            run_parent: int | None = None
            # Walked in reverse: free() releases a sequence's blocks last first, so the LRU
            # evicts (and `pending` lists) each chain backwards. Walked forwards, no block
            # followed its parent and every block was an event of its own (kv_tiers' replay:
            # 370k events for 226k offered blocks, half the engine's host-tier Python).
            for _, h, parent in reversed(pending):
                if h not in kept:
                    continue
                if run and parent != run[-1]:
                    self.events.stored(run_parent, run, KvTier.HOST)
                    run = []
                if not run:
                    run_parent = parent
                run.append(h)
            self.events.stored(run_parent, run, KvTier.HOST)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, last block first; blocks stay cached until evicted."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s newly full, computed blocks to the prefix cache and emit
        `stored` events for the ones it did not have yet."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if not self.enable_prefix_caching or num_full <= start:
            return
        hashes = seq.block_hashes(num_full)
        with self._lock:
            run: list[int] = []
            run_parent: int | None = None
            for i in range(start, num_full):
                block = self.blocks[seq.block_table[i]]
                if hashes[i] in self._cached:
                    # Another sequence computed the same block first: keep its entry.
                    self.events.stored(run_parent, run)
                    run = []
                    continue
                block.block_hash = hashes[i]
                block.parent_hash = hashes[i - 1] if i else None
                self._cached[hashes[i]] = block.block_id
                if not run:
                    run_parent = block.parent_hash
                run.append(hashes[i])
            self.events.stored(run_parent, run)
        if self.host is not None:
            self.host.record_use(hashes[start:num_full])
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated) and emit `cleared`."""
        with self._lock:
            for block_id in self._cached.values():
                self.blocks[block_id].block_hash = None
            self._cached.clear()
            if self.host is not None:
                self.host.clear()
            self.events.cleared()

    def snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        """(last event seq, [(parent_hash, block_hash)] of every cached block). Thread-safe."""
        with self._lock:
            pairs = [(self.blocks[b].parent_hash, h) for h, b in self._cached.items()]
            return self.events.last_seq, pairs

    def snapshot_tiers(self) -> tuple[int, list[tuple[int | None, int]], list[tuple[int | None, int]]]:
        """(last event seq, pool pairs, host-tier pairs), consistent with each other. Thread-safe."""
        with self._lock:
            pairs = [(self.blocks[b].parent_hash, h) for h, b in self._cached.items()]
            host = [] if self.host is None else self.host.pairs()
            return self.events.last_seq, pairs, host

    # ---- workflow pins ------------------------------------------------------

    def pin(self, workflow_id: str, seq: Sequence) -> int:
        """Keep `seq`'s cached blocks (its full, hashed prefix) for the next step of
        `workflow_id`, for pin_ttl_s; call before `free(seq)`. Replaces the
        workflow's previous pin. Returns the blocks pinned."""
        if not workflow_id or self.pin_ttl_s <= 0 or not self.enable_prefix_caching:
            return 0
        keep: list[int] = []
        for block_id in seq.block_table[: seq.num_registered_blocks]:
            if self.blocks[block_id].block_hash is None:
                break  # a prefix only: later blocks could not be matched anyway
            keep.append(block_id)
        for block_id in keep:
            self._ref(block_id)
        self._drop_pin(workflow_id)  # after taking the new refs: shared blocks never hit 0
        if keep:
            self._pins[workflow_id] = _Pin(keep, self._clock() + self.pin_ttl_s)
            self._pinned_blocks += len(keep)
        return len(keep)

    def touch_pin(self, workflow_id: str) -> bool:
        """The workflow's next step arrived: its pin now lasts pin_ttl_s from here,
        so it survives the step's wait in the queue (the TTL is meant to cover the
        think / tool time between steps, not a backlog). False if it had none."""
        pin = self._pins.get(workflow_id) if workflow_id else None
        if pin is None:
            return False
        pin.expires_at = max(pin.expires_at, self._clock() + self.pin_ttl_s)
        return True

    def unpin(self, workflow_id: str) -> bool:
        """The workflow ended: release its pin. False if it had none."""
        if self._drop_pin(workflow_id):
            self._pins_released += 1
            return True
        return False

    def expire_pins(self, now: float | None = None) -> int:
        """Release pins past their TTL; returns how many."""
        now = self._clock() if now is None else now
        done = [w for w, p in self._pins.items() if p.expires_at <= now]
        for w in done:
            self._drop_pin(w)
        self._pins_expired += len(done)
        return len(done)

    def next_pin_expiry(self) -> float | None:
        """When the soonest pin expires (None: no pins)."""
        return min((p.expires_at for p in self._pins.values()), default=None)

    def pinned(self, workflow_id: str) -> int:
        """Blocks pinned for `workflow_id` (0: none)."""
        pin = self._pins.get(workflow_id)
        return len(pin.block_ids) if pin else 0

    def pin_stats(self) -> PinStats:
        return PinStats(
            pinned_blocks=self._pinned_blocks,
            pinned_workflows=len(self._pins),
            pins_expired=self._pins_expired,
            pins_evicted=self._pins_evicted,
            pins_released=self._pins_released,
        )

    def _release_pins_for(self, need: int) -> None:
        """Pressure: release pins, lowest value first, until `need` blocks are free."""
        order = sorted(self._pins.items(), key=lambda kv: (len(kv[1].block_ids), kv[1].expires_at))
        for workflow_id, _ in order:
            if len(self._free) >= need:
                return
            self._drop_pin(workflow_id)
            self._pins_evicted += 1

    def _drop_pin(self, workflow_id: str) -> bool:
        pin = self._pins.pop(workflow_id, None)
        if pin is None:
            return False
        self._pinned_blocks -= len(pin.block_ids)
        for block_id in reversed(pin.block_ids):  # last first, as free() does
            self._unref(block_id)
        return True

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self, evicted: list[int]) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the caller holds the lock
            del self._cached[block.block_hash]
            evicted.append(block.block_hash)
            if self.host is not None:
                self._offload.append((block_id, block.block_hash, block.parent_hash))
            block.block_hash = None
            block.parent_hash = None
        block.ref_count = 1
        return block_id
