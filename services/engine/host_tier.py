"""HostTier: a second, larger KV pool that keeps what the engine's pool evicts.

When the BlockManager evicts a cached block to reuse its slot, the block's KV is
offered here, keyed by its chain hash. A later prompt whose chain goes on past
the pool's own hits gets those blocks restored into fresh pool blocks instead
of recomputed, when restoring is predicted to be faster (`TierCost`).

Bounded in blocks (its byte budget / the layout's block bytes); storage is one
preallocated tensor in the pool's own block layout, so offload and restore are
indexed copies and a quantized pool's in-block scales travel with the data.
Eviction is LRU. Admission has a frequency filter (TinyLFU; Dynamo's KVBM
filters by frequency before writing to a slower tier): when the tier is full,
a candidate displaces the LRU entry only if its hash has been used at least as
often, so a scan of single-use prompts cannot flush the blocks that keep
getting hit. Uses are counted per hash in a bounded table that halves every
count when it fills (aging), so old popularity fades.

Engine step thread only (like the BlockManager's writers); `stats()` may be
read from other threads (plain ints).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.attention import kv_qmax, quantize_kv


@dataclass(frozen=True)
class HostTierStats:
    capacity_blocks: int
    blocks: int  # held now
    block_bytes: int
    offered: int  # lifetime: evicted pool blocks offered
    stored: int  # lifetime: admitted
    rejected: int  # lifetime: refused by the frequency filter
    evicted: int  # lifetime: dropped to make room (LRU)
    restored_blocks: int  # lifetime: copied back into the pool

    @property
    def bytes(self) -> int:
        return self.blocks * self.block_bytes


class HostTier:
    """`quant="int8"` / `"fp8"` (a full-precision pool's blocks, [L, 2, bs, Hkv, Dh]): the tier
    stores 1-byte values with one float32 scale per block, layer, K/V and head (absmax / 127 or
    / 448, the pool's own int8 / fp8 scheme: attention.quantize_kv) and dequantizes on restore,
    so the same bytes hold 2x (bf16) or ~4x (float32) the blocks; `block_bytes` is then the
    quantized block's. A restored block is not bit-identical to the one offloaded: its error is
    the pool scheme's (bench/quant_accuracy.py kv-int8 / kv-fp8)."""

    def __init__(
        self,
        capacity_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        block_bytes: int,
        quant: str = "none",
    ):
        if capacity_blocks <= 0:
            raise ValueError(f"HostTier capacity_blocks must be positive, got {capacity_blocks}")
        if quant not in ("none", "int8", "fp8"):
            raise ValueError(f"HostTier quant must be none, int8 or fp8, got {quant!r}")
        if quant != "none" and (len(block_shape) != 5 or not dtype.is_floating_point):
            raise ValueError(
                "a quantized host tier needs a full-precision pool of [L, 2, bs, Hkv, Dh] blocks"
            )
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.quant, self.dtype = quant, dtype
        if quant == "none":
            self.pool = torch.empty((capacity_blocks, *block_shape), dtype=dtype)
        else:
            # fp8 values are kept as their bytes: torch's CPU index_copy_ has no float8 kernel
            self.values_dtype = torch.int8 if quant == "int8" else torch.float8_e4m3fn
            self.pool = torch.empty((capacity_blocks, *block_shape), dtype=torch.int8)
            layers, kv, _, heads, _ = block_shape
            self.scales = torch.empty((capacity_blocks, layers, kv, heads), dtype=torch.float32)
        # hash -> (slot, parent hash); order = LRU (oldest first).
        self._entries: OrderedDict[int, tuple[int, int | None]] = OrderedDict()
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._uses: dict[int, int] = {}
        self._uses_cap = 8 * capacity_blocks
        self.offered = self.stored = self.rejected = self.evicted = self.restored_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    # ---- frequency -----------------------------------------------------------

    def record_use(self, block_hashes: list[int]) -> None:
        """Count a use (a hit in any tier, or a store) of each block."""
        uses = self._uses
        for h in block_hashes:
            uses[h] = uses.get(h, 0) + 1
        if len(uses) > self._uses_cap:  # age: halve, forget the ones that reach 0
            self._uses = {h: n // 2 for h, n in uses.items() if n > 1}

    def uses(self, block_hash: int) -> int:
        return self._uses.get(block_hash, 0)

    # ---- offload ---------------------------------------------------------------

    def offer(self, blocks: list[tuple[int, int | None]], data: torch.Tensor) -> tuple[list[int], list[int]]:
        """Offer evicted pool blocks [(hash, parent)] with their KV `data` [n, *block_shape].

        Returns (hashes stored, hashes evicted from this tier to make room)."""
        stored: dict[int, None] = {}  # ordered set
        evicted: list[int] = []
        pending: dict[int, int] = {}  # slot -> row of `data` to copy there
        entries, free = self._entries, self._free_slots
        uses = self._uses.get  # inlined self.uses: this loop runs once per evicted pool block
        rejected = 0
        for i, (h, parent) in enumerate(blocks):
            if h in entries:  # already here (restored earlier, evicted again): refresh
                entries.move_to_end(h)
                continue
            if not free:
                victim = next(iter(entries))
                if uses(h, 0) < uses(victim, 0):
                    rejected += 1
                    continue
                slot, _ = entries.pop(victim)
                free.append(slot)
                if victim in stored:  # offered in this same batch: never copied, never reported
                    del stored[victim]
                    del pending[slot]
                else:
                    evicted.append(victim)
            slot = free.pop()
            entries[h] = (slot, parent)
            stored[h] = None
            pending[slot] = i
        self.rejected += rejected
        self.offered += len(blocks)
        self.evicted += len(evicted)
        self.stored += len(stored)
        if pending:  # one indexed copy (index_copy_: pool[idx] = ... is far slower on many-dim tensors)
            slots, rows = list(pending), list(pending.values())
            src = (
                data
                if rows == list(range(len(blocks)))
                else data.index_select(0, torch.tensor(rows, dtype=torch.long))
            )
            idx = torch.tensor(slots, dtype=torch.long)
            if self.quant == "none":
                self.pool.index_copy_(0, idx, src)
            else:
                values, scales = self._quantize(src)
                self.pool.index_copy_(0, idx, values.view(torch.int8))
                self.scales.index_copy_(0, idx, scales)
        return list(stored), evicted

    def _quantize(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = data.float()  # [n, L, 2, bs, Hkv, Dh]
        qmax = kv_qmax(self.values_dtype)
        scales = (x.abs().amax(dim=(3, 5)) / qmax).clamp(min=1e-12)  # [n, L, 2, Hkv]
        return quantize_kv(x, scales[:, :, :, None, :, None], self.values_dtype), scales

    # ---- restore ---------------------------------------------------------------

    def match(self, block_hashes: list[int]) -> int:
        """How many leading hashes of `block_hashes` this tier holds."""
        n = 0
        for h in block_hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def touch(self, block_hashes: list[int]) -> None:
        """Mark held blocks most recently used."""
        for h in block_hashes:
            if h in self._entries:
                self._entries.move_to_end(h)

    def read(self, block_hashes: list[int]) -> torch.Tensor:
        """A copy of the KV of `block_hashes` (all held here), marked recently used."""
        slots = []
        for h in block_hashes:
            slot, _ = self._entries[h]
            self._entries.move_to_end(h)
            slots.append(slot)
        self.restored_blocks += len(slots)
        idx = torch.tensor(slots, dtype=torch.long)
        if self.quant == "none":
            return self.pool.index_select(0, idx)
        scales = self.scales.index_select(0, idx)[:, :, :, None, :, None]
        values = self.pool.index_select(0, idx).view(self.values_dtype)
        return (values.float() * scales).to(self.dtype)

    def pairs(self) -> list[tuple[int | None, int]]:
        """(parent, hash) of every block held."""
        return [(parent, h) for h, (_, parent) in self._entries.items()]

    def clear(self) -> list[int]:
        """Drop everything; returns the hashes dropped."""
        dropped = list(self._entries)
        self._entries.clear()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        return dropped

    def stats(self) -> HostTierStats:
        return HostTierStats(
            capacity_blocks=self.capacity_blocks,
            blocks=len(self._entries),
            block_bytes=self.block_bytes,
            offered=self.offered,
            stored=self.stored,
            rejected=self.rejected,
            evicted=self.evicted,
            restored_blocks=self.restored_blocks,
        )


class TierCost:
    """Is restoring k blocks from the host tier faster than recomputing them?

    Both sides are measured: restore seconds per block (an EWMA of the engine's
    own restores) and prefill seconds per token (an EWMA over the steps that
    computed prompt tokens). A runner that models time (the sim engine) gives
    both from its profile instead (`modeled`). Until a prefill has been
    measured the restore is taken (a copy is cheap next to any forward pass on
    every backend here; the first measurements then decide). The same ratio,
    restore over recompute time per token, is the host tier's credit for the
    router (`credit`).
    """

    def __init__(self, block_size: int, alpha: float = 0.2):
        self.block_size = block_size
        self.alpha = alpha
        self.restore_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self.declined = 0  # lifetime: restores not taken (slower than recompute)

    def observe_restore(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.restore_s_per_block = _ewma(self.restore_s_per_block, seconds / blocks, self.alpha)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / tokens, self.alpha)

    def restore_s(self, blocks: int) -> float:
        return (self.restore_s_per_block or 0.0) * blocks

    def recompute_s(self, blocks: int, context_tokens: int, rest_tokens: int) -> float:
        """Time saved by not computing `blocks` blocks that follow `context_tokens`
        cached ones, with `rest_tokens` of the prompt to compute after them anyway."""
        if self.prefill_s_per_token is None:
            return float("inf")
        return self.prefill_s_per_token * blocks * self.block_size

    def worth_restoring(self, blocks: int, context_tokens: int, rest_tokens: int) -> bool:
        ok = self.restore_s(blocks) < self.recompute_s(blocks, context_tokens, rest_tokens)
        if not ok:
            self.declined += 1
        return ok

    def credit(self) -> float:
        """Host-tier overlap credit in [0, 1] for the router's scoring: the share
        of a block's recompute time that restoring it saves (1 - restore / recompute)."""
        recompute = self.recompute_s(1, 0, 0)
        if recompute == float("inf"):
            return 1.0
        if recompute <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.restore_s(1) / recompute))


class ModeledTierCost(TierCost):
    """TierCost from a timing model (the sim engine): restore = the blocks' bytes
    at the host link's bandwidth; recompute = what the prompt pass costs with
    those tokens minus without them, from the profile's prefill_ms(T, C)."""

    def __init__(
        self, block_size: int, restore_s_per_block: float, prefill_ms: Callable[[int, float], float]
    ):
        super().__init__(block_size)
        self.restore_s_per_block = restore_s_per_block
        self._prefill_ms = prefill_ms
        self.prefill_s_per_token = prefill_ms(block_size, 0) / 1000.0 / block_size  # for credit()

    def observe_restore(self, blocks: int, seconds: float) -> None:  # modeled: nothing to learn
        pass

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass

    def recompute_s(self, blocks: int, context_tokens: int, rest_tokens: int) -> float:
        k = blocks * self.block_size
        rest = max(rest_tokens, 1)  # the last prompt token is always computed
        with_recompute = self._prefill_ms(rest + k, context_tokens)
        with_restore = self._prefill_ms(rest, context_tokens + k)
        return max(0.0, with_recompute - with_restore) / 1000.0


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)
