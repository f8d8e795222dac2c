"""A tied hedge (HedgeConfig.tied): the copy and a still-queued primary race on *starting*.

HedgeRace against stand-ins (no worker: the link's start reports are pushed by hand, as
services/router/link.py pushes them; tests/service/router/test_slow_workers.py runs the
same race over real workers). What is checked is which leg is kept, that the other is
cancelled at once, and what the loser is counted as having computed.
"""

from __future__ import annotations

from types import SimpleNamespace

from pdmesh.v1 import decode_pb2
from services.router.attempt import DecodeAttempt, Wake
from services.router.hash_memo import HashMemo
from services.router.hedge import HedgeConfig
from services.router.hedge_race import HedgeRace
from tests.support.poll import eventually

PROMPT = list(range(64))


class NeverCall:
    """A call stand-in: nothing ever comes back; records its cancel."""

    def __init__(self):
        self.cancelled = False
        self.sink = None

    def attach(self, sink) -> None:  # the link's path: no reader task
        self.sink = sink

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Journey:
    def __init__(self):
        self.attempts = ()
        self.current = SimpleNamespace(input_tokens=len(PROMPT))
        self.won: list[dict] = []

    def hedge_won(self, worker_id, cached_tokens=0, loser_computed=None):
        self.won.append({"worker": worker_id, "loser_computed": loser_computed})


def scenario(tied: bool = True, multiple: float = 1e-6, predicted_s: float = 0.01):
    outcomes: list[str] = []
    wasted: list[int] = []
    calls: dict[str, NeverCall] = {}

    sent: dict[str, decode_pb2.DecodeServiceGenerateRequest] = {}

    def call_decode(worker_id, request, timeout):
        calls[worker_id] = NeverCall()
        sent[worker_id] = request
        return calls[worker_id]

    candidate = SimpleNamespace(worker_id="b", load=SimpleNamespace(estimated_wait_ms=0.0))
    noop = lambda *a, **k: None  # noqa: E731
    ctx = SimpleNamespace(
        hedge=HedgeConfig(enabled=True, multiple=multiple, min_delay_s=0.0, require_faster=False, tied=tied),
        outliers=SimpleNamespace(predicted_ttft=lambda worker, blocks: predicted_s, record_ttft=noop),
        profiles=None,  # no speeds measured
        registry=SimpleNamespace(
            get=lambda worker: None, eligible=lambda role: [candidate], begin_request=noop, end_request=noop
        ),
        budget=SimpleNamespace(can_retry=lambda: True, record_retry=noop),
        config=SimpleNamespace(block_size=16),
        hash_memo=HashMemo(),  # the copy's prompt chain goes through the router's memo, as in the flow
        index=SimpleNamespace(match=lambda hashes: {}),
        decode_policy=SimpleNamespace(rank=lambda cands, n, overlaps: cands),
        breakers=SimpleNamespace(record_ignored=noop, record_failure=noop),
        load_view=None,
        call_decode=call_decode,
        metrics=SimpleNamespace(hedge=outcomes.append, wasted=lambda cause, n: wasted.append(n)),
    )
    wake = Wake()
    journey = Journey()
    race = HedgeRace(
        ctx,
        journey,
        lambda choices: SimpleNamespace(worker_id=choices[0].worker_id, overlap_blocks=0),
        lambda wid, call, n: DecodeAttempt(wid, call, wake),
        noop,
        lambda c, cfg: False,
    )
    calls["a"] = NeverCall()
    primary = DecodeAttempt("a", calls["a"], wake)
    request = decode_pb2.DecodeServiceGenerateRequest(request_id="r", prompt_token_ids=PROMPT)
    return SimpleNamespace(
        race=race,
        primary=primary,
        request=request,
        calls=calls,
        sent=sent,
        journey=journey,
        outcomes=outcomes,
        wasted=wasted,
    )


async def copy_sent(s) -> DecodeAttempt:
    s.race.arm(s.primary, s.request, len(PROMPT), 4, None)
    await eventually(lambda: s.race.hedge is not None, what="the copy sent", timeout=10)
    return s.race.hedge


