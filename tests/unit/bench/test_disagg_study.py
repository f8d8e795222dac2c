"""bench/disagg.py's scoring: goodput and SLO attainment (the figures the study's verdict rests on)."""

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
