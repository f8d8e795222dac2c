"""The router's own account of the load it sent to each worker (Dynamo's "active sequences").

Owns one `_Entry` per attempt this router process routed and has not seen end:
its prefill tokens (the prompt tokens the worker still has to compute) count
from routing until the worker's first token, its decode blocks (the KV blocks
the request will add on the worker) until the attempt ends (finish, failure,
cancel). The request flow (services/router/generate.py) calls `begin` when it
routes, `first_token`, `end`; the worker pool calls `report` when a load
report (Stats poll or heartbeat) arrives; `blend` turns the registry's
candidates into candidates whose load the policy scores.

Why: a heartbeat is stale by up to one interval and the worker's
`tokens_waiting` misses the unfinished chunks of a prompt already running, so
a burst of requests routed between two reports all see the same "idle"
worker. The own view is exact for this router's traffic from the moment it
routes.

Blending with reports, so other routers' traffic is still seen:

    others = max(reported - own_at_report, 0)      per component
    load   = others + own_now

`own_at_report` is this router's own total when the report arrived: what of
the report is this router's own traffic. Taking it out and adding the live
own total counts the own traffic once (never twice, as `reported + own`
would) and still counts what other routers sent (which `max(own, reported)`
would hide whenever own is larger, e.g. right after a burst). Clamping at 0:
the report undercounts own prefill (running chunks) and own decode blocks are
reserved up front (prompt + max_tokens), so the difference is often negative
for a worker only this router feeds; then the own view alone is the load.
With one router this is Dynamo's behaviour (own view only); with several it
adds the others' last reported load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
        # worker -> (own prefill tokens, own decode blocks) when its last report arrived
        self._at_report: dict[str, tuple[int, int]] = {}
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

    # ---- load reports -------------------------------------------------------

    def report(self, worker_id: str) -> None:
        """A load report of `worker_id` arrived: what this router has routed there
        now is what the report may already include."""
        t = self._totals.get(worker_id)
        if t is None:  # nothing of ours in it: no entry, so `blend` skips the worker quickly
            self._at_report.pop(worker_id, None)
        else:
            self._at_report[worker_id] = (t.prefill_tokens, t.decode_blocks)

    def forget(self, worker_id: str) -> None:
        """The worker left: drop its report baseline (attempts still end normally)."""
        self._at_report.pop(worker_id, None)

    # ---- the policy's view --------------------------------------------------

    def blend(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """`candidates` with the blended load (see the module docstring) in
        `tokens_waiting` and `active_decode_blocks`, and own requests in `inflight`."""
        out = []
        totals, at_report = self._totals, self._at_report
        for c in candidates:
            t = totals.get(c.worker_id)
            base = at_report.get(c.worker_id)
            if t is None and base is None:  # nothing of ours outstanding or in the report
                out.append(c)
                continue
            own_p, own_d = (t.prefill_tokens, t.decode_blocks) if t else (0, 0)
            base_p, base_d = base or (0, 0)
            load = c.load
            prefill = max(load.tokens_waiting - base_p, 0) + own_p
            decode = max(load.active_decode_blocks - base_d, 0) + own_d
            if prefill != load.tokens_waiting or decode != load.active_decode_blocks:
                load = dataclasses.replace(load, tokens_waiting=prefill, active_decode_blocks=decode)
                c = dataclasses.replace(c, load=load)
            out.append(c)
        return out

    # ---- introspection ------------------------------------------------------

    def own(self, worker_id: str) -> tuple[int, int]:
        """(prefill tokens, decode blocks) this router has outstanding on `worker_id`."""
        t = self._totals.get(worker_id)
        return (t.prefill_tokens, t.decode_blocks) if t else (0, 0)

    def __len__(self) -> int:
        """Attempts routed and not ended."""
        return len(self._entries)
