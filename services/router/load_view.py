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

Blending with load reports (heartbeat or Stats poll), per component:

    load = max(own, reported)

so other routers' traffic is still seen. Why max and not `reported + own`
(counts our own traffic twice once the report includes it) or `reported -
own_at_report + own` (exact only if both were in the same units, and they are
not: the worker's `tokens_waiting` counts a waiting prompt's cached tokens too
and misses running chunks, its decode blocks count each running sequence's
whole block table, cached prefix included, while the own view counts uncached
prompt tokens and the blocks a request adds; the difference would land on
exactly the workers holding prefixes, as phantom "other" load). max() never
double counts, is the own view whenever that is larger (a burst since the
last report, a long prompt still in prefill) and the report whenever that is
(other routers' traffic, or traffic this router process no longer tracks); it
undercounts only when both this router's unreported traffic and another's are
large, by at most half. With one router it is Dynamo's view (own only) wherever
ours is the larger.
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


@dataclass(slots=True)
class _Totals:
    prefill_tokens: int = 0
    decode_blocks: int = 0
    requests: int = 0


class LoadView:
    """Per worker: prefill tokens and decode blocks of what this router routed there."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._totals: dict[str, _Totals] = {}
        self._next = 0

    # ---- the request flow ---------------------------------------------------

    def begin(self, worker_id: str, prefill_tokens: int, decode_blocks: int) -> int:
        """An attempt was routed to `worker_id`; returns its key for `first_token` / `end`."""
        key = self._next
        self._next += 1
        e = _Entry(worker_id, max(prefill_tokens, 0), max(decode_blocks, 0))
        self._entries[key] = e
        t = self._totals.get(worker_id)
        if t is None:
            t = self._totals[worker_id] = _Totals()
        t.prefill_tokens += e.prefill_tokens
        t.decode_blocks += e.decode_blocks
        t.requests += 1
        return key

    def first_token(self, key: int) -> None:
        """The worker produced the attempt's first token: its prefill is done."""
        e = self._entries.get(key)
        if e is not None and e.prefill_tokens:
            self._totals[e.worker_id].prefill_tokens -= e.prefill_tokens
            e.prefill_tokens = 0

    def end(self, key: int) -> None:
        """The attempt ended (finished, failed, cancelled); idempotent."""
        e = self._entries.pop(key, None)
        if e is None:
            return
        t = self._totals[e.worker_id]
        t.prefill_tokens -= e.prefill_tokens
        t.decode_blocks -= e.decode_blocks
        t.requests -= 1
        if t.requests == 0:
            del self._totals[e.worker_id]

    # ---- the policy's view --------------------------------------------------

    def blend(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """`candidates` with max(own, reported) (see the module docstring) in
        `tokens_waiting` and `active_decode_blocks`."""
        out = []
        totals = self._totals
        for c in candidates:
            t = totals.get(c.worker_id)
            if t is None:  # nothing of ours outstanding there: the report alone
                out.append(c)
                continue
            load = c.load
            if t.prefill_tokens > load.tokens_waiting or t.decode_blocks > load.active_decode_blocks:
                load = dataclasses.replace(
                    load,
                    tokens_waiting=max(load.tokens_waiting, t.prefill_tokens),
                    active_decode_blocks=max(load.active_decode_blocks, t.decode_blocks),
                )
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
