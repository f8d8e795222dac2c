"""OutlierDetector on a fake clock: deprioritise, eject with backoff, probe back, share cap."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, build
from services.router.outlier import OutlierConfig, OutlierDetector, OutlierState, quantile


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CFG = OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=5.0, probe_successes=2)


def feed(det: OutlierDetector, worker: str, ttft: float, n: int = 8, itl: float | None = None) -> None:
    for _ in range(n):
        det.record_ttft(worker, ttft)
        if itl is not None:
            det.record_itl(worker, itl)


def mesh(cfg: OutlierConfig = CFG, workers: int = 4):
    clock = Clock()
    transitions: list[tuple[str, OutlierState, OutlierState]] = []
    det = OutlierDetector(cfg, clock, lambda w, old, new: transitions.append((w, old, new)))
    for i in range(workers):
        feed(det, f"w{i}", 0.05, itl=0.03)
    return det, clock, transitions


def test_quantile_is_nearest_rank():
    assert quantile([5, 1, 3, 2, 4], 0.5) == 3
    assert quantile([1, 2, 3, 4], 0.9) == 4
    assert quantile([7], 0.1) == 7


def test_peers_alike_are_neither_deprioritised_nor_ejected():
    det, _, transitions = mesh()
    assert all(det.factor(f"w{i}") == 1.0 for i in range(4))
    assert not det.inflated and transitions == []


def test_a_moderately_slow_worker_is_deprioritised_in_proportion():
    det, _, _ = mesh()
    feed(det, "w0", 0.1)  # p90 of w0 now 0.1 vs the peers' 0.05: ratio 2
    assert det.factor("w0") == pytest.approx(2.0)
    assert det.state("w0") is OutlierState.HEALTHY and det.inflated
    choices = [("w0", 1.0), ("w1", 1.5), ("w2", 3.0)]
    ranked = det.rerank(choices, lambda c: c[0], lambda c: c[1])
    # (1 + 1) * 2 = 4 > (1.5 + 1) and > (3 + 1)? 4 == 4: the stable sort keeps w0 before w2
    assert [c[0] for c in ranked] == ["w1", "w0", "w2"]


def test_rerank_leaves_a_ranking_alone_when_nobody_is_inflated():
    det, _, _ = mesh()
    choices = [("w3", 9.0), ("w1", 0.0)]
    assert det.rerank(choices, lambda c: c[0], lambda c: c[1]) is choices


def test_small_absolute_differences_are_no_outlier():
    det, _, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, min_excess_s=0.01))
    feed(det, "w0", 0.055)  # 10% slower but only 5 ms
    feed(det, "w1", 0.001, itl=0.004)
    feed(det, "w2", 0.001, itl=0.0001)  # ITL 40x a peer's, but 4 ms
    assert det.factor("w0") == det.factor("w1") == 1.0


def test_a_very_slow_worker_is_ejected_then_probed_back_in():
    det, clock, transitions = mesh()
    feed(det, "w0", 0.5, itl=0.3)  # 10x its peers
    assert det.state("w0") is OutlierState.EJECTED
    assert not det.is_available("w0") and not det.allow_request("w0")
    assert det.predicted_ttft("w1") == pytest.approx(0.05)
    clock.t += 5.0  # the first ejection lasts base_ejection_s
    assert det.state("w0") is OutlierState.PROBING
    assert det.allow_request("w0")  # one probe at a time
    assert not det.is_available("w0") and not det.allow_request("w0")
    det.record_ttft("w0", 0.05)  # a good probe: frees the slot
    assert det.allow_request("w0")
    det.record_ttft("w0", 0.06)
    assert det.state("w0") is OutlierState.HEALTHY and det.factor("w0") == 1.0
    assert [t[2] for t in transitions] == [OutlierState.EJECTED, OutlierState.PROBING, OutlierState.HEALTHY]
    # Its slow past was dropped: a fresh healthy sample does not eject it again.
    det.record_ttft("w0", 0.05)
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY


def test_a_bad_probe_ejects_again_for_twice_as_long():
    det, clock, _ = mesh()
    feed(det, "w0", 0.5, itl=0.3)
    clock.t += 5.0
    assert det.allow_request("w0")
    det.record_ttft("w0", 0.5)
    assert det.state("w0") is OutlierState.EJECTED
    clock.t += 9.9
    assert det.state("w0") is OutlierState.EJECTED
    clock.t += 0.1
    assert det.state("w0") is OutlierState.PROBING


def test_a_cancelled_probe_frees_its_slot():
    det, clock, _ = mesh()
    feed(det, "w0", 0.5, itl=0.3)
    clock.t += 5.0
    assert det.allow_request("w0")
    det.release("w0")
    assert det.allow_request("w0")


def test_a_lost_probe_frees_its_slot_after_the_probe_timeout():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, probe_timeout_s=3.0))
    feed(det, "w0", 0.5, itl=0.3)
    clock.t += 5.0
    assert det.allow_request("w0") and not det.allow_request("w0")
    clock.t += 3.0
    assert det.allow_request("w0")


def test_never_more_than_the_share_of_workers_is_ejected():
    det, _, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, max_ejected_share=0.25))
    feed(det, "w0", 0.5, itl=0.3)
    feed(det, "w1", 0.5, itl=0.3)
    states = [det.state(f"w{i}") for i in range(4)]
    assert states.count(OutlierState.EJECTED) == 1  # floor(0.25 * 4) = 1
    # the one left in is still deprioritised
    slow = "w1" if states[0] is OutlierState.EJECTED else "w0"
    assert det.factor(slow) > 1


def test_of_two_workers_one_may_be_ejected_never_both():
    det, _, _ = mesh(workers=2)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED
    feed(det, "w1", 5.0, itl=3.0)  # its only peer is ejected: no one to compare with, and it is the last
    assert det.state("w1") is OutlierState.HEALTHY


def test_samples_leave_the_window():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, window_s=10.0))
    feed(det, "w0", 0.1)
    assert det.factor("w0") > 1
    clock.t += 11.0
    feed(det, "w0", 0.05, itl=0.03)
    for i in range(1, 4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    assert det.factor("w0") == 1.0


def test_a_long_queue_deprioritises_but_only_a_slow_decode_ejects():
    """TTFT carries the wait in the worker's queue, which the router made: a worker 10x
    later to its first token than its peers, but decoding as fast, is steered away from
    (its queue drains), never ejected; 10x slower per token, it is ejected."""
    det, _, transitions = mesh()
    feed(det, "w0", 0.5, itl=0.03)
    assert det.factor("w0") == pytest.approx(10.0)
    assert det.state("w0") is OutlierState.HEALTHY and transitions == []
    feed(det, "w1", 0.05, itl=0.3)
    assert det.state("w1") is OutlierState.EJECTED


def test_a_worker_queued_up_now_is_deprioritised_not_ejected():
    """The live view's TTFT (requests waiting there for a first message) is a queue too."""
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, live_eject_after_s=2.0))
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    for _ in range(4):  # four requests waiting on w0 for 3 s with nothing back
        det.track(Flight("w0", clock.t - 3.0))
    for _ in range(3):
        advance(det, clock, ("w1", "w2", "w3"), 1.0)
        det.evaluate()
    assert det.factor("w0") == pytest.approx(OutlierConfig().max_factor)
    assert det.state("w0") is OutlierState.HEALTHY


