"""TierView: which prefix blocks each worker holds in its host KV tier (issue 22).

A worker with a host tier (services/engine/host_tier.py) reports, besides its
pool's events, `stored` / `removed` events with tier HOST: a pool block it
evicts is removed from the pool and stored in the host tier, and it can be
restored from there on a prefix hit, faster than recomputing it but not free.
The PrefixIndex keeps the pool's blocks only (device events), exactly as
before; this view keeps a plain set of host-tier hashes per worker that has
one. Events cost a set insert or delete each; the walk happens per routing
decision instead: from a worker's device overlap d, the prompt's blocks d, d+1,
... count while the worker holds each in either tier (a prefix is usable only
while contiguous). Its credit is then

    device overlap + w * (blocks found past it)

with w = policy.tier_weight(restore, recompute) from that worker's measured
restore and prefill times per block (its heartbeat's WorkerLoad), so a host
tier that restores no faster than recomputing earns nothing. (A second
PrefixIndex over both tiers was tried first: maintaining its reachability for
every offloaded block took a third of the router's CPU in the kv_tiers replay;
blocks are reported ~850 times more often than requests are routed.)
Workers without a host tier cost nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from services.router.policy import TierOverlap, WorkerLoad, overlap_credit, tier_weight
from services.router.prefix_index import PrefixIndex, PrefixIndexConfig


class TierView:
    def __init__(self, device: PrefixIndex | None = None):
        self._host: dict[str, set[int]] = {}  # only workers that reported a host-tier block
        self._device = device  # the pool's index: blocks past the overlap may be back in the pool

    def has_tiers(self) -> bool:
        return bool(self._host)

    def blocks(self, worker_id: str) -> int:
        return len(self._host.get(worker_id, ()))

    # ---- events (the router's edge calls these beside the PrefixIndex's) -------

    def stored(self, worker_id: str, hashes: Iterable[int]) -> None:
        self._host.setdefault(worker_id, set()).update(hashes)

    def removed(self, worker_id: str, hashes: Iterable[int]) -> None:
        held = self._host.get(worker_id)
        if held is not None:
            held.difference_update(hashes)

    def clear(self, worker_id: str) -> None:
        self._host.pop(worker_id, None)

    def snapshot(self, worker_id: str, host_hashes: Iterable[int]) -> None:
        """Replace `worker_id`'s host tier by a snapshot's host-tier blocks."""
        self.clear(worker_id)
        held = set(host_hashes)
        if held:
            self._host[worker_id] = held

    # ---- scoring -----------------------------------------------------------------

    def credits(
        self, hashes: Sequence[int], overlaps: Mapping[str, int], loads: Mapping[str, WorkerLoad]
    ) -> dict[str, float]:
        """Worker id -> overlap credit over both tiers, for candidates with a host
        tier that holds the blocks right after their device overlap (others:
        absent, so the policy uses their device overlap)."""
        out: dict[str, float] = {}
        n = len(hashes)
        device_held = self._device._held if self._device is not None else {}
        for wid, host in self._host.items():
            load = loads.get(wid)
            if load is None or not host:
                continue  # not a candidate
            d = overlaps.get(wid, 0)
            pool = device_held.get(wid, ())
            i = d
            while i < n and ((h := hashes[i]) in host or h in pool):
                i += 1
            if i > d:
                out[wid] = overlap_credit([TierOverlap(d, 1.0), TierOverlap(i - d, host_weight(load))])
        return out


class TieredPrefixIndex(PrefixIndex):
    """The router's PrefixIndex (pool blocks, unchanged) with a TierView beside it:
    clearing a worker (resync, removal) clears both, and `tier_credits` scores the
    host tier for the policy."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        super().__init__(config)
        self.tiers = TierView(device=self)

    def clear(self, worker_id: str) -> None:
        super().clear(worker_id)
        self.tiers.clear(worker_id)

    def tier_credits(self, hashes, overlaps, loads) -> dict[str, float]:
        return self.tiers.credits(hashes, overlaps, loads)


def host_weight(load: WorkerLoad) -> float:
    """The credit of a host-tier block on this worker, from what it measured."""
    restore = load.host_restore_ms_per_block
    recompute = load.prefill_ms_per_block
    if recompute <= 0:  # nothing measured yet: a restore is taken, so credit it
        return 1.0
    return tier_weight(restore / 1000.0, recompute / 1000.0)
