"""bench.stats: metric definitions against hand-computed numbers."""

import gzip
import math
from dataclasses import replace

import pytest

from bench.stats import Dist, RequestRecord, format_summary, read_run, summarize, summary_kv, write_records


def rec(
    rid: str, send: float, msgs: list[tuple[float, int]], ok: bool = True, code: str = ""
) -> RequestRecord:
    r = RequestRecord(rid, scheduled_s=send, send_s=send, prompt_tokens=8, max_tokens=4)
    for t, n in msgs:
        r.add_message(t, n)
    r.ok, r.error_code = ok, code
    r.end_s = msgs[-1][0] if msgs else send + 0.05
    return r


# Five successful requests (TTFT 0.1, 0.2, 0.3, 0.4, 1.0) and three failures.
RECORDS = [
    rec("r1", 0.0, [(0.1, 1), (0.2, 1), (0.3, 1)]),  # TPOT 0.2/2 = 0.1; ITL 0.1 0.1
    rec("r2", 0.0, [(0.2, 2), (0.5, 2)]),  # TPOT 0.3/3 = 0.1; ITL 0 | 0.3 0
    rec("r3", 1.0, [(1.3, 1)]),  # one token: no TPOT, no ITL
    rec("r4", 2.0, [(2.4, 1), (2.6, 1), (3.4, 1)]),  # TPOT 1.0/2 = 0.5; ITL 0.2 0.8
    rec("r5", 3.0, [(4.0, 3), (4.2, 1)]),  # TPOT 0.2/3; ITL 0 0 | 0.2
    rec("f1", 4.0, [], ok=False, code="RESOURCE_EXHAUSTED"),
    rec("f2", 4.5, [(4.6, 1)], ok=False, code="UNAVAILABLE"),  # partial stream, still a failure
    rec("f3", 5.0, [], ok=False, code="UNAVAILABLE"),
]


def test_percentiles_match_hand_computed_values():
    s = summarize(RECORDS, slo_ttft_s=0.35, slo_tpot_s=0.15, duration_s=10.0)
    approx = pytest.approx
    # TTFT sorted 0.1 0.2 0.3 0.4 1.0; linear rank p*(n-1): p90 -> 3.6, p99 -> 3.96.
    assert (s.ttft.count, s.ttft.p50, s.ttft.p90, s.ttft.p99, s.ttft.mean) == (
        5,
        approx(0.3),
        approx(0.4 + 0.6 * 0.6),
        approx(0.4 + 0.96 * 0.6),
        approx(0.4),
    )
    # TPOT sorted 0.0667 0.1 0.1 0.5 (r3 has none): p50 rank 1.5, p90 2.7, p99 2.97.
    assert s.tpot.count == 4
    assert (s.tpot.p50, s.tpot.p90, s.tpot.p99) == (approx(0.1), approx(0.38), approx(0.488))
    assert s.tpot.mean == approx((0.1 + 0.1 + 0.5 + 0.2 / 3) / 4)
    # ITL sorted 0 0 0 0 0.1 0.1 0.2 0.2 0.3 0.8: ranks 4.5, 8.1, 8.91.
    assert s.itl.count == 10  # sum of (output tokens - 1)
    assert (s.itl.p50, s.itl.p90, s.itl.p99, s.itl.mean) == (
        approx(0.1),
        approx(0.35),
        approx(0.755),
        approx(0.17),
    )
    # ICL: one gap per message, no zeros: 0.1 0.1 0.3 0.2 0.8 0.2.
    assert s.icl.count == 6 and s.icl.mean == approx(1.7 / 6)
    # E2E sorted 0.3 0.3 0.5 1.2 1.4.
    assert (s.e2e.p50, s.e2e.p90, s.e2e.p99, s.e2e.mean) == (
        approx(0.5),
        approx(1.32),
        approx(1.392),
        approx(0.74),
    )


def test_counts_throughput_goodput_and_attainment_count_failures_as_misses():
    s = summarize(RECORDS, slo_ttft_s=0.35, slo_tpot_s=0.15, duration_s=10.0)
    assert (s.requests, s.ok, s.failed) == (8, 5, 3)
    assert s.errors_by_code == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s.output_tokens == 15  # failed f2's token is not counted
    assert s.output_tok_s == pytest.approx(1.5)
    assert s.request_rps == pytest.approx(0.5)
    # r1, r2 and r3 (one token: TPOT passes) meet both; r4, r5 miss TTFT.
    assert s.goodput_rps == pytest.approx(0.3)
    assert s.slo_attainment == pytest.approx(3 / 8)