async def test_a_copy_that_begins_first_wins_and_the_queued_primary_is_counted_as_nothing():
    s = scenario()
    copy = await copy_sent(s)
    assert s.race.settle(s.primary, None)[0] is s.primary  # both queued: keep racing
    copy.push_started()  # the copy's worker began its prefill; no token yet
    kept, _ = s.race.settle(s.primary, None)
    assert kept is copy and not copy.messages
    assert s.calls["a"].cancelled and not s.calls["b"].cancelled  # cancelled in its queue, at once
    assert s.journey.won == [{"worker": "b", "loser_computed": 0}]
    assert s.outcomes == ["sent", "won"]


async def test_a_primary_that_begins_first_keeps_the_request_and_the_copy_costs_nothing():
    s = scenario()
    copy = await copy_sent(s)
    s.primary.push_started()
    kept, _ = s.race.settle(s.primary, None)
    assert kept is s.primary and s.calls["b"].cancelled and not s.calls["a"].cancelled
    assert s.race.waste == 0 and s.wasted == [] and copy.ended
    assert s.outcomes == ["sent", "lost"]


async def test_a_primary_already_computing_when_the_copy_goes_races_on_the_first_message():
    """It may have hung inside its prefill: the copy must be able to win by its first token."""
    s = scenario()
    s.primary.push_started()
    copy = await copy_sent(s)
    copy.push_started()
    assert s.race.settle(s.primary, None)[0] is s.primary and not s.calls["a"].cancelled
    copy.push_tokens([3])
    kept, _ = s.race.settle(s.primary, None)
    assert kept is copy and s.calls["a"].cancelled
    assert s.journey.won == [{"worker": "b", "loser_computed": None}]  # its prefill: estimated


async def test_untied_a_start_decides_nothing_and_the_losing_copy_is_waste():
    s = scenario(tied=False)
    copy = await copy_sent(s)
    copy.push_started()
    assert s.race.settle(s.primary, None)[0] is s.primary and not s.calls["a"].cancelled
    s.primary.push_tokens([4])
    kept, _ = s.race.settle(s.primary, None)
    assert kept is s.primary and s.calls["b"].cancelled
    assert s.race.waste == len(PROMPT) and s.wasted == [len(PROMPT)]
    assert s.outcomes == ["sent", "lost"]


async def test_a_primary_that_began_computing_is_late_only_against_the_time_since():
    """Its queue is behind it: the hedge timer, due at 3x the predicted TTFT after the
    attempt started, then waits until 3x the predicted TTFT after the reported start."""
    s = scenario(multiple=3.0, predicted_s=1.0)  # the copy is due 3 s after the attempt started
    s.primary.started -= 2.95  # it has waited 2.95 s: due in 0.05 s
    s.primary.push_started()  # and its worker began it just now
    s.race.arm(s.primary, s.request, len(PROMPT), 4, None)
    first_due = s.race._due
    await eventually(lambda: s.race._due != first_due or s.race.hedge is not None, what="the timer fired")
    assert s.race.hedge is None  # not late against its own start: no copy
    assert s.race._due == s.primary.computing_at + 3.0
    s.race.end()


async def test_untied_the_timer_counts_from_the_attempt_start_alone():
    s = scenario(tied=False, multiple=3.0, predicted_s=1.0)
    s.primary.started -= 2.95
    s.primary.push_started()
    s.race.arm(s.primary, s.request, len(PROMPT), 4, None)
    await eventually(lambda: s.race.hedge is not None, what="the copy sent", timeout=10)
    s.race.end()


async def test_the_copy_brings_the_wait_the_request_had_for_the_workers_admission():
    """EngineConfig.queue_late_after_s counts a request's wait from its start in the mesh: the
    copy says how long it has waited already (what it waited before the primary, plus since)."""
    s = scenario()
    s.request.waited_s = 0.25
    copy = await copy_sent(s)
    waited = s.sent["b"].waited_s
    assert 0.25 < waited <= 0.25 + (copy.started - s.primary.started)
    assert s.request.waited_s == 0.25  # the primary's request is not changed
