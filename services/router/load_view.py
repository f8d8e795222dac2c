"""The router's own account of the load it sent to each worker (Dynamo's "active sequences").

Owns one `_Entry` per attempt this router process routed and has not seen end:
its prefill tokens (the prompt tokens the worker still has to compute) count
from routing until the worker's first token, its decode blocks (the KV blocks
the request will add on the worker) until the attempt ends (finish, failure,
cancel). The request flow (services/router/generate.py) calls `begin` when it
routes, `first_token`, `end`, and passes `totals` to the policy's `rank`
(`own`), which scores each candidate on its reported load blended with these
(`blend` builds the blended candidates themselves: the same numbers, slower).

Why: a heartbeat is stale by up to one interval and the worker's
`tokens_waiting` misses the unfinished chunks of a prompt already running, so
a burst of requests routed between two reports all see the same "idle"
worker. The own view is exact for this router's traffic from the moment it
routes.

Blending with load reports (heartbeat or Stats poll), per component. A
report carries this router's traffic there as of when it was taken plus
everyone else's; what is ours in it goes stale by the next report (a request
of ours that ended since still shows), and at 1 s intervals that stale part
was what made idle workers look busy (bench/routing_sim.py at the Dynamo side
by side's x4 load: a worker whose requests had all ended still reported
hundreds of decode blocks for up to a second; BENCHMARKS.md, issue 17). So
when the registry tells the view a report arrived (`reported`, the registry's
`on_load` hook), the view snapshots its own traffic there *in the worker's
units* (full prompt tokens of requests without a first token: the worker's
tokens_waiting counts a waiting prompt whole; prompt blocks of requests not
ended: a running request's block table holds at least those) and blends

    load = max(reported - ours_at_report, 0) + own

i.e. other routers' traffic (what the report shows beyond ours) plus ours
now. The snapshot is an upper bound of what is ours in the report (a request
still in flight to the worker, or mid-prefill, counts whole), so other
routers' traffic is never counted twice and is undercounted only by the
difference; requests of ours that got their first token between the report
being taken and arriving (one Stats round trip) count as other traffic until
the next one.

Before the first report of a worker reaches the view (or with no hook wired),
it blends as before:

    load = max(own, reported)

which never double counts and undercounts only when both this router's
unreported traffic and another's are large, by at most half. (Plain
`reported + own` would count our own traffic twice once the report includes
it, which is why ours at the report is subtracted in the worker's own units
and not in the view's: the view counts uncached prompt tokens and the blocks
a request adds, which would leave phantom "other" load exactly on the
workers holding prefixes.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.router.policy import Candidate


@dataclass(slots=True)
class _Entry:
    worker_id: str
    prefill_tokens: int  # 0 once the first token came
    decode_blocks: int
    report_tokens: int  # in the worker's units: the whole prompt, 0 once the first token came
    report_blocks: int  # in the worker's units: the prompt's blocks


@dataclass(slots=True)
class _Totals:
    prefill_tokens: int = 0
    decode_blocks: int = 0
    requests: int = 0
    # Ours in the worker's units now, and as of its last report (`reported`).
    report_tokens: int = 0
    report_blocks: int = 0
    synced: bool = False  # a report of this worker arrived while we tracked it
    snap_tokens: int = 0
    snap_blocks: int = 0


def blended(tokens_waiting: int, decode_blocks: int, t: _Totals) -> tuple[int, int]:
    """(tokens waiting, active decode blocks) of a report blended with our totals `t`."""
    if t.synced:
        return (
            max(tokens_waiting - t.snap_tokens, 0) + t.prefill_tokens,
            max(decode_blocks - t.snap_blocks, 0) + t.decode_blocks,
        )
    return max(tokens_waiting, t.prefill_tokens), max(decode_blocks, t.decode_blocks)


class LoadView:
    """Per worker: prefill tokens and decode blocks of what this router routed there."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._totals: dict[str, _Totals] = {}
        self._next = 0

    # ---- the request flow ---------------------------------------------------

    def begin(
        self,
        worker_id: str,
        prefill_tokens: int,
        decode_blocks: int,
        prompt_tokens: int | None = None,
        block_size: int = 16,
    ) -> int:
        """An attempt was routed to `worker_id`; returns its key for `first_token` / `end`.
        `prompt_tokens`: its whole prompt (cached part included; default `prefill_tokens`),
        for what the worker's reports will count of it."""
        key = self._next
        self._next += 1
        prompt = max(prefill_tokens if prompt_tokens is None else prompt_tokens, 0)
        e = _Entry(worker_id, max(prefill_tokens, 0), max(decode_blocks, 0), prompt, prompt // block_size)
        self._entries[key] = e
        t = self._totals.get(worker_id)
        if t is None:
            t = self._totals[worker_id] = _Totals()
        t.prefill_tokens += e.prefill_tokens
        t.decode_blocks += e.decode_blocks
        t.report_tokens += e.report_tokens
        t.report_blocks += e.report_blocks
        t.requests += 1
        return key

    def first_token(self, key: int) -> None:
        """The worker produced the attempt's first token: its prefill is done."""
        e = self._entries.get(key)
        if e is not None and e.report_tokens:
            t = self._totals[e.worker_id]
            t.prefill_tokens -= e.prefill_tokens
            t.report_tokens -= e.report_tokens
            e.prefill_tokens = e.report_tokens = 0

    def end(self, key: int) -> None:
        """The attempt ended (finished, failed, cancelled); idempotent."""
        e = self._entries.pop(key, None)
        if e is None:
            return
        t = self._totals[e.worker_id]
        t.prefill_tokens -= e.prefill_tokens
        t.decode_blocks -= e.decode_blocks
        t.report_tokens -= e.report_tokens
        t.report_blocks -= e.report_blocks
        t.requests -= 1
        self._maybe_drop(e.worker_id, t)

    def reported(self, worker_id: str) -> None:
        """A load report of `worker_id` just arrived (WorkerRegistry.on_load): what is
        ours in it is what we have outstanding there now (see the module docstring)."""
        t = self._totals.get(worker_id)
        if t is None:
            return  # nothing of ours there: the report is all other traffic
        t.synced = True
        t.snap_tokens, t.snap_blocks = t.report_tokens, t.report_blocks
        self._maybe_drop(worker_id, t)

    def _maybe_drop(self, worker_id: str, t: _Totals) -> None:
        # Kept while the last report still holds some of ours (it must be subtracted).
        if t.requests == 0 and not (t.synced and (t.snap_tokens or t.snap_blocks)):
            del self._totals[worker_id]

    # ---- the policy's view --------------------------------------------------

    def blend(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """`candidates` with the blended load (see the module docstring) in
        `tokens_waiting` and `active_decode_blocks`."""
        out = []
        totals = self._totals
        for c in candidates:
            t = totals.get(c.worker_id)
            if t is None:  # nothing of ours outstanding there: the report alone
                out.append(c)
                continue
            load = c.load
            waiting, decode = blended(load.tokens_waiting, load.active_decode_blocks, t)
            if waiting != load.tokens_waiting or decode != load.active_decode_blocks:
                load = dataclasses.replace(load, tokens_waiting=waiting, active_decode_blocks=decode)
                c = dataclasses.replace(c, load=load)
            out.append(c)
        return out

    def totals(self) -> Mapping[str, _Totals]:
        """worker id -> what this router has outstanding there (`prefill_tokens`,
        `decode_blocks`): the policies' `own` argument, which blends as `blend` does
        without copying candidates. A live view: read it, do not keep or change it."""
        return self._totals

    # ---- introspection ------------------------------------------------------

    def own(self, worker_id: str) -> tuple[int, int]:
        """(prefill tokens, decode blocks) this router has outstanding on `worker_id`."""
        t = self._totals.get(worker_id)
        return (t.prefill_tokens, t.decode_blocks) if t else (0, 0)

    def __len__(self) -> int:
        """Attempts routed and not ended."""
        return len(self._entries)
