"""The router's memo of prompt block hashes, so a decision rarely runs BLAKE2b per block.

Owns `HashMemo` (a bounded LRU map) and `MemoHashChain`, the router's lazy
chain of a prompt's block hashes. The hashes are exactly the engines' (services/
model/hashing.py: BLAKE2b per 16-token block, chained): the router's index is
keyed by what the workers report, and nothing about the engines' cache identity
changes here.

Why: one decision walks the prompt's blocks as deep as any worker holds them
(128 in bench/routing_decision.py), and one BLAKE2b call per block from Python
was over half of the decision. A prefix deep in the index was, in the common
case, routed by this router before (the conversation's previous turn, a
shared system prompt), so its hashes were computed before. The memo keeps them
per chunk of `CHUNK` blocks, keyed by a 16-byte BLAKE2b of (the chain's digest
before the chunk + the chunk's token bytes): one hash call over 1 KiB and one
dict lookup then give 16 block hashes.

Trust: the key is collision resistant (128-bit BLAKE2b over exactly the inputs
that determine the 16 hashes), so a crafted prompt cannot make the router
compute another prompt's hashes short of a 2^64 birthday search; and what the
router does with the hashes is a routing hint (which worker to try), never the
engines' cache identity, which each engine computes from the tokens itself.

Memory: per chunk a 16-byte key and 8 x CHUNK bytes of hashes, about 300 B
with the ordered dict's share (~19 B per block); `max_chunks` bounds it (LRU).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from services.model.hashing import ROOT_HASH, BlockHashChain, _u32_bytes

CHUNK = 16  # blocks per memo entry


class HashMemo:
    """Chunk key -> the chunk's block digests (8 bytes each, concatenated), LRU-bounded."""

    def __init__(self, max_chunks: int = 1 << 16):
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._map: OrderedDict[bytes, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> bytes | None:
        v = self._map.get(key)
        if v is not None:
            self._map.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
        return v

    def put(self, key: bytes, digests: bytes) -> None:
        m = self._map
        m[key] = digests
        m.move_to_end(key)
        if len(m) > self.max_chunks:
            m.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)


_UNPACK = {n: struct.Struct(f"<{n}Q").unpack for n in range(1, CHUNK + 1)}


class MemoHashChain(BlockHashChain):
    """`BlockHashChain` (same hashes, same laziness) that computes whole chunks of
    `CHUNK` blocks through a `HashMemo`; a trailing part-chunk is hashed directly."""

    __slots__ = ("_memo",)

    def __init__(self, tokens: Sequence[int], block_size: int, memo: HashMemo, parent: int = ROOT_HASH):
        super().__init__(tokens, block_size, parent)
        self._memo = memo

    def _extend(self, upto: int) -> None:
        hashes, bs, n = self._hashes, self._bs, self._n
        start = len(hashes)
        if upto <= start:
            return
        if start % CHUNK:  # not on a chunk boundary (cannot happen through this class alone)
            super()._extend(upto)
            return
        full_end = (n // CHUNK) * CHUNK  # blocks covered by whole chunks
        stop = min(-(-upto // CHUNK) * CHUNK, full_end)
        if stop > start:
            data = _u32_bytes(self._tokens[start * bs : stop * bs])
            step = 4 * bs * CHUNK
            b2, memo, unpack = hashlib.blake2b, self._memo, _UNPACK[CHUNK]
            p = self._parent
            for off in range(0, (stop - start) * 4 * bs, step):
                chunk = p + data[off : off + step]
                key = b2(chunk, digest_size=16).digest()
                digests = memo.get(key)
                if digests is None:
                    digests = _chain(chunk, bs)
                    memo.put(key, digests)
                hashes.extend(unpack(digests))
                p = digests[-8:]
            self._parent = p
        if upto > len(hashes):  # into the trailing part-chunk: plain hashing
            super()._extend(upto)


def _chain(chunk: bytes, block_size: int) -> bytes:
    """The block digests of `chunk` = parent digest (8 bytes) + token bytes, concatenated."""
    step, b2 = 4 * block_size, hashlib.blake2b
    p = chunk[:8]
    out = []
    for off in range(8, len(chunk), step):
        p = b2(p + chunk[off : off + step], digest_size=8).digest()
        out.append(p)
    return b"".join(out)
