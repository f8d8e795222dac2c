"""What decode and prefill workers serve alike: KV-event subscriptions, stats,
and their description for the router.

`kv_event_stream` turns an engine's event log into the SubscribeKvEvents
stream: first a snapshot of every cached block, then batches of events in seq
order. If the subscriber falls so far behind that the engine's bounded event
buffer no longer holds the next event, the stream ends with DATA_LOSS and the
subscriber resubscribes (and gets a fresh snapshot) — it never sees a silent gap.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import grpc

from pdmesh.v1 import common_pb2, worker_pb2
from services.engine.api import Engine, EngineStats, KvEvent, KvEventKind
from services.worker.health import HealthWatch

MAX_EVENTS_PER_MESSAGE = 256


def event_to_proto(e: KvEvent) -> common_pb2.KvEvent:
    if e.kind is KvEventKind.STORED:
        stored = common_pb2.KvBlocksStored(block_hashes=list(e.block_hashes), tier=int(e.tier))
        if e.parent_hash is not None:
            stored.parent_hash = e.parent_hash
        return common_pb2.KvEvent(seq=e.seq, stored=stored)
    if e.kind is KvEventKind.REMOVED:
        return common_pb2.KvEvent(
            seq=e.seq,
            removed=common_pb2.KvBlocksRemoved(block_hashes=list(e.block_hashes), tier=int(e.tier)),
        )
    return common_pb2.KvEvent(seq=e.seq, cleared=common_pb2.KvCacheCleared())


def snapshot_to_proto(
    seq: int, pairs: list[tuple[int | None, int]], host_pairs: list[tuple[int | None, int]] = ()
) -> worker_pb2.KvCacheSnapshot:
    chains = []
    for tier, tier_pairs in ((common_pb2.KV_TIER_DEVICE, pairs), (common_pb2.KV_TIER_HOST, host_pairs)):
        for parent, block in tier_pairs:
            stored = common_pb2.KvBlocksStored(block_hashes=[block], tier=tier)
            if parent is not None:
                stored.parent_hash = parent
            chains.append(stored)
    return worker_pb2.KvCacheSnapshot(seq=seq, chains=chains)


def engine_snapshot(engine: Engine) -> tuple[int, list, list]:
    """(seq, pool pairs, host-tier pairs); engines without tiers have no host pairs."""
    tiers = getattr(engine, "kv_snapshot_tiers", None)
    if tiers is not None:
        return tiers()
    seq, pairs = engine.kv_snapshot()
    return seq, pairs, []


async def kv_event_stream(
    engine: Engine, worker_id: str, context: grpc.aio.ServicerContext
) -> AsyncIterator[worker_pb2.SubscribeKvEventsResponse]:
    seq, pairs, host_pairs = engine_snapshot(engine)
    yield worker_pb2.SubscribeKvEventsResponse(
        worker_id=worker_id, snapshot=snapshot_to_proto(seq, pairs, host_pairs)
    )
    while True:
        await engine.wait_kv_events(seq)
        events = engine.kv_events_since(seq)
        if not events:
            continue
        if events[0].seq != seq + 1:
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"kv events after seq {seq} were dropped; resubscribe for a snapshot",
            )
        for start in range(0, len(events), MAX_EVENTS_PER_MESSAGE):
            chunk = events[start : start + MAX_EVENTS_PER_MESSAGE]
            yield worker_pb2.SubscribeKvEventsResponse(
                worker_id=worker_id,
                events=worker_pb2.KvEventBatch(events=[event_to_proto(e) for e in chunk]),
            )
        seq = events[-1].seq


def load_from_stats(
    s: EngineStats,
    estimated_wait_ms: float,
    health: HealthWatch | None = None,
    link_ms: tuple[float, float] = (0.0, 0.0),
) -> common_pb2.WorkerLoad:
    """The load report of Stats and heartbeats; with `health`, its not-serving reason too;
    `link_ms`: the decode worker's measured KV link, (ms per transfer, ms per block) (0: none)."""
    load = common_pb2.WorkerLoad(
        running=s.running,
        waiting=s.waiting,
        tokens_waiting=s.tokens_waiting,
        used_blocks=s.total_blocks - s.free_blocks,
        free_blocks=s.free_blocks,
        estimated_wait_ms=estimated_wait_ms,
        active_decode_blocks=s.active_decode_blocks,
        host_restore_ms_per_block=s.host_restore_s_per_block * 1000.0,
        prefill_ms_per_block=s.prefill_s_per_block * 1000.0,
        link_latency_ms=link_ms[0],
        link_ms_per_block=link_ms[1],
    )
    return health.fill_load(load) if health is not None else load


def counters_from_stats(s: EngineStats) -> common_pb2.EngineCounters:
    return common_pb2.EngineCounters(
        prompt_tokens_computed=s.prompt_tokens_computed,
        decode_tokens_computed=s.decode_tokens_computed,
        prompt_tokens_cached=s.prompt_tokens_cached,
        prompt_tokens_transferred=s.prompt_tokens_transferred,
        preemptions=s.preemptions,
        admitted_ahead=s.admitted_ahead,
        admitted_overdue=s.admitted_overdue,
        moved_ahead=s.moved_ahead,
        pinned_blocks=s.pinned_blocks,
        pins_evicted=s.pins_evicted,
        pins_expired=s.pins_expired,
        host_blocks=s.host_blocks,
        host_capacity_blocks=s.host_capacity_blocks,
        host_bytes=s.host_bytes,
        prompt_tokens_restored=s.prompt_tokens_restored,
        host_restores=s.host_restores,
        host_restore_s=s.host_restore_s,
        host_restores_declined=s.host_restores_declined,
        host_rejected=s.host_rejected,
        host_evicted=s.host_evicted,
    )


def default_worker_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{port}"
