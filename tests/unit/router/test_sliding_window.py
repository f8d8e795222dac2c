import pytest

from services.router.sliding_window import SlidingWindow


def test_counts_leave_the_window_bucket_by_bucket():
    w = SlidingWindow(window_s=10, buckets=10, fields=2)
    w.add(100.0, 0)
    w.add(104.5, 1, 3)
    assert w.totals(104.9) == [1, 3]
    assert w.totals(109.9) == [1, 3]
    assert w.totals(110.0) == [0, 3]  # the slot of t=100 fell out
    assert w.totals(115.0) == [0, 0]


def test_a_reused_ring_slot_starts_from_zero():
    w = SlidingWindow(window_s=1, buckets=2)
    w.add(0.1)
    w.add(1.1)  # same ring index as 0.1, next lap
    assert w.total(1.1) == 1
    w.reset()
    assert w.total(1.1) == 0


def test_invalid_shapes_are_refused():
    with pytest.raises(ValueError):
        SlidingWindow(0, 10)
    with pytest.raises(ValueError):
        SlidingWindow(1, 0)
