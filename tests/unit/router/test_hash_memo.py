"""The router's hash memo gives exactly the engines' block hashes, hashing each chunk once."""

import random

import pytest

from services.model.hashing import block_hashes
from services.router.hash_memo import CHUNK, HashMemo, MemoHashChain

BS = 16


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1 << 32) for _ in range(n)]


@pytest.mark.parametrize("tokens", [0, 15, 16, 17, BS * CHUNK - 1, BS * CHUNK, BS * CHUNK * 3 + 5 * BS + 7])
def test_the_hashes_are_the_engines(tokens):
    toks = prompt(tokens)
    memo = HashMemo()
    want = block_hashes(toks, BS)
    assert MemoHashChain(toks, BS, memo).all() == want
    assert list(MemoHashChain(toks, BS, memo)) == want  # again, from the memo
    assert len(MemoHashChain(toks, BS, memo)) == len(want)


def test_a_shared_prefix_is_hashed_once_and_the_rest_lazily():
    memo = HashMemo()
    base = prompt(BS * CHUNK * 4)
    MemoHashChain(base, BS, memo).all()
    assert (memo.misses, len(memo)) == (4, 4)
    # The next turn: the same prefix plus more; reading 2 chunks deep costs 2 lookups, no new entry.
    turn = base + prompt(BS * CHUNK * 2, seed=1)
    chain = MemoHashChain(turn, BS, memo)
    assert chain[2 * CHUNK - 1] == block_hashes(turn, BS)[2 * CHUNK - 1]
    assert chain.computed == 2 * CHUNK and (memo.hits, len(memo)) == (2, 4)
    assert chain.all() == block_hashes(turn, BS)
    assert len(memo) == 6


def test_another_prefix_before_the_same_chunk_gets_its_own_hashes():
    """A chunk's hashes depend on everything before it: the key includes the parent digest."""
    memo = HashMemo()
    tail = prompt(BS * CHUNK, seed=2)
    a, b = prompt(BS * CHUNK, seed=3) + tail, prompt(BS * CHUNK, seed=4) + tail
    assert MemoHashChain(a, BS, memo).all() == block_hashes(a, BS)
    assert MemoHashChain(b, BS, memo).all() == block_hashes(b, BS)
    assert MemoHashChain(a, BS, memo).all() != MemoHashChain(b, BS, memo).all()


def test_the_memo_is_bounded_lru():
    memo = HashMemo(max_chunks=2)
    chains = [prompt(BS * CHUNK, seed=s) for s in range(3)]
    for c in chains:
        MemoHashChain(c, BS, memo).all()
    assert len(memo) == 2
    MemoHashChain(chains[0], BS, memo).all()  # evicted: recomputed, still right
    assert memo.misses == 4 and MemoHashChain(chains[0], BS, memo).all() == block_hashes(chains[0], BS)
    with pytest.raises(ValueError):
        HashMemo(0)


def test_out_of_range_tokens_still_raise_when_read():
    chain = MemoHashChain([1 << 32] * BS * CHUNK, BS, HashMemo())
    with pytest.raises(OverflowError):
        chain[0]


@pytest.mark.parametrize("tokens", [0, BS * CHUNK - 1, BS * CHUNK, BS * CHUNK * 3 + 5 * BS + 7])
def test_chunks_walk_gives_the_engines_hashes_cold_and_warm(tokens):
    toks = prompt(tokens)
    want = block_hashes(toks, BS)
    memo = HashMemo()
    for _ in range(2):  # cold, then from the memo
        assert [h for part in MemoHashChain(toks, BS, memo).chunks() for h in part] == want
    assert memo.hits == memo.misses == tokens // (BS * CHUNK)
    # Reads in between: the walk yields each hash once, in order.
    chain = MemoHashChain(toks, BS, memo)
    got = []
    for part in chain.chunks():
        got += part
        if len(want) > len(got) + 3:
            assert chain[len(got) + 3] == want[len(got) + 3]
    assert got == want


def test_a_chunk_differing_in_its_last_token_is_not_a_hit():
    """The key is the chunk's bytes themselves: one token anywhere in it makes another key."""
    memo = HashMemo()
    a = prompt(BS * CHUNK)
    b = [*a[:-1], a[-1] ^ 1]
    assert MemoHashChain(a, BS, memo).all() == block_hashes(a, BS)
    assert MemoHashChain(b, BS, memo).all() == block_hashes(b, BS)
    assert (memo.hits, memo.misses) == (0, 2)


def test_out_of_range_tokens_raise_through_the_walk_too():
    for bad in ([1 << 32] * BS * CHUNK, [-1] * BS * CHUNK):
        with pytest.raises(OverflowError):
            next(MemoHashChain(bad, BS, HashMemo()).chunks())
    with pytest.raises(TypeError):
        next(MemoHashChain([1.5] * BS * CHUNK, BS, HashMemo()).chunks())


def test_the_index_walk_hashes_one_chunk_past_the_last_match_at_most():
    from services.router.prefix_index import PrefixIndex

    toks = prompt(BS * CHUNK * 8)
    hashes = block_hashes(toks, BS)
    idx = PrefixIndex()
    idx.apply_stored("w1", None, hashes[: CHUNK + 3])
    memo = HashMemo()
    for _ in range(2):  # cold, then warm
        chain = MemoHashChain(toks, BS, memo)
        assert idx.match(chain) == {"w1": CHUNK + 3}
        assert chain.computed == 2 * CHUNK < len(chain)


def test_a_chain_pushed_off_the_chunk_grid_realigns_and_uses_the_memo_again():
    from services.model.hashing import BlockHashChain

    toks = prompt(BS * CHUNK * 3)
    memo = HashMemo()
    MemoHashChain(toks, BS, memo).all()
    chain = MemoHashChain(toks, BS, memo)
    BlockHashChain._extend(chain, 5)  # 5 blocks hashed directly, off the grid
    hits = memo.hits
    assert chain.all() == block_hashes(toks, BS)
    assert memo.hits == hits + 2  # the first chunk's rest directly, then two memo chunks
