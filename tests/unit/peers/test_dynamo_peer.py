"""The pure helpers of the Dynamo side-by-side (bench/peers/dynamo): no Dynamo venv needed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.peers.dynamo.compare import (
    Row,
    balance,
    format_table,
    ideal_prefix_reuse,
    make_row,
    mean_of,
    metric,
    parse_prometheus,
    summary_line,
)
from bench.peers.dynamo.make_model_folder import DEFAULT_VOCAB, EOS_ID, FIRST_WORD_ID, write_folder
from bench.peers.dynamo.run import bursts, pin_threads
from bench.stats import RequestRecord

METRICS = """\
# HELP dynamo_frontend_cached_tokens cached
# TYPE dynamo_frontend_cached_tokens histogram
dynamo_frontend_cached_tokens_sum{model="dm"} 928
dynamo_frontend_cached_tokens_count{model="dm"} 3
dynamo_router_overhead_total_ms_sum{router_id="1"} 0.5
dynamo_router_overhead_total_ms_count{router_id="1"} 2
vllm:num_preemptions_total{engine="0",model_name="dm"} 4
vllm:num_preemptions_total{engine="1",model_name="dm"} 1
weird line without value
plain_metric 7
"""


def test_parse_prometheus_sums_label_sets_and_skips_junk():
    s = parse_prometheus(METRICS)
    assert metric(s, "plain_metric") == 7
    assert metric(s, "vllm:num_preemptions_total") == 5
    assert metric(s, "vllm:num_preemptions_total", engine="1") == 1
    assert metric(s, "absent") == 0.0
    assert mean_of(s, "dynamo_router_overhead_total_ms") == pytest.approx(0.25)
    assert math.isnan(mean_of(s, "absent"))


def test_balance_counts_idle_workers():
    assert balance([5, 5, 5, 5], 4)["busiest_over_mean"] == pytest.approx(1.0)
    assert balance([8], 4)["busiest_over_mean"] == pytest.approx(4.0)  # three idle workers
    assert math.isnan(balance([], 2)["busiest_over_mean"])


def test_ideal_prefix_reuse_counts_full_blocks_of_repeated_prefixes():
    a = list(range(8))
    b = [*a[:4], 100, 101, 102, 103]  # shares the first block of 4 with a
    assert ideal_prefix_reuse([a, a], 4) == pytest.approx(8 / 16)
    assert ideal_prefix_reuse([a, b], 4) == pytest.approx(4 / 16)
    # A repeated block after a different one is not a prefix hit.
    c = [9, 9, 9, 9, *a[4:]]
    assert ideal_prefix_reuse([a, c], 4) == 0.0
    assert math.isnan(ideal_prefix_reuse([], 4))


def record(i: int, ttft: float, gaps: list[float], cached: int, prompt: int = 100) -> RequestRecord:
    r = RequestRecord(f"r{i}", float(i), float(i), prompt, len(gaps) + 1)
    t = r.send_s + ttft
    r.add_message(t, 1)
    for g in gaps:
        t += g
        r.add_message(t, 1)
    r.ok, r.end_s, r.cached_tokens = True, t, cached
    return r


def test_rows_table_and_summary_line():
    d = make_row("dynamo", "kv", "x4 (11.4/s)", [record(i, 0.05, [0.01] * 4, 50) for i in range(10)], 1.5)
    p = make_row("pdmesh", "kv", "x4 (11.4/s)", [record(i, 0.10, [0.02] * 4, 25) for i in range(10)], 5.0)
    assert d.ttft_p50 == pytest.approx(50.0) and p.itl_p50 == pytest.approx(20.0)
    assert d.prefix_reuse == pytest.approx(0.5) and p.prefix_reuse == pytest.approx(0.25)
    table = format_table([p, d])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["system", "policy", "rate"]
    assert lines[1].startswith("dynamo") and lines[2].startswith("pdmesh")  # systems side by side
    assert "10/10" in lines[1]
    line = summary_line([d, p], {"overhead_ms_dynamo": 2.5, "router_decision_ms_dynamo": math.nan})
    kv = dict(part.split("=") for part in line.split()[1:])
    assert line.startswith("dynamo_vs_pdmesh ")
    assert kv["ttft_p50_kv_x4"] == "0.50"
    assert kv["itl_p50_kv_x4"] == "0.50"
    assert kv["reuse_kv_x4"] == "0.500/0.250"
    assert kv["overhead_ms_dynamo"] == "2.50" and kv["router_decision_ms_dynamo"] == "n/a"


def test_summary_line_skips_a_pair_with_one_system():
    d = Row("dynamo", "round_robin", "x2 (5/s)", 1, 1, 1, 1, 1, 1, 1, 1, 1, 0.1)
    assert summary_line([d]) == "dynamo_vs_pdmesh "


def test_model_folder_is_shared_by_both_tokenizer_paths(tmp_path):
    from tokenizers import Tokenizer

    from services.model.model_config import ModelConfig

    out = tmp_path / "model"
    assert write_folder(out) is True
    assert write_folder(out) is False  # idempotent
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == DEFAULT_VOCAB
    ids = [FIRST_WORD_ID, 500, DEFAULT_VOCAB - 1]
    assert tok.decode(ids) == f"w{FIRST_WORD_ID} w500 w{DEFAULT_VOCAB - 1}"
    assert tok.encode(tok.decode(ids)).ids == ids  # every word id round-trips
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS_ID
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    cfg = ModelConfig.from_hf_folder(out)  # what pdmesh's sim workers, router and gateway read
    assert cfg.vocab_size == DEFAULT_VOCAB and cfg.eos_token_ids == (EOS_ID,)


def test_http_client_does_not_count_a_finish_only_chunk_as_a_token():
    from bench.peers.dynamo.run import HttpClient

    rec = RequestRecord("r", 0.0, 0.0, 10, 2)
    total = None
    chunks = [  # pdmesh's gateway: a chunk per token, then finish_reason alone, then usage
        {"choices": [{"text": "w5", "finish_reason": None}]},
        {"choices": [{"text": " w6", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 8},
            },
        },
    ]
    for t, c in enumerate(chunks):
        total = HttpClient._on_chunk(rec, c, float(t), total)
    assert rec.token_counts == [1, 1] and rec.finish_reason == "length"
    assert total == 2 and rec.cached_tokens == 8
    # Dynamo's continuous usage: a finish chunk repeating the count adds no token either.
    rec2, total = RequestRecord("d", 0.0, 0.0, 10, 1), None
    for t, c in enumerate(
        [
            {"choices": [{"text": " w7"}], "usage": {"completion_tokens": 1}},
            {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 1}},
        ]
    ):
        total = HttpClient._on_chunk(rec2, c, float(t), total)
    assert rec2.token_counts == [1] and rec2.finish_reason == "length"


def test_pin_moves_every_thread_of_a_process_threads_created_before_it_too():
    # --pin: a process's affinity is per thread, so pinning only its pid would leave the
    # threads it had already started (engine step threads, tokio workers) where they were.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    code = (
        "import threading, sys\n"
        "ev = threading.Event()\n"
        "threading.Thread(target=ev.wait, daemon=True).start()\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "up\n"
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 2
        pin_threads(child.pid, {cpus[0]})
        assert all(os.sched_getaffinity(t) == {cpus[0]} for t in tids)
    finally:
        child.kill()
        child.wait()


def test_pin_split_puts_engines_and_fronts_apart_and_works_again_after_pinning_itself():
    # The bench pins itself (the client) with the fronts; the next run's call must still see
    # every CPU of the machine, not the one it was left on.
    from types import SimpleNamespace

    from bench.peers.dynamo.run import pin_split

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for k in kids:
            assert k.stdout.readline() == "up\n"
        dep = SimpleNamespace(worker_pids=[kids[0].pid], front_pids={"front": kids[1].pid})
        for _ in range(2):
            pin_split(dep)  # type: ignore[arg-type]
            assert os.sched_getaffinity(kids[0].pid) == {cpus[0]}
            assert os.sched_getaffinity(kids[1].pid) == set(cpus[1:])
            assert os.sched_getaffinity(0) == set(cpus[1:])
    finally:
        pin_threads(os.getpid(), set(cpus))  # every thread of this test process, as pin_split pinned them
        for k in kids:
            k.kill()
            k.wait()


def test_paired_ttft_pairs_by_the_loads_index_and_takes_the_median_of_differences():
    from bench.peers.dynamo.compare import paired_ttft

    def rec(run: str, i: int, prompt: int, ttft_ms: float | None) -> RequestRecord:
        r = RequestRecord(f"lg-{run}-{i}", 0.0, 1.0, prompt, 4)
        if ttft_ms is not None:
            r.add_message(1.0 + ttft_ms / 1e3, 1)
        return r

    # A is faster on every request by 1-3 ms, but its TTFTs are spread so that the difference of
    # the two medians (40 ms) says nothing about any request.
    a = [
        rec("aaa", 0, 100, 10.0),
        rec("aaa", 1, 200, 50.0),
        rec("aaa", 2, 3000, 90.0),
        rec("aaa", 3, 300, 5.0),
    ]
    b = [
        rec("bbb", 2, 3000, 93.0),
        rec("bbb", 0, 100, 12.0),
        rec("bbb", 1, 200, 51.0),
        rec("bbb", 3, 300, None),
    ]
    bands, total = paired_ttft(a, b)
    assert total.n == 3  # request 3 has no first token in B: left out
    assert total.diff_p50_ms == pytest.approx(2.0)
    assert [(x.lo, x.hi, x.n) for x in bands] == [(0, 500, 2), (2000, 4000, 1)]
    assert bands[0].a_p50_ms == pytest.approx(30.0) and bands[0].b_p50_ms == pytest.approx(31.5)
    assert bands[1].diff_p50_ms == pytest.approx(3.0)


def test_cpu_split_recovers_the_background_per_request_and_per_token_costs():
    from bench.peers.dynamo.cpu_split import Sample, split

    idle, per_request, per_token = 0.004, 0.003, 150e-6  # CPU-s per s, per request, per token

    def sample(requests: int, tokens: int, duration: float) -> Sample:
        cpu = idle * duration + requests * per_request + tokens * per_token
        return Sample(front_s=cpu, workers_s=2 * cpu, requests=requests, tokens=tokens, duration_s=duration)

    one, full = sample(300, 300, 26.0), sample(300, 14_000, 27.5)
    s = split(idle, one, full, "front_s")
    assert (s.idle_ms_per_s, s.per_request_ms, s.per_token_us) == pytest.approx((4.0, 3.0, 150.0))
    w = split(2 * idle, one, full, "workers_s")
    assert (w.per_request_ms, w.per_token_us) == pytest.approx((6.0, 300.0))
    with pytest.raises(ValueError):
        split(idle, full, one, "front_s")


def test_bursts_count_the_instants_and_how_many_arrive_at_once():
    # 3 at 0 s, 1 at 0.75 s, 2 at 1.5 s: a request is in a burst of (9 + 1 + 4) / 6 on average
    line = bursts([0.0, 0.0, 0.0, 0.75, 1.5, 1.5])
    assert line == "arrivals at 3 instants, 1-3 at once (2.3 on average for a request)"
