"""The router's view of which prefix blocks each worker has cached.

Owns two things, both fed by the edge from the workers' `SubscribeKvEvents`
streams and read by the routing policy through `PrefixIndex.match`:

- `PrefixIndex`: which workers hold each chained block hash
  (services/model/hashing.py). Because h(i) = H(h(i-1), tokens of block i),
  one hash names a whole prefix, so no tree is needed: a dict maps each hash
  to the bitmask of the workers holding it (one bit per known worker) and to
  its parent's hash (checked while matching, so a hash collision reads as a
  miss).
- `EventSequencer`: the last event seq applied per worker. A gap means events
  were lost: the caller clears that worker (`PrefixIndex.clear`) and
  subscribes again (the new subscription starts with a snapshot).

`match` ANDs the masks along the prompt's chain from its first block (a worker
can only reuse a contiguous leading prefix), so it is O(prompt blocks) in
integer operations and touches worker ids only where one drops out; an event
costs a dict update per block. (Until session 7 this was a trie of nodes, each
with a set of holders and a set of "reachable" holders kept by walking the
chain below every stored or removed block: the router's KV events and the
garbage collection of those nodes' sets were a quarter of its CPU in the
Dynamo side by side's profile, BENCHMARKS.md issue 16.) The mask and the
parent share one int per block, `mask << 65 | parent` (parent 1 << 64 for a
chain's first block): one dict probe per block walked, not two.

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

Memory: one dict entry per block cached by at least one worker (mask and parent),
freed when its last holder removes it, when a worker is cleared, or when a worker passes
`max_blocks_per_worker` (a stream that never reports evictions), in which case
`IndexOverflow` tells the caller to resubscribe as for a gap.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

from services.common.config import require, setting

_SHIFT = 65  # an entry is mask << _SHIFT | parent
_PARENT = (1 << _SHIFT) - 1  # the parent's bits of an entry
_ROOT = 1 << 64  # the "parent" of a chain's first block (hashes are < 2**64)


def _parts(block_hashes: Sequence[int]) -> Iterable[Sequence[int]]:
    """`block_hashes` as consecutive lists: a lazy chain's `chunks()`, else itself whole."""
    chunks = getattr(block_hashes, "chunks", None)
    return chunks() if chunks is not None else (block_hashes,)


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