def with_outages(out: set[str], **cfg) -> tuple[OutlierDetector, Clock]:
    """Four alike workers; those in `out` are out for other reasons (not serving, breaker open)."""
    clock = Clock()
    config = OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=60.0, **cfg)
    det = OutlierDetector(config, clock, is_out=out.__contains__)
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    return det, clock


def test_workers_out_for_other_reasons_count_against_the_share():
    """One of four not serving (is_out) and one ejected: with share 0.5 no third goes out,
    and when a second stops answering, the ejected one is probed at once."""
    out = {"w3"}
    det, _ = with_outages(out, max_ejected_share=0.5)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED  # 2 of 4 out: the share
    feed(det, "w1", 0.5, itl=0.3)
    assert det.state("w1") is OutlierState.HEALTHY and det.factor("w1") > 1
    out.add("w2")  # three out of four now: the slow one is better than none
    det.evaluate()
    assert det.state("w0") is OutlierState.PROBING and det.allow_request("w0")


def test_a_worker_that_goes_out_after_an_ejection_has_the_ejected_one_probed_at_once():
    """The ejection moved the slow worker's load onto the others' spare capacity; when one
    of them stops answering, that capacity is gone: the ejected worker (recovered meanwhile
    here) is probed now, not at the end of its backoff, and comes back on good probes."""
    out: set[str] = set()
    det, clock = with_outages(out, probe_successes=2)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED  # 1 of 4 out
    clock.t += 1.0
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED and not det.allow_request("w0")  # nothing changed
    out.add("w1")  # 2 of 4 out: within the share, but not the capacity the ejection counted on
    det.evaluate()
    assert det.state("w0") is OutlierState.PROBING and det.allow_request("w0")
    det.record_ttft("w0", 0.05)
    det.release("w0")
    assert det.allow_request("w0")
    det.record_ttft("w0", 0.05)
    assert det.state("w0") is OutlierState.HEALTHY


