"""The planner's reads: the router's Stats and ListWorkers, and the workers' Stats.

One `read()` makes a `Snapshot` (services/planner/observe.py) from the router's
internal listener (Stats: arrivals, token totals, latency histograms, queue;
ListWorkers: which workers are healthy, their KV use) and, optionally, each
healthy worker's own Stats (prefix-cache counters). A worker that does not
answer is left out of that read (it may be starting or draining); the router
not answering is a `StatsUnavailable` (the loop skips the interval).
"""

from __future__ import annotations

import asyncio

import grpc

from pdmesh.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from services.common.tls import ClientTls, aio_channel
from services.planner.observe import Histogram, Snapshot

_ROLE = {common_pb2.WORKER_ROLE_DECODE: "decode", common_pb2.WORKER_ROLE_PREFILL: "prefill"}
_STUBS = {"decode": decode_pb2_grpc.DecodeServiceStub, "prefill": prefill_pb2_grpc.PrefillServiceStub}


class StatsUnavailable(Exception):
    """The router's Stats or ListWorkers failed."""


def histogram_from_proto(h: router_pb2.LatencyHistogram) -> Histogram:
    return Histogram(tuple(h.upper_bounds_s), tuple(h.counts))


class StatsReader:
    def __init__(
        self, router_address: str, tls: ClientTls | None, timeout_s: float = 5.0, worker_stats: bool = True
    ):
        self._tls = tls
        self._timeout = timeout_s
        self._worker_stats = worker_stats
        self._channel = aio_channel(router_address, tls)
        self._router = router_pb2_grpc.RouterServiceStub(self._channel)
        self._workers: dict[str, grpc.aio.Channel] = {}

    async def read(self, now: float) -> Snapshot:
        try:
            stats, listed = await asyncio.gather(
                self._router.Stats(router_pb2.RouterServiceStatsRequest(), timeout=self._timeout),
                self._router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=self._timeout),
            )
        except grpc.aio.AioRpcError as e:
            raise StatsUnavailable(f"router: {e.code().name}: {e.details()}") from e
        healthy = [w for w in listed.workers if w.health == router_pb2.WORKER_HEALTH_SERVING]
        ready = {"prefill": 0, "decode": 0}
        used = total = 0
        for w in healthy:
            role = _ROLE.get(w.info.role)
            if role is not None:
                ready[role] += 1
            if role == "decode":
                used += w.load.used_blocks
                total += w.load.used_blocks + w.load.free_blocks
        counters = await self._prompt_counters(healthy) if self._worker_stats else {}
        return Snapshot(
            at_s=now,
            arrivals=stats.requests_total,
            finished=stats.requests_succeeded + stats.requests_failed + stats.requests_cancelled,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            ttft=histogram_from_proto(stats.ttft),
            itl=histogram_from_proto(stats.itl),
            prompt_counters=counters,
            ready=ready,
            queued=stats.queued,
            kv_use=used / total if total else 0.0,
        )

    async def _prompt_counters(self, workers) -> dict[str, tuple[int, int]]:
        async def one(w) -> tuple[str, tuple[int, int]] | None:
            role = _ROLE.get(w.info.role)
            if role is None:
                return None
            channel = self._workers.get(w.info.address)
            if channel is None:
                channel = self._workers[w.info.address] = aio_channel(w.info.address, self._tls)
            try:
                s = await _STUBS[role](channel).Stats(worker_pb2.StatsRequest(), timeout=self._timeout)
            except grpc.aio.AioRpcError:
                return None  # starting or draining: this read goes without it
            c = s.counters
            return w.info.worker_id, (c.prompt_tokens_cached, c.prompt_tokens_computed)

        got = await asyncio.gather(*(one(w) for w in workers))
        known = {w.info.address for w in workers}
        for address in [a for a in self._workers if a not in known]:  # gone: close its channel
            await self._workers.pop(address).close()
        return dict(g for g in got if g is not None)

    async def close(self) -> None:
        for channel in self._workers.values():
            await channel.close()
        await self._channel.close()
