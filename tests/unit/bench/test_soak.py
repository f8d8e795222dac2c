"""bench/soak.py's pure helpers: latency windows, RSS drift, /proc parsing."""

import os

import pytest

from bench.soak import rss_mb, rss_report, windows
from bench.stats import RequestRecord


def rec(send: float, e2e: float | None, ok: bool = True) -> RequestRecord:
    r = RequestRecord(f"r{send}", scheduled_s=send, send_s=send, prompt_tokens=4, max_tokens=2)
    if e2e is not None:
        r.add_message(send + e2e, 1)
    r.ok = ok
    return r


def test_windows_count_by_send_time_and_take_p99_of_successes_only():
    records = [rec(1.0, 0.1), rec(2.0, 0.3), rec(3.0, None, ok=False), rec(11.0, 0.5)]
    (n0, err0, p0), (n1, err1, p1) = windows(records, window_s=10.0)
    assert (n0, err0, n1, err1) == (3, 1, 1, 0)
    assert p0 == pytest.approx(298.0)  # numpy's linear p99 of 100 and 300 ms
    assert p1 == pytest.approx(500.0)


def test_rss_drift_counts_only_processes_that_lived_half_the_run():
    samples = [
        (0.0, "router", 60.0),
        (10.0, "router", 61.0),  # first sample after the warm-up
        (100.0, "router", 64.0),
        (80.0, "decode-0.1", 300.0),  # a late incarnation: reported, not counted
        (100.0, "decode-0.1", 400.0),
    ]
    lines, worst = rss_report(samples, t0=0.0, warm_s=10.0, run_s=100.0)
    assert worst == pytest.approx(3.0)
    assert any("decode-0.1" in line and "+100.0" in line for line in lines)


def test_rss_of_this_process_and_of_no_process():
    assert rss_mb(os.getpid()) > 1.0
    assert rss_mb(2**22 + 12345) is None