def test_a_bad_early_probe_ejects_again_against_the_outages_of_then():
    out: set[str] = set()
    det, _ = with_outages(out)
    feed(det, "w0", 0.5, itl=0.3)
    out.add("w1")
    det.evaluate()
    assert det.allow_request("w0")  # probed early
    det.record_ttft("w0", 0.5)  # still slow
    assert det.state("w0") is OutlierState.EJECTED
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED  # the same outage does not probe it again
    out.add("w2")  # another one: probed again
    det.evaluate()
    assert det.state("w0") is OutlierState.PROBING


def with_queues(waiting: dict[str, int], **cfg) -> tuple[OutlierDetector, Clock]:
    """Four alike workers whose load reports say `waiting` requests wait at each (0 if absent)."""
    clock = Clock()
    config = OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=60.0, **cfg)
    det = OutlierDetector(config, clock, waiting=lambda wid: waiting.get(wid, 0))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    return det, clock


def test_a_slow_worker_whose_peers_are_queueing_is_deprioritised_not_ejected():
    """Ejecting it would move its share into queues that are already there (the faults
    study's overload); it stays in at a multiplied cost, and goes out once they have room."""
    waiting = {"w1": 3, "w2": 2, "w3": 2}  # 2.33 each on average: above the 1.0 of room
    det, _ = with_queues(waiting)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.HEALTHY and det.is_available("w0")
    assert det.factor("w0") == CFG.max_factor  # 10x its peers: the cap
    waiting.update(w1=1, w2=1, w3=0)  # 0.67 each
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED


def test_room_counts_only_the_peers_that_take_traffic():
    """A peer that is out (not serving here) holds requests it is not serving: its queue
    says nothing of the room the others have."""
    waiting = {"w3": 40}
    clock = Clock()
    config = OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=60.0)
    det = OutlierDetector(config, clock, is_out={"w3"}.__contains__, waiting=waiting.get)
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED  # w1 and w2 report nothing waiting


