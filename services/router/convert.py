"""Proto <-> router-core conversions (the cores never see protobuf).

Also applies one `SubscribeKvEventsResponse` to the prefix index and its
sequencer (`apply_kv_message`), since that is pure message translation.
"""

from __future__ import annotations

import math

from pdmesh.v1 import common_pb2, worker_pb2
from services.router.policy import WorkerLoad
from services.router.prefix_index import EventSequencer, PrefixIndex, SeqVerdict
from services.router.registry import WorkerInfo, WorkerRole

ROLE_FROM_PROTO = {
    common_pb2.WORKER_ROLE_DECODE: WorkerRole.DECODE,
    common_pb2.WORKER_ROLE_PREFILL: WorkerRole.PREFILL,
}
ROLE_TO_PROTO = {v: k for k, v in ROLE_FROM_PROTO.items()}
_ACCEL_FROM_PROTO = {
    common_pb2.ACCELERATOR_KIND_CPU: "cpu",
    common_pb2.ACCELERATOR_KIND_CUDA: "cuda",
    common_pb2.ACCELERATOR_KIND_UNSPECIFIED: "",
}
_ACCEL_TO_PROTO = {v: k for k, v in _ACCEL_FROM_PROTO.items()}


def info_from_proto(msg: common_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id,
        address=msg.address,
        role=ROLE_FROM_PROTO.get(msg.role),
        model_id=msg.model_id,
        block_size=msg.block_size,
        accelerator=_ACCEL_FROM_PROTO.get(msg.accelerator, ""),
        kv_capacity_blocks=msg.kv_capacity_blocks,
        engine_backend=msg.engine_backend,
        max_model_len=msg.max_model_len,
        kv_agent_name=msg.kv_agent_name,
        link_port=msg.link_port,
        accelerator_generation=msg.accelerator_generation,
        memory_headroom_bytes=msg.memory_headroom_bytes,
        warm_models=tuple(msg.warm_models),
        model_load_s=_measured(msg.model_load_s),
    )


def info_to_proto(info: WorkerInfo) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        role=ROLE_TO_PROTO.get(info.role, common_pb2.WORKER_ROLE_UNSPECIFIED),  # type: ignore[arg-type]
        model_id=info.model_id,
        block_size=info.block_size,
        accelerator=_ACCEL_TO_PROTO.get(info.accelerator, common_pb2.ACCELERATOR_KIND_UNSPECIFIED),
        kv_capacity_blocks=info.kv_capacity_blocks,
        engine_backend=info.engine_backend,
        max_model_len=info.max_model_len,
        kv_agent_name=info.kv_agent_name,
        link_port=info.link_port,
        accelerator_generation=info.accelerator_generation,
        memory_headroom_bytes=info.memory_headroom_bytes,
        warm_models=list(info.warm_models),
        model_load_s=info.model_load_s,
    )


def load_from_proto(msg: common_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        running=msg.running,
        waiting=msg.waiting,
        tokens_waiting=msg.tokens_waiting,
        used_blocks=msg.used_blocks,
        free_blocks=msg.free_blocks,
        estimated_wait_ms=msg.estimated_wait_ms,
        active_decode_blocks=msg.active_decode_blocks,
        not_serving_reason=msg.not_serving_reason,
        no_progress_ms=msg.no_progress_ms,
        host_restore_ms_per_block=msg.host_restore_ms_per_block,
        prefill_ms_per_block=msg.prefill_ms_per_block,
        link_ms_per_block=_measured(msg.link_ms_per_block),
        link_latency_ms=_measured(msg.link_latency_ms),
    )


def load_to_proto(load: WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        running=load.running,
        waiting=load.waiting,
        tokens_waiting=load.tokens_waiting,
        used_blocks=load.used_blocks,
        free_blocks=load.free_blocks,
        estimated_wait_ms=load.estimated_wait_ms,
        active_decode_blocks=load.active_decode_blocks,
        not_serving_reason=load.not_serving_reason,
        no_progress_ms=load.no_progress_ms,
        host_restore_ms_per_block=load.host_restore_ms_per_block,
        prefill_ms_per_block=load.prefill_ms_per_block,
        link_ms_per_block=load.link_ms_per_block,
        link_latency_ms=load.link_latency_ms,
    )


def _measured(x: float) -> float:
    """A measured time from the wire: a finite number > 0, else 0 (not measured or not a number)."""
    return x if math.isfinite(x) and x > 0 else 0.0


class KvResync(Exception):
    """The worker's KV-event stream lost events: drop its entries and subscribe again."""


def _parent(stored: common_pb2.KvBlocksStored) -> int | None:
    return stored.parent_hash if stored.HasField("parent_hash") else None


def apply_kv_message(
    index: PrefixIndex,
    sequencer: EventSequencer,
    worker_id: str,
    msg: worker_pb2.SubscribeKvEventsResponse,
) -> int:
    """Apply one subscription message for `worker_id`; returns the events applied
    (a snapshot counts as one, even when empty).

    Raises `KvResync` on a sequence gap (or events before any snapshot), and
    `IndexOverflow` from the index; the caller clears the worker and resubscribes.
    """
    body = msg.WhichOneof("body")
    if body == "snapshot":
        snap = msg.snapshot
        host = common_pb2.KV_TIER_HOST
        index.apply_snapshot(worker_id, [(_parent(c), c.block_hashes) for c in snap.chains if c.tier != host])
        tiers = getattr(index, "tiers", None)  # a TieredPrefixIndex also tracks host tiers
        if tiers is not None:
            tiers.snapshot(worker_id, [h for c in snap.chains if c.tier == host for h in c.block_hashes])
        sequencer.start(worker_id, snap.seq)
        return 1
    if body != "events":
        return 0
    applied = 0
    tiers = getattr(index, "tiers", None)
    for ev in msg.events.events:
        verdict = sequencer.check(worker_id, ev.seq)
        if verdict is SeqVerdict.DUPLICATE:
            continue
        if verdict is SeqVerdict.GAP:
            raise KvResync(f"worker {worker_id}: kv event seq {ev.seq} after a gap")
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            host = ev.stored.tier == common_pb2.KV_TIER_HOST
            if not host:  # the PrefixIndex is the pool's; host-tier blocks go to the TierView only
                index.apply_stored(worker_id, _parent(ev.stored), ev.stored.block_hashes)
            elif tiers is not None:
                tiers.stored(worker_id, ev.stored.block_hashes)
        elif kind == "removed":
            host = ev.removed.tier == common_pb2.KV_TIER_HOST
            if not host:
                index.apply_removed(worker_id, ev.removed.block_hashes)
            elif tiers is not None:
                tiers.removed(worker_id, ev.removed.block_hashes)
        elif kind == "cleared":
            index.clear(worker_id)
            index.apply_snapshot(worker_id, ())  # still known, with an empty cache
        applied += 1
    return applied
