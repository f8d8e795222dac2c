"""Helpers for tests and benchmarks (never used by the services).

`BlockPool` is a trivial free-list allocator standing in for the engine's
block manager, so tests can assert that every block returns to the pool after
every scenario, faults included. `fill_blocks` / `expected_block` give each
block deterministic pseudo-random bytes derived from (seed, block id), so a
receiver can check what it got without talking to the holder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from kvtransfer.pool import PoolView


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = set(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """The n lowest free ids (contiguous when the pool is not fragmented)."""
        if n > len(self._free):
            raise RuntimeError(f"want {n} blocks, {len(self._free)} free")
        ids = sorted(self._free)[:n]
        self._free.difference_update(ids)
        return ids

    def take(self, ids: Iterable[int]) -> list[int]:
        """Allocate exactly these ids (to build scattered lists)."""
        ids = list(ids)
        missing = [b for b in ids if b not in self._free]
        if missing:
            raise RuntimeError(f"blocks {missing} are not free")
        self._free.difference_update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        double = [b for b in ids if b in self._free or not 0 <= b < self.num_blocks]
        if double:
            raise RuntimeError(f"blocks {double} freed twice or out of range")
        self._free.update(ids)


def _block_generator(seed: int, block_id: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + block_id) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def expected_block(block_bytes: int, seed: int, block_id: int) -> bytes:
    t = torch.empty(block_bytes, dtype=torch.uint8)
    t.random_(0, 256, generator=_block_generator(seed, block_id))
    return t.numpy().tobytes()


def fill_blocks(pool: PoolView, seed: int, block_ids: Iterable[int] | None = None) -> None:
    """Give each block its deterministic content for `seed` (CPU pools)."""
    flat = pool.pool.view(torch.uint8).reshape(pool.num_blocks, pool.block_bytes)
    for b in range(pool.num_blocks) if block_ids is None else block_ids:
        flat[b].random_(0, 256, generator=_block_generator(seed, b))


def checksum(pool: PoolView, block_ids: Sequence[int]) -> str:
    """sha256 of the concatenated bytes of `block_ids`, in order."""
    h = hashlib.sha256()
    for mv in pool.read(block_ids, 0, len(block_ids) * pool.block_bytes):
        h.update(mv)
    return h.hexdigest()


def expected_checksum(block_bytes: int, seed: int, block_ids: Sequence[int]) -> str:
    h = hashlib.sha256()
    for b in block_ids:
        h.update(expected_block(block_bytes, seed, b))
    return h.hexdigest()