def test_an_ejected_worker_is_recalled_when_its_peers_queue_and_a_slow_probe_stays_in():
    """Peers past recall_waiting: the ejected worker is probed at once; its probe is still
    slow, but going out again would leave the queues to the others, so it is readmitted,
    deprioritised by the probe's ratio; it goes out again once they have room, on that
    verdict alone (no new sample needed), with its backoff grown."""
    waiting: dict[str, int] = {}
    det, clock = with_queues(waiting)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED
    waiting.update(w1=2, w2=2, w3=2)  # 2 each: not past 2.0
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED
    waiting.update(w1=3)  # 2.33 each
    det.evaluate()
    assert det.state("w0") is OutlierState.PROBING and det.allow_request("w0")
    det.record_ttft("w0", 0.25)  # 5x the peers
    assert det.state("w0") is OutlierState.HEALTHY and det.is_available("w0")
    assert det.factor("w0") == pytest.approx(5.0)
    det.evaluate()  # nothing new about it: the probe's verdict stands
    assert det.factor("w0") == pytest.approx(5.0) and det.state("w0") is OutlierState.HEALTHY
    waiting.update(w1=0, w2=1, w3=0)
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED
    clock.t += 60.0
    assert det.state("w0") is OutlierState.EJECTED  # 120 s now: the backoff grew
    clock.t += 60.0
    assert det.state("w0") is OutlierState.PROBING


def test_a_readmitted_worker_is_judged_afresh_by_what_it_does_next():
    """Readmitted, it is judged by its own new samples, not its slow past: a worker that
    recovered while it was out (its slowdown over) loses its multiplier as they come in."""
    waiting: dict[str, int] = {}
    det, _ = with_queues(waiting)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED
    waiting.update(w1=3, w2=3, w3=3)
    det.evaluate()  # the peers queue: recalled
    assert det.allow_request("w0")
    det.record_ttft("w0", 0.5)
    assert det.state("w0") is OutlierState.HEALTHY and det.factor("w0") == CFG.max_factor
    feed(det, "w0", 0.05, itl=0.03)  # fast again
    assert det.factor("w0") == 1.0 and det.state("w0") is OutlierState.HEALTHY


def test_with_room_unasked_a_slow_worker_is_ejected_whatever_the_queues():
    det, _ = with_queues({"w1": 9, "w2": 9, "w3": 9}, eject_room_waiting=-1.0)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED


def test_itl_counts_as_much_as_ttft():
    det, _, _ = mesh()
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.02)
    feed(det, "w2", 0.05, itl=0.2)
    assert det.state("w2") is OutlierState.EJECTED


