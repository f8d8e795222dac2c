"""services/model/hashing.py: the faster block_hashes and the lazy BlockHashChain
give exactly the documented chain (BLAKE2b-8 over parent u64 LE + tokens u32 LE)."""

import hashlib
import random
import struct

import numpy as np
import pytest

from services.model.hashing import BlockHashChain, block_hashes, hash_block


def reference(tokens, bs, parent=0):
    out = []
    for s in range(0, len(tokens) - bs + 1, bs):
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<Q", parent))
        h.update(struct.pack(f"<{bs}I", *tokens[s : s + bs]))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


@pytest.mark.parametrize("n", [0, 3, 16, 17, 100, 4096])
def test_block_hashes_equal_the_definition(n):
    rng = random.Random(n)
    tokens = [rng.randrange(1 << 32) for _ in range(n)]
    assert block_hashes(tokens, 16) == reference(tokens, 16)
    assert block_hashes(tuple(tokens), 16) == reference(tokens, 16)
    assert block_hashes(np.array(tokens, dtype=np.int64), 16) == reference(tokens, 16)
    assert block_hashes(tokens, 16, parent=12345) == reference(tokens, 16, 12345)
    assert list(BlockHashChain(tokens, 16)) == reference(tokens, 16)
    assert BlockHashChain(tokens, 16, parent=12345).all() == reference(tokens, 16, 12345)


def test_hash_block_is_one_link_of_the_chain():
    tokens = list(range(32))
    h = block_hashes(tokens, 16)
    assert hash_block(0, tokens[:16]) == h[0] and hash_block(h[0], tokens[16:]) == h[1]


def test_the_chain_computes_only_what_is_read():
    tokens = list(range(160))
    ref = reference(tokens, 16)
    c = BlockHashChain(tokens, 16)
    assert len(c) == 10 and c.computed == 0
    assert c[2] == ref[2] and c.computed == 3
    assert c[-1] == ref[-1] and c.computed == 10
    c = BlockHashChain(tokens, 16)
    assert c[1:4] == ref[1:4] and c.computed == 4
    assert c[::-1] == ref[::-1]
    with pytest.raises(IndexError):
        c[10]
    it = iter(BlockHashChain(tokens, 16))
    assert next(it) == ref[0]


def test_bad_input_is_refused_like_before():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        BlockHashChain([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(OverflowError):
        BlockHashChain([1 << 32] * 16, 16).all()


@pytest.mark.parametrize("n", [0, 15, 16, 17, 255, 256, 257, 1000])
def test_chunks_are_the_hashes_in_order_and_computed_as_reached(n):
    tokens = list(range(n))
    ref = reference(tokens, 16)
    assert [h for part in BlockHashChain(tokens, 16).chunks() for h in part] == ref
    c = BlockHashChain(tokens, 16)
    parts = c.chunks(4)
    first = next(parts, [])
    assert list(first) == ref[:4] and c.computed == len(first)  # nothing past the first list
    if len(ref) > 6:
        assert c[6] == ref[6]  # a read in between: the walk goes on from where it was
    assert list(first) + [h for part in parts for h in part] == ref


def test_chunks_from_a_start_index():
    tokens = list(range(16 * 40))
    ref = reference(tokens, 16)
    c = BlockHashChain(tokens, 16)
    assert [h for part in c.chunks(8, start=0) for h in part][:3] == ref[:3]
    assert [h for part in BlockHashChain(tokens, 16).chunks(8, start=5) for h in part] == ref[5:]
