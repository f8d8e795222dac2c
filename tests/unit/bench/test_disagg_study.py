"""bench/disagg.py's scoring: goodput and SLO attainment (the figures the study's verdict rests on)."""

import os
import subprocess
import sys

import pytest

from bench.disagg import Baseline, best_rate, misses
from bench.stats import RequestRecord


def test_goodput_is_the_highest_rate_every_lower_rate_also_sustains():
    assert best_rate([(0.5, 0.95), (1.0, 0.78), (1.5, 0.90)]) == 0.5  # 1.5 passing by luck does not count
    assert best_rate([(1.0, 0.90), (0.5, 1.0), (1.5, 0.89)]) == 1.0  # order of the sweep does not matter
    assert best_rate([(0.5, 0.85), (1.0, 0.95)]) == 0.0


def record(ttft_s: float | None, ok: bool = True, prompt: int = 100) -> RequestRecord:
    r = RequestRecord("r", 0.0, 0.0, prompt, 4, ok=ok)
    if ttft_s is not None:
        for i in range(4):  # tokens 20 ms apart after the first
            r.add_message(ttft_s + 0.02 * i, 1)
        r.end_s = ttft_s + 0.06
    return r


def test_attainment_counts_ttft_and_tpot_misses_and_failures():
    base = Baseline(ttft_a=0.0, ttft_b=0.001, tpot=0.02)  # TTFT SLO 0.3 s at 100 tokens, TPOT SLO 30 ms
    recs = [record(0.1), record(0.5), record(None, ok=False)]
    att, ttft_miss, tpot_miss = misses(recs, base)
    assert (round(att, 3), ttft_miss, tpot_miss) == (0.333, 2, 1)


def test_repetitions_get_t_intervals_and_points_wilson_intervals():
    from bench.disagg import mean_ci, wilson

    # Three repetitions: mean 1.0, s = 0.1, t(0.975, 2) = 4.303 -> half-width 0.248.
    assert mean_ci([0.9, 1.0, 1.1]) == "1 [0.752, 1.25]"
    assert mean_ci([0.5]) == "0.5"
    lo, hi = wilson(54, 60)  # 90% of 60 requests
    assert 0.79 < lo < 0.80 and 0.95 < hi < 0.96
    assert wilson(0, 0) == (0.0, 1.0)


def test_relative_rates_are_in_units_of_the_measured_unbatched_capacity():
    from bench.disagg import Workload, capacity

    base = Baseline(ttft_a=0.0, ttft_b=0.001, tpot=0.02)
    # 1,000 tokens in (1 s) and 51 out (50 x 20 ms = 1 s): 2 s a request, 2 workers: 1 req/s.
    assert capacity(base, Workload("w", [(1000, 51)] * 4)) == pytest.approx(1.0)
    # The machine 6x slower: the unit follows, so a relative rate keeps its load level.
    slow = Baseline(ttft_a=0.0, ttft_b=0.006, tpot=0.12)
    assert capacity(slow, Workload("w", [(1000, 51)])) == pytest.approx(1 / 6)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin needs 2 CPUs")
def test_pin_puts_each_worker_on_its_own_cpu_prefill_first():
    """`--pin`: every thread of the prefill worker on the first CPU, of the decode worker on the
    second (real processes with a thread started before the pinning)."""
    from types import SimpleNamespace

    from bench.disagg import pin_workers

    # Two threads that block until the process is killed: the main one and one it started.
    code = "import threading; threading.Thread(target=threading.Event().wait).start(); print(flush=True); threading.Event().wait()"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"\n"  # its second thread is up
        prefill, decode = (SimpleNamespace(proc=p) for p in procs)
        pin_workers(SimpleNamespace(prefills=[prefill], decodes=[decode]))
        cpus = sorted(os.sched_getaffinity(0))
        for p, cpu in zip(procs, cpus, strict=False):
            tids = os.listdir(f"/proc/{p.pid}/task")
            assert len(tids) == 2
            assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tids)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
