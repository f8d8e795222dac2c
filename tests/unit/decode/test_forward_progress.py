"""The forward-progress readiness rule (services/worker/progress.py) on a fake clock."""

from __future__ import annotations

import pytest

from services.worker.progress import ForwardProgress, NotServingReason
from tests.unit.router.fakes import FakeClock


def rule(stall_s: float = 5.0) -> tuple[ForwardProgress, FakeClock]:
    clock = FakeClock()
    return ForwardProgress(stall_s, clock), clock


def test_work_without_progress_for_stall_s_is_not_serving_with_the_reason():
    fp, clock = rule(5.0)
    assert fp.observe(busy=True, work=100).serving
    clock.advance(4.9)
    v = fp.observe(busy=True, work=100)
    assert v.serving and v.no_progress_s == pytest.approx(4.9)
    clock.advance(0.1)
    v = fp.observe(busy=True, work=100)
    assert not v.serving
    assert v.reason is NotServingReason.NO_PROGRESS and v.reason.value == "no_progress"
    assert v.no_progress_s == pytest.approx(5.0)
    assert "no_progress" in v.detail


def test_tokens_flowing_again_recover_at_once():
    fp, clock = rule(2.0)
    fp.observe(True, 10)
    clock.advance(3.0)
    assert not fp.observe(True, 10).serving
    clock.advance(0.5)
    v = fp.observe(True, 11)  # one token computed
    assert v.serving and v.reason is NotServingReason.NONE and v.no_progress_s == 0.0
    assert fp.verdict is v


def test_a_busy_worker_that_keeps_computing_is_never_stalled_however_long():
    fp, clock = rule(1.0)
    for i in range(100):
        clock.advance(0.9)  # slow steps, each under stall_s
        assert fp.observe(True, i).serving


def test_an_idle_worker_is_serving_and_its_idle_time_does_not_count():
    fp, clock = rule(1.0)
    fp.observe(False, 7)
    clock.advance(60.0)
    assert fp.observe(False, 7).serving
    # Work arrives now: its stall clock starts now, not at the last token an hour ago.
    assert fp.observe(True, 7).serving
    clock.advance(0.5)
    assert fp.observe(True, 7).serving
    clock.advance(0.5)
    assert not fp.observe(True, 7).serving


def test_work_gone_clears_a_stall():
    fp, clock = rule(1.0)
    fp.observe(True, 0)
    clock.advance(2.0)
    assert not fp.observe(True, 0).serving
    assert fp.observe(False, 0).serving  # its requests were aborted elsewhere and freed


def test_stall_s_must_be_positive():
    with pytest.raises(ValueError):
        ForwardProgress(0)