def test_backoff_resets_after_a_long_healthy_stretch():
    det, clock, _ = mesh(
        OutlierConfig(min_samples=4, eval_interval_s=0.0, probe_successes=1, backoff_reset_s=60)
    )
    for _ in range(2):  # eject, probe back in, twice: the second ejection is 10 s
        feed(det, "w0", 0.5, itl=0.3)
        assert det.state("w0") is OutlierState.EJECTED
        clock.t += 10.0
        assert det.allow_request("w0")
        det.record_ttft("w0", 0.05)
        assert det.state("w0") is OutlierState.HEALTHY
    clock.t += 61.0
    for i in range(1, 4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    feed(det, "w0", 0.5, itl=0.3)
    assert det.state("w0") is OutlierState.EJECTED
    clock.t += 5.0
    assert det.state("w0") is OutlierState.PROBING


def test_predicted_ttft_falls_back_to_the_role_and_then_to_none():
    det, _, _ = mesh()
    det.record_ttft("new", 9.0)  # one sample of its own: too few; the role's median
    assert det.predicted_ttft("new") == pytest.approx(0.05)
    assert OutlierDetector(CFG, Clock()).predicted_ttft("w0") is None


def test_a_disabled_detector_ejects_nobody_but_still_predicts():
    det, _, transitions = mesh(OutlierConfig(enabled=False, min_samples=4, eval_interval_s=0.0))
    feed(det, "w0", 5.0)
    assert det.is_available("w0") and det.factor("w0") == 1.0 and not det.inflated
    assert det.state("w0") is OutlierState.HEALTHY and transitions == []
    assert det.predicted_ttft("w1") == pytest.approx(0.05)


def test_a_removed_worker_is_forgotten():
    det, _, _ = mesh()
    feed(det, "w0", 0.1)
    det.remove("w0")
    assert det.factor("w0") == 1.0 and not det.inflated


def test_the_config_is_checked():
    with pytest.raises(ValueError):
        OutlierConfig(deprioritise_ratio=4.0, eject_ratio=3.0)
    with pytest.raises(ValueError):
        OutlierConfig(eject_room_waiting=2.0, recall_waiting=1.0)
    with pytest.raises(ConfigError):
        build(OutlierConfig, None, {"PDMESH_OUTLIER_ENABLED": "maybe"}, "outlier_")
    assert build(OutlierConfig, None, {"PDMESH_OUTLIER_ENABLED": "false"}, "outlier_").enabled is False


def test_ttft_counts_per_unit_of_prefill_work():
    det, _, _ = mesh()
    for _ in range(8):  # w0 gets the long prompts: 9x the time for 9x the work
        det.record_ttft("w0", 0.45, prefill_blocks=8)
    assert det.factor("w0") == 1.0 and det.state("w0") is OutlierState.HEALTHY
    assert det.predicted_ttft("w1", prefill_blocks=3) == pytest.approx(0.2)


class Flight:
    """An attempt in flight as the detector reads it (services/router/attempt.py's fields)."""

    def __init__(self, worker_id: str, started: float, prefill_blocks: int = 0):
        self.worker_id, self.started, self.prefill_blocks = worker_id, started, prefill_blocks
        self.first_at: float | None = None
        self.last_at = started
        self.later_tokens = 0
        self.ended = False

    def tokens(self, at: float, n: int = 1) -> None:
        if self.first_at is None:
            self.first_at = at
        else:
            self.later_tokens += n
        self.last_at = at


def streaming(det, clock, worker: str, gap: float, n: int = 3, age: float = 1.0) -> list[Flight]:
    """`n` attempts on `worker`, streaming for `age` seconds, a token every `gap`, the last now."""
    out = []
    later = max(1, round(age / gap))
    for _ in range(n):
        first = clock.t - later * gap
        f = Flight(worker, first - 0.05)
        for k in range(later + 1):
            f.tokens(first + k * gap)
        det.track(f)
        out.append(f)
    return out


def advance(det, clock, workers, seconds: float, gap: float = 0.03, gaps: dict | None = None) -> None:
    """The clock moves on by `seconds`; the streams on `workers` get a token every `gap`
    (or every `gaps[worker]`), in steps of 10 ms."""
    gaps = {**{w: gap for w in workers}, **(gaps or {})}
    end = clock.t + seconds
    due = {w: clock.t + g for w, g in gaps.items()}
    while clock.t < end - 1e-9:
        clock.t = min(clock.t + 0.01, end)
        for w, g in gaps.items():
            if clock.t >= due[w] - 1e-9:
                due[w] += g
                for f in det._workers[w].live:
                    f.tokens(clock.t)


def test_a_worker_turning_slow_is_ejected_from_its_requests_in_flight_before_any_ends():
    # Every worker's window says 50 ms (30 s of healthy history); w0's streams in flight now
    # take 150 ms a token against its peers' 30 ms. No request has ended, so no new sample.
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=5.0))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    flights = streaming(det, clock, "w0", 0.15)
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    det.evaluate()
    # At once: steered away in proportion (5x), not yet ejected (the live view must say so
    # for live_eject_after_s, 2 s: a CPU-starved moment must not take a worker out).
    assert det.state("w0") is OutlierState.HEALTHY and det.factor("w0") == pytest.approx(5.0, rel=0.1)
    advance(det, clock, ("w1", "w2", "w3"), 1.0, gaps={"w0": 0.15})
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY
    advance(det, clock, ("w1", "w2", "w3"), 1.05, gaps={"w0": 0.15})
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED
    assert all(det.state(f"w{i}") is OutlierState.HEALTHY for i in (1, 2, 3))
    for f in flights:  # ended attempts leave the live view
        f.ended = True
    det.evaluate()
    assert det._workers["w0"].live == []


def test_without_the_live_view_the_same_worker_is_not_ejected():
    det, clock, _ = mesh(
        OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=5.0, live_enabled=False)
    )
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    streaming(det, clock, "w0", 0.15)
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY


def test_a_stopped_worker_is_seen_by_the_gap_its_streams_are_in_now():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    for i in range(4):
        streaming(det, clock, f"w{i}", 0.03)  # all alike so far
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY
    advance(det, clock, ("w1", "w2", "w3"), 0.5)  # w0 stops; the others' streams go on
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY and det.factor("w0") > 5  # steered away at once
    advance(det, clock, ("w1", "w2", "w3"), 2.05)
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED


def test_one_live_attempt_is_not_enough_and_a_slow_probe_is_ejected_again():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, base_ejection_s=5.0))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    streaming(det, clock, "w0", 0.3, n=1)  # one slow stream: below live_min_attempts
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY
    feed(det, "w0", 0.5, itl=0.3)  # the window ejects it
    assert det.state("w0") is OutlierState.EJECTED
    for f in (f for o in det._workers.values() for f in o.live):
        f.ended = True
    clock.t += 5.0
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    assert det.allow_request("w0")  # PROBING: one probe
    probe = Flight("w0", clock.t)
    det.track(probe)
    probe.tokens(clock.t + 0.05)
    clock.t += 0.05
    det.evaluate()
    assert det.state("w0") is OutlierState.PROBING  # its first token came in time
    advance(det, clock, ("w1", "w2", "w3"), 0.6)  # then nothing for 600 ms, against 30 ms a token
    det.evaluate()
    assert det.state("w0") is OutlierState.EJECTED


def test_young_streams_are_not_judged_the_os_may_have_delayed_a_gap_or_two():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, live_min_age_s=0.5))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    for i in (1, 2, 3):
        streaming(det, clock, f"w{i}", 0.03)
    streaming(det, clock, "w0", 0.15, age=0.3)  # 5x slower, but for 0.3 s only
    det.evaluate()
    assert det.factor("w0") == 1.0
    streaming(det, clock, "w0", 0.15, age=0.6)
    det.evaluate()
    assert det.factor("w0") > 1.0


def test_a_moment_of_live_slowness_deprioritises_but_does_not_eject():
    det, clock, _ = mesh(OutlierConfig(min_samples=4, eval_interval_s=0.0, live_eject_after_s=2.0))
    for i in range(4):
        feed(det, f"w{i}", 0.05, itl=0.03)
    for i in range(4):
        streaming(det, clock, f"w{i}", 0.03)
    advance(det, clock, ("w0", "w1", "w2", "w3"), 0.5, gaps={"w0": 0.15})  # w0 late for 1.5 s
    det.evaluate()
    advance(det, clock, ("w0", "w1", "w2", "w3"), 1.0, gaps={"w0": 0.15})
    det.evaluate()
    assert det.factor("w0") > 1.0
    advance(det, clock, ("w0", "w1", "w2", "w3"), 1.0)  # and back to its peers' pace
    det.evaluate()
    assert det.state("w0") is OutlierState.HEALTHY


def test_rerank_charges_only_the_slowness_the_cost_does_not_already_carry():
    """Routing on measured speed (worker_profile.py) already multiplied w0's cost by its speed
    factor; the detector's factor on top would count the same slowness twice."""
    det, _, _ = mesh()
    feed(det, "w0", 0.1)  # factor 2
    choices = [("w0", 1.0), ("w1", 1.5)]
    explained = {"w0": 2.0}.get
    assert [
        c[0] for c in det.rerank(choices, lambda c: c[0], lambda c: c[1], lambda w: explained(w, 1.0))
    ] == [
        "w0",
        "w1",
    ]
    # Half of it explained: (1 + 1) * 2 / 1.25 = 3.2 > 2.5
    assert [c[0] for c in det.rerank(choices, lambda c: c[0], lambda c: c[1], lambda w: 1.25)] == ["w1", "w0"]
    # A factor below 1 (a faster worker) explains nothing: the detector's whole factor applies.
    assert [c[0] for c in det.rerank(choices, lambda c: c[0], lambda c: c[1], lambda w: 0.5)] == ["w1", "w0"]