def test_slo_limits_are_inclusive():
    # Binary fractions so the comparison is exact: TTFT 0.25, TPOT 0.5/2 = 0.25.
    r = rec("x", 1.0, [(1.25, 1), (1.5, 1), (1.75, 1)])
    assert summarize([r], 0.25, 0.25, 1.0).slo_attainment == 1.0
    assert summarize([r], 0.25, 0.125, 1.0).slo_attainment == 0.0
    assert summarize([r], 0.125, 0.25, 1.0).slo_attainment == 0.0


def test_all_failed_gives_zero_attainment_and_empty_distributions():
    s = summarize([rec("f", 0.0, [], ok=False, code="UNAVAILABLE")] * 3, 1.0, 1.0, 2.0)
    assert s.slo_attainment == 0.0 and s.goodput_rps == 0.0
    assert s.ttft.count == 0 and math.isnan(s.ttft.p50)


def test_tpot_and_itl_on_multi_token_messages():
    # Messages: 3 tokens at 1.0, 1 at 1.5, 2 at 2.5 -> 6 tokens.
    r = rec("m", 0.5, [(1.0, 3), (1.5, 1), (2.5, 2)])
    assert r.output_tokens == 6
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(1.5 / 5)  # (last - first) / (tokens - 1)
    assert r.itl_s() == pytest.approx([0.0, 0.0, 0.5, 1.0, 0.0])  # k-1 zeros after each gap
    assert r.icl_s() == pytest.approx([0.5, 1.0])
    assert sum(r.itl_s()) / len(r.itl_s()) == pytest.approx(r.tpot_s)


def test_one_token_output_has_no_tpot_and_one_message_of_several_tokens_has_zero_itl():
    assert rec("a", 0.0, [(0.5, 1)]).tpot_s is None
    b = rec("b", 0.0, [(0.5, 4)])
    assert b.tpot_s == 0.0 and b.itl_s() == [0.0, 0.0, 0.0]


def test_server_usage_count_sets_tpot_denominator():
    r = rec("u", 0.0, [(1.0, 1), (2.0, 1)])
    r.output_tokens = 5  # server says 5 tokens arrived in 2 messages (no per-chunk counts)
    assert r.tpot_s == pytest.approx(1.0 / 4)


def test_add_message_rejects_empty_message():
    with pytest.raises(ValueError):
        RequestRecord("e", 0.0, 0.0, 1, 1).add_message(1.0, 0)


def test_jsonl_round_trip_with_meta(tmp_path):
    path = tmp_path / "run.jsonl"
    records = [replace(RECORDS[0], worker_id="w1", prefill_path="remote", cached_tokens=4), *RECORDS[1:]]
    write_records(path, records, meta={"length_factor": 16, "time_factor": 2})
    meta, back = read_run(path)
    assert meta == {"length_factor": 16, "time_factor": 2}
    assert back == records


def test_a_gzipped_run_reads_back_the_same(tmp_path):
    path = tmp_path / "run.jsonl"
    write_records(path, RECORDS, meta={"system": "x"})
    gz = tmp_path / "run.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_run(gz) == read_run(path) == ({"system": "x"}, list(RECORDS))


def test_read_rejects_unknown_fields_with_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(RECORDS[0].to_json() + "\n" + RECORDS[1].to_json().replace('"ok"', '"okay"') + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: unknown RequestRecord fields \['okay'\]"):
        read_run(path)


def test_duration_defaults_to_first_send_to_last_end():
    s = summarize(RECORDS[:2])
    assert s.duration_s == pytest.approx(0.5)


def test_dist_of_empty_is_nan():
    d = Dist.of([])
    assert d.count == 0 and all(math.isnan(v) for v in (d.mean, d.p50, d.p90, d.p99))


def test_every_summary_line_states_the_scaling():
    s = summarize(RECORDS, 0.35, 0.15, 10.0)
    text = format_summary(s, "length_factor=16 time_factor=2")
    lines = text.splitlines()
    assert len(lines) >= 8 and all(line.endswith("[length_factor=16 time_factor=2]") for line in lines)
    assert "ttft_ms n=5 mean=400.00 p50=300.00 p90=760.00 p99=976.00" in text
    kv = summary_kv(s)
    assert kv["ok"] == "5" and kv["errors"] == "3" and kv["slo_attainment"] == "0.375"
    assert kv["ttft_p50_ms"] == "300.00" and kv["goodput_rps"] == "0.300"


def test_send_lag_covers_every_request():
    late = replace(RECORDS[5], scheduled_s=3.5)  # a failed request sent 0.5 s after its arrival
    s = summarize([*RECORDS[:5], late], 1.0, 1.0, 10.0)
    assert s.send_lag.count == 6
    assert s.send_lag.p50 == 0.0 and s.send_lag.mean == pytest.approx(0.5 / 6)
