"""TierView: which prefix blocks each worker holds in its host KV tier (issue 22).

A worker with a host tier (services/engine/host_tier.py) reports, besides its
pool's events, `stored` / `removed` events with tier HOST: a pool block it
evicts is removed from the pool and stored in the host tier, and it can be
restored from there on a prefix hit, faster than recomputing it but not free.
The PrefixIndex keeps the pool's blocks only (device events), exactly as
before; this view keeps, per worker, a bit mask per block (pool, host) and a
second PrefixIndex over the union of both tiers, fed only for workers that
have reported a host-tier block. A worker's credit for a prompt is then

    device overlap + w * (union overlap - device overlap)

with w = policy.tier_weight(restore, recompute) from that worker's measured
restore and prefill times per block (its heartbeat's WorkerLoad), so a host
tier that restores no faster than recomputing earns nothing. Workers without
a host tier cost nothing here: no masks, no union entries, no credit entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from services.router.policy import TierOverlap, WorkerLoad, overlap_credit, tier_weight
from services.router.prefix_index import PrefixIndex, PrefixIndexConfig

DEVICE, HOST = 1, 2  # mask bits; the proto's KvTier values are 0 and 1


class TierView:
    def __init__(self, config: PrefixIndexConfig | None = None, device: PrefixIndex | None = None):
        self.union = PrefixIndex(config)
        self._masks: dict[str, dict[int, int]] = {}  # only workers with a host tier
        self._device = device  # the pool's index: seeds a worker's union at its first host block

    def has_tiers(self) -> bool:
        return bool(self._masks)

    def tracks(self, worker_id: str) -> bool:
        return worker_id in self._masks

    # ---- events (the router's edge calls these beside the PrefixIndex's) -------

    def stored(self, worker_id: str, parent: int | None, hashes: Sequence[int], host: bool) -> None:
        masks = self._masks.get(worker_id)
        if masks is None:
            if not host:
                return  # no host tier seen on this worker: the PrefixIndex alone knows it
            masks = self._masks[worker_id] = {}
            self._seed(worker_id, masks)
        bit = HOST if host else DEVICE
        fresh: list[int] = []
        run_parent = parent
        prev = parent
        for h in hashes:
            old = masks.get(h, 0)
            masks[h] = old | bit
            if old == 0:
                if not fresh:
                    run_parent = prev
                fresh.append(h)
            elif fresh:  # a block the union has: flush the run before it
                self.union.apply_stored(worker_id, run_parent, fresh)
                fresh = []
            prev = h
        if fresh:
            self.union.apply_stored(worker_id, run_parent, fresh)

    def _seed(self, worker_id: str, masks: dict[int, int]) -> None:
        """A worker's first host-tier block: its pool blocks so far join the union."""
        device = self._device
        if device is None:
            return
        provisional = device._provisional.get(worker_id, {})
        for h in device._held.get(worker_id, ()):
            if h not in provisional:
                masks[h] = DEVICE
                self.union.apply_stored(worker_id, device._nodes[h].parent, [h])

    def removed(self, worker_id: str, hashes: Iterable[int], host: bool) -> None:
        masks = self._masks.get(worker_id)
        if masks is None:
            return
        bit = HOST if host else DEVICE
        gone = []
        for h in hashes:
            old = masks.get(h)
            if old is None:
                continue
            new = old & ~bit
            if new:
                masks[h] = new
            else:
                del masks[h]
                gone.append(h)
        if gone:
            self.union.apply_removed(worker_id, gone)

    def clear(self, worker_id: str) -> None:
        if self._masks.pop(worker_id, None) is not None:
            self.union.clear(worker_id)

    def snapshot(self, worker_id: str, chains: Iterable[tuple[int | None, Sequence[int], bool]]) -> None:
        """Replace `worker_id`'s tiers by a snapshot's (parent, hashes, is_host) chains."""
        chains = list(chains)
        self.clear(worker_id)
        if not any(host for _, _, host in chains):
            return
        self._masks[worker_id] = {}  # not seeded: the snapshot has the pool's blocks too
        for parent, hashes, host in chains:
            if not host:
                self.stored(worker_id, parent, hashes, host=False)
        for parent, hashes, host in chains:
            if host:
                self.stored(worker_id, parent, hashes, host=True)

    # ---- scoring -----------------------------------------------------------------

    def credits(
        self, hashes: Sequence[int], overlaps: Mapping[str, int], loads: Mapping[str, WorkerLoad]
    ) -> dict[str, float]:
        """Worker id -> overlap credit over both tiers, for the workers with a host
        tier whose union match goes past their device overlap (others: absent,
        so the policy uses their device overlap)."""
        if not self._masks:
            return {}
        out: dict[str, float] = {}
        for wid, total in self.union.match(hashes).items():
            device = overlaps.get(wid, 0)
            if total <= device:
                continue
            load = loads.get(wid)
            weight = host_weight(load) if load is not None else 0.0
            out[wid] = overlap_credit([TierOverlap(device, 1.0), TierOverlap(total - device, weight)])
        return out


class TieredPrefixIndex(PrefixIndex):
    """The router's PrefixIndex (pool blocks, unchanged) with a TierView beside it:
    clearing a worker (resync, removal) clears both, and `tier_credits` scores the
    host tier for the policy."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        super().__init__(config)
        self.tiers = TierView(config, device=self)

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
