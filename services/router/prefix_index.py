"""The router's view of which prefix blocks each worker has cached.

Owns two things, both fed by the edge from the workers' `SubscribeKvEvents`
streams and read by the routing policy through `PrefixIndex.match`:

- `PrefixIndex`: a trie of chained block hashes (services/model/hashing.py).
  Because h(i) = H(h(i-1), tokens of block i), one hash names a whole prefix,
  so the trie is flattened into a dict keyed by hash; a node keeps its parent's
  hash only to find its children again after a mid-chain removal is undone.
- `EventSequencer`: the last event seq applied per worker. A gap means events
  were lost: the caller clears that worker (`PrefixIndex.clear`) and
  subscribes again (the new subscription starts with a snapshot).

Invariant that makes `match` O(prompt blocks): per node, `holders` are the
workers that reported the block cached, and `reachable` are those holders that
also hold every block before it in the chain (a worker can only reuse a
contiguous leading prefix). Reachable sets can only shrink along a chain, so
`match` compares set sizes per block and touches worker ids only where a
worker drops out. Keeping the invariant costs, per removed (or re-stored)
block, the worker's reachable blocks below it in the chain.

Optimistic entries (`apply_provisional`): when the router routes a request,
the chosen worker's entries gain the prompt's blocks at once, marked
provisional with an expiry, so the next request of a burst sharing the
prefix already sees where it will be cached (Dynamo's approximate indexer
inserts routed prefixes with a TTL). A KV event storing the block confirms
it (the mark goes); one removing it removes it; `expire(now)` drops the
provisional ones nobody confirmed in time (the request failed, or the worker
evicted them before reporting). They are ordinary holders otherwise, so
`match` needs no second structure, and `clear` (sequence gap, resync) drops
them with everything else: a snapshot then rebuilds the worker exactly.

Memory: one node per block cached by at least one worker; a node is freed when
its last holder removes it, when a worker is cleared, or when a worker passes
`max_blocks_per_worker` (a stream that never reports evictions), in which case
`IndexOverflow` tells the caller to resubscribe as for a gap.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.config import require, setting

_EMPTY: frozenset[str] = frozenset()


class IndexOverflow(Exception):
    """A worker reported more cached blocks than allowed; its entries were dropped.

    Treat like a sequence gap: resubscribe to get a fresh snapshot.
    """

    def __init__(self, worker_id: str, blocks: int, limit: int):
        super().__init__(f"worker {worker_id} reported {blocks} cached blocks, over the limit of {limit}")
        self.worker_id = worker_id


@dataclass(frozen=True)
class PrefixIndexConfig:
    max_blocks_per_worker: int = setting(
        1 << 20, "prefix-index entries per worker before its entries are dropped and resubscribed"
    )

    def __post_init__(self) -> None:
        require(self.max_blocks_per_worker >= 1, "max_blocks_per_worker must be >= 1")


@dataclass(slots=True, eq=False)
class _Node:
    parent: int | None  # None: the first block of a prompt
    holders: set[str] = field(default_factory=set)
    reachable: set[str] = field(default_factory=set)  # subset of holders


class PrefixIndex:
    """Cached prefix blocks per worker, matched against a prompt's block hashes."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        self.config = config or PrefixIndexConfig()
        self._nodes: dict[int, _Node] = {}
        # parent hash -> hashes of existing nodes whose parent it is. Keyed by
        # hash, not node, so children survive while their parent is uncached.
        self._children: dict[int, set[int]] = {}
        self._held: dict[str, set[int]] = {}
        # worker -> {hash: expiry} of its provisional blocks (a subset of _held[worker])
        self._provisional: dict[str, dict[int, float]] = {}
        # (expiry, worker, hash) in insertion order; entries whose expiry no longer
        # matches _provisional are stale (confirmed, removed or refreshed) and skipped.
        # Expiries only grow when every insertion uses the same TTL, so the head is next.
        self._expiries: deque[tuple[float, str, int]] = deque()

    # ---- events -------------------------------------------------------------

    def apply_stored(self, worker_id: str, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        """Blocks became cached on `worker_id`, in chain order after `parent_hash`
        (None when the chain starts at a prompt's first block)."""
        held = self._held.setdefault(worker_id, set())
        prov = self._provisional.get(worker_id)
        prev = parent_hash
        for h in block_hashes:
            if prov and prov.pop(h, None) is not None:
                prev = h  # routed here optimistically: now confirmed, nothing else changes
                continue
            node = self._nodes.get(h)
            if node is None:
                node = _Node(prev)
                self._nodes[h] = node
                if prev is not None:
                    self._children.setdefault(prev, set()).add(h)
            if worker_id not in node.holders:
                node.holders.add(worker_id)
                held.add(h)
                if node.parent is None or worker_id in self._reachable(node.parent):
                    self._mark(worker_id, h, node)
            prev = h
        limit = self.config.max_blocks_per_worker
        if len(held) > limit:
            n = len(held)
            self.clear(worker_id)
            raise IndexOverflow(worker_id, n, limit)

    def apply_removed(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Blocks were evicted on `worker_id`. Blocks after a removed one in the
        same chain stay recorded but stop matching until it is stored again."""
        held = self._held.get(worker_id)
        if held is None:
            return
        for h in block_hashes:
            if h not in held:
                continue  # unknown to us (e.g. stored before our snapshot); nothing to undo
            self._drop(worker_id, held, h)

    def clear(self, worker_id: str) -> None:
        """Forget everything about `worker_id` (cache cleared, seq gap, worker removed)."""
        self._provisional.pop(worker_id, None)
        held = self._held.pop(worker_id, None)
        if not held:
            return
        for h in held:
            node = self._nodes[h]
            node.holders.discard(worker_id)
            node.reachable.discard(worker_id)
            if not node.holders:
                self._delete(h, node)

    def apply_snapshot(self, worker_id: str, chains: Iterable[tuple[int | None, Sequence[int]]]) -> None:
        """Replace what is known of `worker_id` by a snapshot: (parent hash, block
        hashes) chains, in any order."""
        self.clear(worker_id)
        self._held[worker_id] = set()  # a worker with an empty cache is still known
        for parent, hashes in chains:
            self.apply_stored(worker_id, parent, hashes)

    # ---- optimistic entries -------------------------------------------------

    def apply_provisional(self, worker_id: str, block_hashes: Sequence[int], expires_at: float) -> int:
        """A request with these prompt blocks (chain from the first) was routed to
        `worker_id`: record the blocks it does not hold yet as provisional until
        `expires_at` (a provisional one already there gets the later expiry).
        Confirmed blocks are untouched. Returns the blocks added. Never raises:
        a worker at `max_blocks_per_worker` gains nothing."""
        held = self._held.setdefault(worker_id, set())
        limit = self.config.max_blocks_per_worker
        prov = self._provisional.setdefault(worker_id, {})
        added = 0
        prev: int | None = None
        for h in block_hashes:
            if h in held:
                if h in prov:
                    prov[h] = expires_at
                    self._expiries.append((expires_at, worker_id, h))
                prev = h
                continue
            if len(held) >= limit:
                break
            node = self._nodes.get(h)
            if node is None:
                node = _Node(prev)
                self._nodes[h] = node
                if prev is not None:
                    self._children.setdefault(prev, set()).add(h)
            elif node.parent != prev:
                break  # a hash collision: leave that chain alone
            node.holders.add(worker_id)
            held.add(h)
            if prev is None or worker_id in self._reachable(prev):
                self._mark(worker_id, h, node)
            prov[h] = expires_at
            self._expiries.append((expires_at, worker_id, h))
            added += 1
            prev = h
        return added

    def expire(self, now: float) -> int:
        """Drop provisional blocks whose expiry passed; returns how many."""
        q = self._expiries
        n = 0
        while q and q[0][0] <= now:
            expiry, worker_id, h = q.popleft()
            prov = self._provisional.get(worker_id)
            if prov is None or prov.get(h) != expiry:
                continue  # confirmed, removed, refreshed or cleared since
            self._drop(worker_id, self._held[worker_id], h)
            n += 1
        return n

    def provisional(self, worker_id: str) -> int:
        """Blocks of `worker_id` routed there but not confirmed by a KV event yet."""
        return len(self._provisional.get(worker_id, ()))

    # ---- queries ------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each worker has cached, contiguously
        from the first block; workers with no match are absent."""
        # Iterates (never indexes past what it needs): a lazy BlockHashChain hashes only
        # the blocks walked, up to the first one no worker holds.
        it = iter(block_hashes)
        prev = next(it, None)
        if prev is None:
            return {}
        first = self._nodes.get(prev)
        if first is None or first.parent is not None or not first.reachable:
            return {}
        result: dict[str, int] = {}
        active: set[str] | frozenset[str] = first.reachable
        nodes = self._nodes
        i = 0
        for i, h in enumerate(it, 1):
            node = nodes.get(h)
            # A parent mismatch can only come from a hash collision: treat as absent.
            nxt = node.reachable if node is not None and node.parent == prev else _EMPTY
            if len(nxt) != len(active):  # equal sizes mean equal sets: nxt is a subset of active
                for w in active - nxt:
                    result[w] = i
                if not nxt:
                    return result
                active = nxt
            prev = h
        for w in active:
            result[w] = i + 1  # every block: the loop ended on the last one
        return result

    def blocks(self, worker_id: str) -> int:
        """Blocks recorded as cached on `worker_id` (matching or not)."""
        return len(self._held.get(worker_id, ()))

    def workers(self) -> list[str]:
        return sorted(self._held)

    def __len__(self) -> int:
        """Distinct blocks cached by at least one worker."""
        return len(self._nodes)

    # ---- internals ----------------------------------------------------------

    def _drop(self, worker_id: str, held: set[int], h: int) -> None:
        prov = self._provisional.get(worker_id)
        if prov:
            prov.pop(h, None)
        held.discard(h)
        node = self._nodes[h]
        self._unmark(worker_id, h, node)
        node.holders.discard(worker_id)
        if not node.holders:
            self._delete(h, node)

    def _reachable(self, h: int) -> set[str] | frozenset[str]:
        node = self._nodes.get(h)
        return node.reachable if node is not None else _EMPTY

    def _mark(self, worker_id: str, h: int, node: _Node) -> None:
        """Make `worker_id` reachable at `h` and at every held block below it
        that only waited for this one."""
        node.reachable.add(worker_id)
        stack = [h]
        while stack:
            for c in self._children.get(stack.pop(), ()):
                child = self._nodes[c]
                if worker_id in child.holders and worker_id not in child.reachable:
                    child.reachable.add(worker_id)
                    stack.append(c)

    def _unmark(self, worker_id: str, h: int, node: _Node) -> None:
        """`worker_id` no longer holds the chain up to `h`: nor anything below it."""
        if worker_id not in node.reachable:
            return
        node.reachable.discard(worker_id)
        stack = [h]
        while stack:
            for c in self._children.get(stack.pop(), ()):
                child = self._nodes[c]
                if worker_id in child.reachable:
                    child.reachable.discard(worker_id)
                    stack.append(c)

    def _delete(self, h: int, node: _Node) -> None:
        del self._nodes[h]
        if node.parent is not None:
            siblings = self._children.get(node.parent)
            if siblings is not None:
                siblings.discard(h)
                if not siblings:
                    del self._children[node.parent]


class SeqVerdict(enum.Enum):
    APPLY = "apply"  # the next event: apply it
    DUPLICATE = "duplicate"  # already applied (seq <= last): skip it
    GAP = "gap"  # events were lost, or no snapshot yet: clear the worker and resubscribe


class EventSequencer:
    """Last applied KV-event seq per worker; detects gaps.

    `start(worker, snapshot_seq)` after applying a snapshot; `check(worker, seq)`
    for each later event. After a GAP the worker is forgotten until the next
    snapshot, so every later event is a GAP too (nothing is applied on top of a
    hole).
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def start(self, worker_id: str, snapshot_seq: int) -> None:
        self._last[worker_id] = snapshot_seq

    def check(self, worker_id: str, seq: int) -> SeqVerdict:
        last = self._last.get(worker_id)
        if last is None:
            return SeqVerdict.GAP
        if seq <= last:
            return SeqVerdict.DUPLICATE
        if seq == last + 1:
            self._last[worker_id] = seq
            return SeqVerdict.APPLY
        del self._last[worker_id]
        return SeqVerdict.GAP

    def forget(self, worker_id: str) -> None:
        self._last.pop(worker_id, None)

    def last_seq(self, worker_id: str) -> int | None:
        return self._last.get(worker_id)