class PrefixIndex:
    """Cached prefix blocks per worker, matched against a prompt's block hashes."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        self.config = config or PrefixIndexConfig()
        # hash -> (bitmask of the workers holding it) << _SHIFT | its parent's hash (the first
        # store's; _ROOT for a chain's first block)
        self._entries: dict[int, int] = {}
        self._held: dict[str, set[int]] = {}
        self._bits: dict[str, int] = {}  # worker -> its bit (1 << slot), while it is known
        self._by_slot: list[str | None] = []  # slot -> worker; a freed slot is None
        # worker -> {hash: expiry} of its provisional blocks (a subset of _held[worker])
        self._provisional: dict[str, dict[int, float]] = {}
        # (expiry, worker, hashes) per apply_provisional call, in call order; a hash whose
        # expiry no longer matches _provisional is stale (confirmed, removed or refreshed)
        # and skipped. Expiries only grow when every call uses the same TTL, so the head is next.
        self._expiries: deque[tuple[float, str, list[int]]] = deque()

    # ---- events -------------------------------------------------------------

    def apply_stored(self, worker_id: str, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        """Blocks became cached on `worker_id`, in chain order after `parent_hash`
        (None when the chain starts at a prompt's first block)."""
        held, bit = self._known(worker_id)
        prov = self._provisional.get(worker_id)
        entries, mark = self._entries, bit << _SHIFT
        prev = _ROOT if parent_hash is None else parent_hash
        for h in block_hashes:
            if prov and prov.pop(h, None) is not None:
                prev = h  # routed here optimistically: now confirmed, nothing else changes
                continue
            v = entries.get(h)
            if v is None:
                entries[h] = mark | prev
                held.add(h)
            elif not v & mark:
                entries[h] = v | mark
                held.add(h)
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
        bit = self._bits.pop(worker_id, 0)
        if bit:
            self._by_slot[bit.bit_length() - 1] = None  # free: no hash carries this bit below
        if not held:
            return
        entries, keep = self._entries, ~(bit << _SHIFT)
        for h in held:
            v = entries[h] & keep
            if v > _PARENT:  # other holders left
                entries[h] = v
            else:
                del entries[h]

    def apply_snapshot(self, worker_id: str, chains: Iterable[tuple[int | None, Sequence[int]]]) -> None:
        """Replace what is known of `worker_id` by a snapshot: (parent hash, block
        hashes) chains, in any order."""
        self.clear(worker_id)
        self._known(worker_id)  # a worker with an empty cache is still known
        for parent, hashes in chains:
            self.apply_stored(worker_id, parent, hashes)

    # ---- optimistic entries -------------------------------------------------

    def apply_provisional(self, worker_id: str, block_hashes: Sequence[int], expires_at: float) -> int:
        """A request with these prompt blocks (chain from the first) was routed to
        `worker_id`: record the blocks it does not hold yet as provisional until
        `expires_at` (a provisional one already there gets the later expiry).
        Confirmed blocks are untouched. Returns the blocks added. Never raises:
        a worker at `max_blocks_per_worker` gains nothing."""
        held, bit = self._known(worker_id)
        limit = self.config.max_blocks_per_worker
        prov = self._provisional.setdefault(worker_id, {})
        entries, mark = self._entries, bit << _SHIFT
        marked: list[int] = []  # the hashes given this expiry (added or refreshed)
        added = 0
        prev = _ROOT
        for part in _parts(block_hashes):
            for h in part:
                if h in held:
                    if h in prov:
                        prov[h] = expires_at
                        marked.append(h)
                    prev = h
                    continue
                if len(held) >= limit:
                    break
                v = entries.get(h)
                if v is None:
                    v = prev
                elif v & _PARENT != prev:
                    break  # a hash collision: leave that chain alone
                entries[h] = v | mark
                held.add(h)
                prov[h] = expires_at
                marked.append(h)
                added += 1
                prev = h
            else:
                continue
            break
        if marked:
            self._expiries.append((expires_at, worker_id, marked))
        return added

    def expire(self, now: float) -> int:
        """Drop provisional blocks whose expiry passed; returns how many."""
        q = self._expiries
        n = 0
        while q and q[0][0] <= now:
            expiry, worker_id, hashes = q.popleft()
            prov = self._provisional.get(worker_id)
            if not prov:
                continue  # every one confirmed, removed or cleared since
            held = self._held[worker_id]
            for h in hashes:
                if prov.get(h) == expiry:  # else confirmed, removed or refreshed since
                    self._drop(worker_id, held, h)
                    n += 1
        return n

    def provisional(self, worker_id: str) -> int:
        """Blocks of `worker_id` routed there but not confirmed by a KV event yet."""
        return len(self._provisional.get(worker_id, ()))

    # ---- queries ------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each worker has cached, contiguously
        from the first block; workers with no match are absent."""
        # A lazy BlockHashChain is walked list by list (`_parts`): it hashes only the blocks
        # walked, up to the first one no worker holds, and no generator resumes per block.
        parts = iter(_parts(block_hashes))
        first = next(parts, None)
        if first is None or len(first) == 0:
            return {}
        prev = first[0]
        entries = self._entries
        v = entries.get(prev, 0)
        active = v >> _SHIFT
        if not active or v & _PARENT != _ROOT:
            return {}
        result: dict[str, int] = {}
        i = 1  # blocks walked
        for part in chain((first[1:],), parts):
            for h in part:
                v = entries.get(h, 0)
                nxt = active & (v >> _SHIFT)
                if nxt and v & _PARENT != prev:
                    nxt = 0  # a parent mismatch can only come from a hash collision: absent
                if nxt != active:
                    self._name(active ^ nxt, i, result)
                    if not nxt:
                        return result
                    active = nxt
                prev = h
                i += 1
        self._name(active, i, result)  # every block matched by these
        return result

    def blocks(self, worker_id: str) -> int:
        """Blocks recorded as cached on `worker_id` (matching or not)."""
        return len(self._held.get(worker_id, ()))

    def workers(self) -> list[str]:
        return sorted(self._held)

    def __len__(self) -> int:
        """Distinct blocks cached by at least one worker."""
        return len(self._entries)

    # ---- internals ----------------------------------------------------------

    def _known(self, worker_id: str) -> tuple[set[int], int]:
        """The worker's held set and bit, allocating both on first sight."""
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = set()
        bit = self._bits.get(worker_id)
        if bit is None:
            slots = self._by_slot
            slot = next((i for i, w in enumerate(slots) if w is None), len(slots))
            if slot == len(slots):
                slots.append(worker_id)
            else:
                slots[slot] = worker_id
            bit = self._bits[worker_id] = 1 << slot
        return held, bit

    def _name(self, mask: int, depth: int, out: dict[str, int]) -> None:
        """out[worker] = depth for every worker whose bit is in `mask`."""
        slots = self._by_slot
        while mask:
            low = mask & -mask
            out[slots[low.bit_length() - 1]] = depth  # type: ignore[index]
            mask ^= low

    def _drop(self, worker_id: str, held: set[int], h: int) -> None:
        prov = self._provisional.get(worker_id)
        if prov:
            prov.pop(h, None)
        held.discard(h)
        entries = self._entries
        v = entries[h] & ~(self._bits[worker_id] << _SHIFT)
        if v > _PARENT:  # other holders left
            entries[h] = v
        else:
            del entries[h]


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
