"""Fresh load of the prefill candidates, asked just before a remote decision.

The router ranks prefill workers from Stats it polls about once a second; a
prefill worker can go from idle to minutes of backlog in that time (one long
prompt), and the conditional rule compares its wait with the local one. So
when a request is a remote candidate, the decode worker asks the best
candidates' Stats directly (one unary call, ~1 ms on loopback), caching
answers for `max_age_s`. A candidate that does not answer within
`timeout_s` keeps the router's estimate; one that refuses the connection is
marked unhealthy for this decision.

A busy prefill worker is also the one slowest to answer that probe, and then
the router's estimate (up to a second old) is all there is. So the decode
worker also counts the prompt tokens it has itself sent to each prefill worker
and not yet got back (`OwnDispatches`): a candidate's wait is at least those
tokens at this worker's own prefill rate (prefill and decode workers run the
same engine). Dynamo's router counts active prefill tokens per worker at
dispatch for the same reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc

from pdmesh.v1 import prefill_pb2_grpc, worker_pb2
from services.common.channels import ChannelCache
from services.decode.disagg_policy import Candidate


class OwnDispatches:
    """Prompt tokens this decode worker has in flight at each prefill worker."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def begin(self, address: str, tokens: int) -> None:
        self.tokens[address] = self.tokens.get(address, 0) + tokens

    def end(self, address: str, tokens: int) -> None:
        left = self.tokens.get(address, 0) - tokens
        if left > 0:
            self.tokens[address] = left
        else:
            self.tokens.pop(address, None)

    def apply(self, candidates: list[Candidate], tokens_per_s: float) -> list[Candidate]:
        """Each candidate's wait raised to at least its in-flight tokens at `tokens_per_s`."""
        out = []
        for c in candidates:
            own = self.tokens.get(c.address, 0) / tokens_per_s
            out.append(replace(c, estimated_wait_s=own) if own > c.estimated_wait_s else c)
        return out


class PrefillLoadProbe:
    def __init__(
        self, channels: ChannelCache, max_age_s: float = 0.05, timeout_s: float = 0.05, probe_top: int = 2
    ):
        self.channels = channels
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.probe_top = probe_top
        self._cache: dict[str, tuple[float, float | None]] = {}  # address -> (when, wait_s | None=down)

    async def refresh(self, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates with fresh wait estimates (best `probe_top` probed), in router order."""
        top = [c for c in candidates if c.healthy][: self.probe_top]
        await asyncio.gather(*(self._probe(c.address) for c in top))
        out = []
        for c in candidates:
            entry = self._cache.get(c.address)
            if entry is None or c not in top:
                out.append(c)
            elif entry[1] is None:
                out.append(replace(c, healthy=False))
            else:
                out.append(replace(c, estimated_wait_s=entry[1]))
        return out

    async def _probe(self, address: str) -> None:
        now = time.monotonic()
        entry = self._cache.get(address)
        if entry is not None and now - entry[0] < self.max_age_s:
            return
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(address))
        try:
            resp = await stub.Stats(worker_pb2.StatsRequest(), timeout=self.timeout_s)
            self._cache[address] = (time.monotonic(), resp.load.estimated_wait_ms / 1000.0)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._cache[address] = (time.monotonic(), None)
            else:
                self._cache.pop(address, None)  # slow or odd: fall back to the router's estimate
