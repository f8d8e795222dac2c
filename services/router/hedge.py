"""Hedging before the first token: a second copy of a request whose first token is late.

Pure decision core of the request flow's hedge (services/router/generate.py),
off by default (`--hedge-enabled`). When a request has waited `multiple` times
the predicted TTFT of its worker (OutlierDetector.predicted_ttft, at least
`min_delay_s`) without a first message, the flow sends a copy to the next-best
worker, if the retry budget grants one (a hedge is paid like a retry, so
hedges cannot amplify an outage either). Whichever attempt sends its first
message (or ends) first is kept; the other is cancelled at once and its
computed tokens are counted as wasted (`pdmesh_router_wasted_tokens_by_cause_total
{cause="hedged"}`). At most `max_hedges` copies per request, and never after
the first token: after it, the request migrates instead.

Tied copies (`tied`, on with hedging; "The Tail at Scale"'s tied requests): a
copy sent while the primary was still queued (its worker had not reported its
prefill begun, LinkOpen.notify_started) races on *starting* instead: the first
leg whose worker begins its prefill is kept and the other, still queued, is
cancelled before it computes anything. A primary already computing when the copy
goes (late in its prefill, or on a worker that hung in it) races on the first
message as before, as do legs on paths that never report a start (a remote
prefill, a prefix pull, TensorRT-LLM, a Generate call). With the reports, a
primary whose prefill began is late only against the time since it began (its
queue is behind it): the copy waits until `multiple` x its predicted TTFT after
that start (hedge_race.py).

    delay = hedge_delay(config, predicted_ttft)     # None: do not hedge
    worth_hedging(waited, copy_ttft, copy_wait)     # a candidate whose copy should win
    winner = race_winner(primary, hedge)            # which to keep, once either moved
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.config import require, setting


@dataclass(frozen=True)
class HedgeConfig:
    enabled: bool = setting(False, "hedge before the first token: copy a late request to the next worker")
    multiple: float = setting(3.0, "hedge after this many times the worker's predicted TTFT")
    min_delay_s: float = setting(0.05, "never hedge sooner than this after the attempt started")
    max_hedges: int = setting(1, "copies of one request at most")
    require_faster: bool = setting(
        True, "hedge only to a worker whose predicted TTFT + queue wait is under the primary's wait so far"
    )
    tied: bool = setting(
        True,
        "tie a copy to a still-queued primary: the first whose worker begins the prefill is kept, "
        "the other is cancelled before computing; a primary already computing is late only against "
        "the time since it began (workers report starts on the link)",
    )

    def __post_init__(self) -> None:
        require(self.multiple > 0, "multiple must be > 0")
        require(self.min_delay_s >= 0, "min_delay_s must be >= 0")
        require(self.max_hedges >= 0, "max_hedges must be >= 0")


def hedge_delay(config: HedgeConfig, predicted_ttft_s: float | None, hedges_so_far: int = 0) -> float | None:
    """Seconds after an attempt's start at which to hedge it; None: not this one (hedging
    off, the request's hedges spent, or no prediction to measure lateness against)."""
    if not config.enabled or hedges_so_far >= config.max_hedges or predicted_ttft_s is None:
        return None
    return max(config.multiple * predicted_ttft_s, config.min_delay_s)


def worth_hedging(waited_s: float, copy_ttft_s: float | None, copy_wait_s: float) -> bool:
    """Is a copy on this worker expected to beat a primary that has waited `waited_s` with
    nothing back? Only if its predicted TTFT there plus the queue wait that worker reports
    is shorter than that: the primary's remaining wait is taken as long as it has waited
    already, and a copy that would queue as long only doubles the work (both legs end up in
    prefill, one is thrown away). No prediction for the worker: 0, its wait decides."""
    return (copy_ttft_s or 0.0) + max(copy_wait_s, 0.0) < waited_s


class Leg(enum.Enum):
    """How far one attempt of a race has got."""

    WAITING = "waiting"  # nothing back yet
    COMPUTING = "computing"  # its worker reported its prefill begun; no message yet
    STARTED = "started"  # its first message (tokens or final) arrived
    FAILED = "failed"  # ended with an error before any message


class Winner(enum.Enum):
    NONE = "none"  # both still waiting: keep racing
    PRIMARY = "primary"  # keep the primary, cancel the hedge
    HEDGE = "hedge"  # keep the hedge, cancel the primary


def race_winner(primary: Leg, hedge: Leg, tied: bool = False) -> Winner:
    """Which attempt to keep. The first to send a message wins (the primary on a tie: its
    worker was ranked better); a failed leg loses to one still going, which goes on alone;
    when both failed the primary's error is the request's (it goes to recovery).
    `tied`: the legs race on their start, too: one computing beats one still waiting
    (cancelled in its queue, it has computed nothing); both computing race on as before."""
    if primary is Leg.STARTED:
        return Winner.PRIMARY
    if hedge is Leg.STARTED:
        return Winner.HEDGE
    if primary is Leg.FAILED and hedge is not Leg.FAILED:
        return Winner.HEDGE
    if hedge is Leg.FAILED:
        return Winner.PRIMARY
    if tied and primary is not hedge:  # one computing, one waiting
        return Winner.PRIMARY if primary is Leg.COMPUTING else Winner.HEDGE
    return Winner.NONE
