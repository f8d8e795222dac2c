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
per chunk of `CHUNK` blocks, keyed by the chunk's own bytes: the chain's digest
before the chunk + the chunk's tokens as little-endian u32 (1,032 bytes). One
packing of the tokens, one dict lookup (SipHash of the key, then an exact
compare) and one unpack then give 16 block hashes.

Trust: the key is the input itself, so a hit is exact: no prompt can be made
to read another prompt's hashes, whatever it contains (until session 26 the
key was a 16-byte BLAKE2b of the same bytes, collision resistant, and its
call was 11% of the warm match's py-spy samples). Python's dict hashes bytes with SipHash under a per-process
random key, so crafted keys cannot pile onto one slot. What the router does with
the hashes is a routing hint (which worker to try), never the engines' cache
identity, which each engine computes from the tokens itself.

Memory: per chunk the 1,032-byte key and 8 x CHUNK bytes of hashes, about
1.3 KiB with the ordered dict's share (~80 B per block; 5 B per prompt token);
`max_chunks` bounds it (LRU): 32,768 chunks by default, 8.4M tokens of prompts
in about 42 MiB.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from services.model.hashing import ROOT_HASH, BlockHashChain, _packer, _u32_bytes

CHUNK = 16  # blocks per memo entry


class HashMemo:
    """Chunk key (parent digest + the chunk's token bytes) -> the chunk's block digests
    (8 bytes each, concatenated), LRU-bounded."""

    def __init__(self, max_chunks: int = 1 << 15):
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._map: OrderedDict[bytes, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def digests(self, key: bytes, block_size: int) -> bytes:
        """The block digests of the chunk `key` names: kept ones (a hit), else computed
        (`_chain`) and kept, the least recently used one going past `max_chunks`."""
        m = self._map
        d = m.get(key)
        if d is not None:
            m.move_to_end(key)
            self.hits += 1
            return d
        self.misses += 1
        d = m[key] = _chain(key, block_size)
        if len(m) > self.max_chunks:
            m.popitem(last=False)
        return d

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
        if upto > len(self._hashes):
            for _ in self.chunks(start=len(self._hashes)):
                if len(self._hashes) >= upto:
                    break

    def chunks(self, size: int = CHUNK, start: int = 0) -> Iterator[Sequence[int]]:
        """As `BlockHashChain.chunks`; for `size` = CHUNK each whole chunk comes from the
        memo (or is computed into it) as it is reached, with no method call per chunk (the
        routing decision's walk), and blocks off the chunk grid or in the trailing part-chunk
        are hashed directly."""
        if size != CHUNK:
            yield from super().chunks(size, start)
            return
        hashes, n, bs = self._hashes, self._n, self._bs
        full_end, span = (n // CHUNK) * CHUNK, bs * CHUNK
        tokens, digests_of = self._tokens, self._memo.digests
        unpack, pack = _UNPACK[CHUNK], _packer(span)
        i = start  # hashes yielded
        while i < n:
            if i < len(hashes):  # computed already (before, or by a read in between)
                j = min(len(hashes), i + CHUNK) if i % CHUNK else len(hashes)
                yield hashes[i:j]
                i = j
            elif i % CHUNK or i >= full_end:  # to the next chunk boundary (or the end), directly
                BlockHashChain._extend(self, min(n, (i // CHUNK + 1) * CHUNK))
            else:
                t = i * bs
                part = tokens[t : t + span]
                try:
                    key = self._parent + pack(*part)
                except struct.error:  # out of range or not an int: raise as _u32_bytes does
                    key = self._parent + _u32_bytes(part)
                digests = digests_of(key, bs)
                block = unpack(digests)
                hashes += block
                self._parent = digests[-8:]
                i += CHUNK
                yield block


def prompt_chain(tokens: Sequence[int], block_size: int, memo: HashMemo | None) -> BlockHashChain:
    """The lazy block-hash chain of a prompt the router routes: through `memo` when the router
    keeps one (a prefix it routed before costs a lookup per chunk), else hashed directly."""
    if memo is not None:
        return MemoHashChain(tokens, block_size, memo)
    return BlockHashChain(tokens, block_size)


def _chain(chunk: bytes, block_size: int) -> bytes:
    """The block digests of `chunk` = parent digest (8 bytes) + token bytes, concatenated."""
    step, b2 = 4 * block_size, hashlib.blake2b
    p = chunk[:8]
    out = []
    for off in range(8, len(chunk), step):
        p = b2(p + chunk[off : off + step], digest_size=8).digest()
        out.append(p)
    return b"".join(out)
