"""Chained prefix-block hashes, shared by the router and every engine.

h(0) = H(ROOT, tokens of block 0), h(i) = H(h(i-1), tokens of block i), over
full blocks only. Two sequences share the KV of block i exactly when they share
h(i), so the router can match a prompt against a worker's cached blocks without
seeing tokens. H is BLAKE2b with an 8-byte digest over the parent hash
(little-endian u64) and the block's token ids (little-endian u32).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

# Parent of the first block of every prompt.
ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `tokens` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = np.asarray(tokens, dtype="<u4")
    out: list[int] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<Q", parent))
        h.update(arr[start : start + block_size].tobytes())
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
