"""KvEventMapper: TensorRT-LLM event dicts become pdmesh's chained block hashes."""

from __future__ import annotations

from services.engine.api import KvEventKind
from services.engine.trtllm.kv_events import KvEventMapper
from services.model.hashing import block_hashes

BS = 4


def stored(parent, blocks):
    return {
        "event_id": 1,
        "window_size": 64,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": h,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
                    "cache_level": 0,
                    "priority": 35,
                }
                for h, toks in blocks
            ],
        },
    }


def removed(hashes):
    return {"event_id": 2, "window_size": 64, "data": {"type": "removed", "block_hashes": hashes}}


TOKENS = list(range(10, 22))  # 3 full blocks


def test_stored_chain_in_two_events_gets_pdmesh_hashes_of_the_tokens():
    m = KvEventMapper(BS, 64)
    m.apply({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}})
    m.apply(stored(None, [(901, TOKENS[0:4]), (902, TOKENS[4:8])]))
    m.apply(stored(902, [(903, TOKENS[8:12])]))
    want = block_hashes(TOKENS, BS)
    events = m.log.since(0)
    assert [e.kind for e in events] == [KvEventKind.STORED, KvEventKind.STORED]
    assert events[0].parent_hash is None and list(events[0].block_hashes) == want[:2]
    assert events[1].parent_hash == want[1] and list(events[1].block_hashes) == want[2:]
    assert m.num_blocks == 100
    assert m.prefix_lookup([*TOKENS, 1, 2]) == 12
    assert m.prefix_lookup([*TOKENS[:4], 99, 99, 99, 99]) == 4
    assert sorted(m.snapshot()[1], key=str) == sorted(
        [(None, want[0]), (want[0], want[1]), (want[1], want[2])], key=str
    )


def test_removed_translates_known_hashes_and_ignores_unknown_ones():
    m = KvEventMapper(BS, 64)
    m.apply(stored(None, [(901, TOKENS[0:4]), (902, TOKENS[4:8])]))
    m.apply(removed([902, 555]))
    last = m.log.since(1)
    assert len(last) == 1 and last[0].kind is KvEventKind.REMOVED
    assert list(last[0].block_hashes) == [block_hashes(TOKENS, BS)[1]]
    assert m.prefix_lookup(TOKENS) == 4


def test_chain_with_unseen_parent_and_partial_blocks_are_skipped():
    m = KvEventMapper(BS, 64)
    m.apply(stored(777, [(903, TOKENS[8:12])]))  # parent never seen: hashes cannot be rebuilt
    m.apply(stored(None, [(901, TOKENS[0:4]), (904, TOKENS[4:6])]))  # second block partial
    assert m.skipped == 2
    events = m.log.since(0)
    assert len(events) == 1 and list(events[0].block_hashes) == block_hashes(TOKENS, BS)[:1]


def test_same_block_under_two_engine_hashes_is_removed_only_when_both_are():
    m = KvEventMapper(BS, 64)
    m.apply(stored(None, [(901, TOKENS[0:4])]))
    m.apply(stored(None, [(911, TOKENS[0:4])]))  # e.g. another extra-id: same tokens
    m.apply(removed([901]))
    assert m.prefix_lookup(TOKENS) == 4
    m.apply(removed([911]))
    assert m.prefix_lookup(TOKENS) == 0
    assert m.log.since(0)[-1].kind is KvEventKind.REMOVED
