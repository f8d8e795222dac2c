"""Routing policies over fake workers, with the prefix index fed by their KV events."""

import grpc

from pdmesh.v1 import common_pb2, router_pb2
from tests.service.router.fakes import stored_event

PROMPT = "The quick brown fox jumps over the lazy dog, then naps in the sun."  # 66 bytes: 4 blocks


def _calls(*workers):
    return [len(w.calls) for w in workers]


async def test_round_robin_alternates(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    h = await mesh.router([d1, d2], policy="round_robin")
    for _ in range(4):
        await h.generate("hi", max_tokens=2)
    assert _calls(d1, d2) == [2, 2]


async def test_least_loaded_avoids_the_busy_worker(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    d1.load.tokens_waiting = 1000
    h = await mesh.router([d1, d2], policy="least_loaded")
    for _ in range(3):
        await h.generate("hi", max_tokens=2)
    assert _calls(d1, d2) == [0, 3]


async def test_kv_aware_follows_the_cached_prefix(mesh):
    d1, d2 = await mesh.decode("d1"), await mesh.decode("d2")
    hashes = d2.kv.cache_prompt(list(PROMPT.encode()))
    h = await mesh.router([d1, d2], policy="kv_aware")
    r = h.router
    await r.wait_until(lambda: r.index.blocks("d2") == len(hashes) == 4)
    for _ in range(3):
        _, final, _ = await h.generate(PROMPT, max_tokens=8)
        assert final.worker_id == "d2"
    assert _calls(d1, d2) == [0, 3]

    # A later KV event makes d1 the holder of another prompt's prefix.
    other = "Another prompt entirely, with enough bytes for four blocks of tokens!"
    other_hashes = d1.kv.cache_prompt(list(other.encode()))
    d1.kv.push_events(stored_event(1, other_hashes))
    await r.wait_until(lambda: r.index.blocks("d1") == 4)
    _, final, _ = await h.generate(other, max_tokens=8)
    assert final.worker_id == "d1"
    listed = await h.internal.ListWorkers(router_pb2.ListWorkersRequest())
    blocks = {w.info.worker_id: w.indexed_blocks for w in listed.workers}
    assert blocks == {"d1": 4, "d2": 4}
    assert {w.source for w in listed.workers} == {"static"}
    assert all(w.health == router_pb2.WORKER_HEALTH_SERVING for w in listed.workers)


async def test_a_sequence_gap_drops_the_worker_and_resubscribes(mesh):
    d1 = await mesh.decode("d1")
    d1.kv.cache_prompt(list(PROMPT.encode()))
    h = await mesh.router([d1])
    r = h.router
    await r.wait_until(lambda: r.index.blocks("d1") == 4)
    d1.kv.chains = []  # what the next snapshot will say
    d1.kv.push_events(stored_event(7, [1, 2, 3]))  # seq 7 after snapshot seq 0: a gap
    await r.wait_until(lambda: d1.kv.subscriptions == 2 and r.sequencer.last_seq("d1") == 0)
    assert r.index.blocks("d1") == 0


async def test_data_loss_status_resyncs(mesh):
    d1 = await mesh.decode("d1")
    d1.kv.cache_prompt(list(PROMPT.encode()))
    h = await mesh.router([d1])
    r = h.router
    await r.wait_until(lambda: r.index.blocks("d1") == 4)
    d1.kv.snapshot_seq = 42
    d1.kv.fail_streams(grpc.StatusCode.DATA_LOSS)
    await r.wait_until(lambda: d1.kv.subscriptions == 2 and r.sequencer.last_seq("d1") == 42)
    assert r.index.blocks("d1") == 4  # the fresh snapshot restored it


async def test_kv_aware_ranks_prefill_candidates(mesh):
    d1 = await mesh.decode("d1")
    p1, p2 = await mesh.prefill("p1"), await mesh.prefill("p2")
    p1.load.estimated_wait_ms = 5.0
    p2.load.estimated_wait_ms = 20.0
    p2.kv.cache_prompt(list(PROMPT.encode()))
    h = await mesh.router([d1], [p1, p2], policy="kv_aware")
    r = h.router
    await r.wait_until(lambda: r.index.blocks("p2") == 4)
    await h.generate(PROMPT, max_tokens=4)
    cands = list(d1.calls[0].prefill_candidates)
    assert [c.worker_id for c in cands] == ["p2", "p1"]
    assert [c.address for c in cands] == [p2.address, p1.address]
    assert [c.overlap_blocks for c in cands] == [4, 0]
    assert [c.estimated_wait_ms for c in cands] == [20.0, 5.0]
    assert d1.calls[0].disagg_mode == 0  # the decode worker applies its rule


async def test_no_prefill_workers_means_no_candidates(mesh):
    d1 = await mesh.decode("d1")
    h = await mesh.router([d1])
    await h.generate(PROMPT, max_tokens=2)
    assert list(d1.calls[0].prefill_candidates) == []
    assert d1.calls[0].sampling.max_tokens == 2
    assert common_pb2.FINISH_REASON_LENGTH
