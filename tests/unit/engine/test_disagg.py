"""Prefill on one engine, decode on another, KV blocks copied between them in-process."""

from __future__ import annotations

import pytest

from services.engine.api import (
    EngineCapacityError,
    EngineRequest,
    FinishReason,
    KvEventKind,
    UnknownRequestError,
)
from tests.unit.engine.conftest import assert_pool_restored, prompt_of, request

SEEDED = {"temperature": 0.8, "top_k": 20, "seed": 42}


def prefill_only(engine, req: EngineRequest):
    engine.add_request(req, prefill_only=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    return out, engine.held_kv(req.request_id)


def hand_over(prefill, decode, req: EngineRequest) -> list[int]:
    """The remote path: prefill-only on `prefill`, blocks copied, decode on `decode`."""
    first, held = prefill_only(prefill, req)
    res = decode.reserve_external(req)
    assert res.block_ids[: res.first_transfer_block] == tuple(
        decode.block_manager.match_prefix(decode.scheduler.remote[req.request_id], len(req.prompt_token_ids))
    )
    src = held.block_ids[res.first_transfer_block :]
    decode.import_blocks(res.transfer_block_ids, prefill.export_blocks(src), held.layout)
    assert prefill.release(req.request_id) and not prefill.release(req.request_id)
    out = decode.commit_external(req.request_id, first.token_ids[0])
    tokens = list(out.token_ids)
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.token_ids]
    return tokens


@pytest.mark.parametrize("sampling", [{}, SEEDED])
@pytest.mark.parametrize("length", [9, 16, 57])
def test_handover_yields_the_single_engine_tokens(make_engine, sampling, length):
    req = request("h", prompt_of(length, seed=length), max_tokens=20, **sampling)
    want = make_engine().generate([req])["h"]
    prefill, decode = make_engine(), make_engine()
    assert hand_over(prefill, decode, req) == want
    assert decode.stats().prompt_tokens_transferred == length
    assert prefill.stats().prompt_tokens_computed == length


def test_decode_reuses_its_own_cached_prefix(make_engine):
    shared = prompt_of(96, seed=1)
    warm = request("warm", shared + prompt_of(10, seed=2), max_tokens=3)
    req = request("h", shared + prompt_of(11, seed=3), max_tokens=16, **SEEDED)
    want = make_engine().generate([req])["h"]
    prefill, decode = make_engine(), make_engine()
    decode.generate([warm])
    res_prefix = decode.prefix_lookup(req.prompt_token_ids)
    assert res_prefix == 96
    assert hand_over(prefill, decode, req) == want
    # Only the 11 tokens past the cached 6 blocks came over the wire.
    assert decode.stats().prompt_tokens_transferred == 11
    # The committed prompt's full blocks are cached like locally computed ones.
    assert decode.prefix_lookup(req.prompt_token_ids) == 96


def test_commit_registers_transferred_blocks_and_emits_events(make_engine):
    req = request("h", prompt_of(50, seed=5), max_tokens=4)
    prefill, decode = make_engine(), make_engine()
    before = decode.kv_snapshot()[0]
    hand_over(prefill, decode, req)
    stored = [e for e in decode.kv_events_since(before) if e.kind is KvEventKind.STORED]
    assert stored[0].parent_hash is None and len(stored[0].block_hashes) == 3
    assert decode.prefix_lookup(req.prompt_token_ids) == 48


def test_held_blocks_are_cached_and_survive_pressure(make_engine):
    prefill = make_engine(num_blocks=12)
    req = request("held", prompt_of(40, seed=8), max_tokens=8)
    _, held = prefill_only(prefill, req)
    assert held.num_tokens == 40 and len(held.block_ids) == 3
    assert prefill.stats().held_blocks == 3 and prefill.prefix_lookup(req.prompt_token_ids) == 32
    kv = prefill.export_blocks(held.block_ids)
    # Fill the rest of the pool over and over: held blocks are neither evicted nor preempted.
    for i in range(4):
        prefill.generate([request(f"o{i}", prompt_of(60, seed=30 + i), max_tokens=40)])
    assert prefill.export_blocks(held.block_ids).equal(kv)
    assert prefill.stats().held_blocks == 3
    assert prefill.release("held")


def test_first_token_that_finishes_holds_nothing(make_engine):
    prefill = make_engine()
    out, held = prefill_only(prefill, request("one", prompt_of(20, seed=1), max_tokens=1))
    assert out.finished and out.finish_reason is FinishReason.LENGTH and held is None
    assert not prefill.release("one")


def test_commit_whose_first_token_finishes_frees_at_once(make_engine):
    decode = make_engine()
    decode.reserve_external(request("x", prompt_of(30, seed=2), max_tokens=1))
    out = decode.commit_external("x", 65)
    assert out.finished and out.token_ids == [65] and out.finish_reason is FinishReason.LENGTH
    assert_pool_restored(decode)


def test_reservation_errors_leak_nothing(make_engine):
    decode = make_engine(num_blocks=8)
    decode.reserve_external(request("a", prompt_of(100, seed=1), max_tokens=4))  # 7 of 8 blocks
    with pytest.raises(EngineCapacityError, match="1 free"):
        decode.reserve_external(request("big", prompt_of(60, seed=1), max_tokens=4))
    assert decode.stats().free_blocks == 1
    assert decode.cancel_external("a")
    assert_pool_restored(decode)
    with pytest.raises(UnknownRequestError):
        decode.commit_external("nope", 1)
    decode.reserve_external(request("r", prompt_of(20, seed=1), max_tokens=4))
    with pytest.raises(UnknownRequestError):
        decode.commit_external("nope", 1)
    assert decode.cancel_external("r")
    assert_pool_restored(decode)


def test_abort_releases_held_and_reserved(make_engine):
    engine = make_engine()
    prefill_only(engine, request("held", prompt_of(40, seed=3), max_tokens=5))
    engine.reserve_external(request("res", prompt_of(40, seed=4), max_tokens=5))
    assert engine.abort("held") and engine.abort("res")
    assert_pool_restored(engine)


def test_sync_generate_refuses_to_spin_when_held_blocks_fill_the_pool(make_engine):
    engine = make_engine(num_blocks=8)
    prefill_only(engine, request("held", prompt_of(100, seed=1), max_tokens=4))
    with pytest.raises(EngineCapacityError, match="held"):
        engine.generate([request("late", prompt_of(40, seed=2), max_tokens=4)])
    assert engine.abort("late") and engine.release("held")
