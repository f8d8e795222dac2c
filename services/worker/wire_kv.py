"""The staging pool of wire-only KV quantization (`--kv-wire-quant int8|fp8`).

The engine's cache stays in full precision; a handoff moves 1-byte blocks
(services/engine/kv_wire.py). The transports move bytes between pools of one
layout (kvtransfer/transport.py), so each worker with the option keeps a second,
small pool in the wire layout and the KV transport is published over that one:

  holder (prefill): export the held blocks from the engine, quantize them into
    staging blocks, free the engine's blocks (they stay in its prefix cache),
    and lease the staging blocks; the handle's layout is the wire layout, the
    digests are of the wire bytes, and the lease's end frees the staging blocks.
  receiver (decode): pull into staging blocks, then dequantize them into the
    blocks the engine reserved; the staging blocks are freed either way.

The staging pool has as many blocks as the engine's pool (a quarter of its bytes
for float32, half for bf16), so whatever the engine can hold for handoffs fits,
and allocation only fails when leases hold every block (the lease budget sheds
before that). Event-loop only, like the servicers that call it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer.layout import KvLayout
from kvtransfer.pool import PoolView
from services.engine.api import EngineCapacityError

if TYPE_CHECKING:
    import torch

# torch and the codec (services/engine/kv_wire.py, torch at import) load only when a staging pool is
# made: every worker main imports this module through services/worker/runtime.py, and one whose
# backend needs no torch (sim, trtllm) must not pay torch's import for an option it has off.

WIRE_SCHEMES = ("none", "int8", "fp8")


@dataclass
class WireCounters:
    staged_blocks: int = 0  # lifetime: blocks quantized for export
    unstaged_blocks: int = 0  # lifetime: blocks dequantized into the engine's pool


class WireStage:
    def __init__(self, engine_layout: KvLayout, scheme: str, num_blocks: int):
        from services.engine.kv_wire import wire_layout

        self.engine_layout = engine_layout
        self.layout = wire_layout(engine_layout, scheme)
        self.pool = self.layout.allocate_pool(num_blocks)
        self.view = PoolView(self.pool, self.layout)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.counters = WireCounters()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise EngineCapacityError(f"{n} wire staging blocks wanted, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        return ids

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    def _write(self, ids: list[int], blocks: torch.Tensor) -> None:
        import torch

        from services.engine.kv_wire import quantize_blocks

        self.pool.index_copy_(0, torch.tensor(ids, dtype=torch.long), quantize_blocks(blocks, self.layout))

    def _read(self, ids: list[int]) -> torch.Tensor:
        import torch

        from services.engine.kv_wire import dequantize_blocks

        packed = self.pool.index_select(0, torch.tensor(ids, dtype=torch.long))
        return dequantize_blocks(packed, self.layout)

    async def stage(self, engine, block_ids: Sequence[int]) -> list[int]:
        """Quantize the engine's `block_ids` into fresh staging blocks (returned, in order)."""
        ids = self.alloc(len(block_ids))
        try:
            blocks = await engine.export_blocks(list(block_ids))
        except BaseException:
            self.free(ids)
            raise
        # Off the event loop and the engine's step thread (torch releases the GIL): ~45 ms
        # of CPU for a 2,048-token `small` prompt here, which would stall every call served.
        write = asyncio.ensure_future(asyncio.to_thread(self._write, ids, blocks))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # the thread may still be writing these blocks: they are freed once it is done
            write.add_done_callback(lambda _: self.free(ids))
            raise
        except BaseException:
            self.free(ids)
            raise
        self.counters.staged_blocks += len(ids)
        return ids

    async def unstage(self, engine, wire_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Dequantize staging `wire_ids` into the engine's reserved `dst_block_ids` (pairwise).
        The staging blocks stay allocated: the caller frees them."""
        blocks = await asyncio.to_thread(self._read, list(wire_ids))
        await engine.import_blocks(list(dst_block_ids), blocks, self.engine_layout)
        self.counters.unstaged_blocks += len(wire_ids)
