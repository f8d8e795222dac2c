"""Byte-level access to one KV pool tensor, for the transports.

A pool is [num_blocks, *layout.block_shape], contiguous, so block `b` is the
byte range [b * block_bytes, (b + 1) * block_bytes) of the pool's memory. A
transfer addresses "the concatenation of a list of blocks" (the handle's blocks
in token order); `segments` maps a byte range of that concatenation onto byte
ranges of the pool, merging physically adjacent blocks so a contiguous block
list costs one range, not one per block.

`PoolView` does not own the pool or decide which blocks are free: the engine
(or a test's BlockPool) does. It only reads and writes bytes where told.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtransfer.layout import KvLayout

if TYPE_CHECKING:
    import torch


class PoolView:
    def __init__(self, pool: torch.Tensor, layout: KvLayout):
        import torch

        layout.check_pool(pool)
        self.pool = pool
        self.layout = layout
        self.num_blocks = int(pool.shape[0])
        self.block_bytes = layout.block_bytes
        self.is_cuda = pool.device.type == "cuda"
        self.memory_type = "VRAM" if self.is_cuda else "DRAM"
        self.device_id = (pool.device.index or 0) if self.is_cuda else 0
        self.base_address = pool.data_ptr()
        # [num_blocks * block_bytes] uint8, aliasing the pool's memory (no copy).
        self._bytes = pool.view(torch.uint8).reshape(-1)
        self._np = None if self.is_cuda else self._bytes.numpy()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block_regions(self, block_ids: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
        """(address, length, device id) of each block, as NIXL descriptors want them."""
        ids = range(self.num_blocks) if block_ids is None else block_ids
        bb = self.block_bytes
        return [(self.base_address + b * bb, bb, self.device_id) for b in ids]

    def segments(self, block_ids: Sequence[int], offset: int, length: int) -> list[tuple[int, int]]:
        """Pool byte ranges [start, end) holding bytes [offset, offset + length)
        of the concatenation of `block_ids`, adjacent ranges merged."""
        bb = self.block_bytes
        if offset < 0 or length < 0 or offset + length > len(block_ids) * bb:
            raise ValueError(
                f"range [{offset}, {offset + length}) is outside {len(block_ids)} blocks of {bb} bytes"
            )
        out: list[tuple[int, int]] = []
        pos, end = offset, offset + length
        while pos < end:
            i, within = divmod(pos, bb)
            take = min(bb - within, end - pos)
            start = block_ids[i] * bb + within
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], start + take)
            else:
                out.append((start, start + take))
            pos += take
        return out

    def read(self, block_ids: Sequence[int], offset: int, length: int) -> list[memoryview]:
        """Views (no copy on CPU) of the bytes [offset, offset + length) of the blocks."""
        if self._np is not None:
            return [memoryview(self._np[a:b]) for a, b in self.segments(block_ids, offset, length)]
        # VRAM: gRPC needs host bytes, so each range is staged through host memory.
        return [
            memoryview(self._bytes[a:b].cpu().numpy()) for a, b in self.segments(block_ids, offset, length)
        ]

    def write(self, block_ids: Sequence[int], offset: int, data: memoryview | bytes) -> None:
        """Copy `data` into the bytes [offset, offset + len(data)) of the blocks."""
        import numpy as np

        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        for a, b in self.segments(block_ids, offset, len(src)):
            n = b - a
            if self._np is not None:
                self._np[a:b] = src[pos : pos + n]
            else:
                import torch

                self._bytes[a:b].copy_(torch.from_numpy(src[pos : pos + n].copy()), non_blocking=False)
            pos += n

    def block_bytes_of(self, block_id: int) -> bytes:
        """A copy of one block's bytes (checksums, tests)."""
        bb = self.block_bytes
        return bytes(self._bytes[block_id * bb : (block_id + 1) * bb].cpu().numpy())
