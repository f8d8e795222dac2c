"""bench.loadgen: arrivals, bounds, workloads and the run loop (no network)."""

import numpy as np
import pytest

from bench import loadgen
from bench.loadgen import SseParser, WorkItem, build_workload, check_bounds, poisson_arrivals, run_load
from bench.stats import RequestRecord
from bench.traces import VocabRange


def test_poisson_arrivals_are_reproducible_and_near_the_rate():
    a = poisson_arrivals(5.0, 20_000, seed=11)
    assert a == poisson_arrivals(5.0, 20_000, seed=11)
    assert a != poisson_arrivals(5.0, 20_000, seed=12)
    assert a[0] == 0.0 and bool(np.all(np.diff(a) >= 0))
    assert (len(a) - 1) / a[-1] == pytest.approx(5.0, rel=0.03)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, seed=0)


@pytest.mark.parametrize(
    ("n", "dur", "timeout"),
    [
        (0, 10.0, 1.0),
        (None, 10.0, 1.0),
        (10**7, 10.0, 1.0),
        (5, float("inf"), 1.0),
        (5, 0.0, 1.0),
        (5, 1.0, 0),
    ],
)
def test_unbounded_runs_are_refused(n, dur, timeout):
    with pytest.raises(ValueError):
        check_bounds(n, dur, timeout)


def test_poisson_workload_is_scaled_bounded_and_in_vocab():
    items = build_workload(
        "poisson",
        num_requests=40,
        max_duration_s=1e6,
        length_factor=4,
        time_factor=2,
        rate=10.0,
        seed=3,
        vocab=VocabRange(0, 10, frozenset({0})),
        input_len=30,
        output_len=9,
    )
    raw = poisson_arrivals(10.0, 40, seed=3)
    assert len(items) == 40
    assert [i.arrival_s for i in items] == pytest.approx([2 * t for t in raw])
    assert {len(i.prompt_ids) for i in items} == {8} and {i.max_tokens for i in items} == {3}
    assert all(0 < t < 10 for i in items for t in i.prompt_ids)
    short = build_workload(
        "poisson", num_requests=40, max_duration_s=raw[9] * 2, time_factor=2, rate=10.0, seed=3
    )
    assert len(short) == 9


def test_trace_workload_uses_its_own_arrivals(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}\n'
        '{"timestamp": 500, "input_length": 500, "output_length": 8, "hash_ids": [1]}\n'
    )
    items = build_workload("mooncake", num_requests=5, max_duration_s=60, length_factor=8, trace_path=path)
    assert [(i.arrival_s, len(i.prompt_ids), i.max_tokens) for i in items] == [(0.0, 75, 1), (0.5, 63, 1)]
    assert items[0].prompt_ids[:63] == items[1].prompt_ids  # shared first block, cut to length
    with pytest.raises(ValueError, match="time_factor"):
        build_workload("mooncake", num_requests=5, max_duration_s=60, rate=3.0, trace_path=path)
    with pytest.raises(ValueError, match="rate"):
        build_workload("poisson", num_requests=5, max_duration_s=60)


class EchoClient:
    """Answers every request at once with one message per prompt token."""

    def __init__(self):
        self.seen: list[WorkItem] = []

    async def generate(self, rec: RequestRecord, item: WorkItem, clock, timeout_s: float) -> None:
        self.seen.append(item)
        rec.send_s = clock()
        rec.add_message(clock(), len(item.prompt_ids))
        rec.ok, rec.end_s = True, clock()

    async def close(self) -> None:
        return None


async def test_run_load_sends_in_arrival_order_within_both_bounds():
    items = [
        WorkItem(0.0, (1, 2), 4),
        WorkItem(0.001, (3,), 4),
        WorkItem(0.002, (4, 5, 6), 4),
        WorkItem(99.0, (7,), 4),  # after max_duration_s: never sent (and never waited for)
    ]
    client = EchoClient()
    records = await run_load(items[::-1], client, max_requests=10, max_duration_s=5.0, timeout_s=1.0)
    assert [len(i.prompt_ids) for i in client.seen] == [2, 1, 3]
    assert [r.output_tokens for r in records] == [2, 1, 3] and all(r.ok for r in records)
    assert len({r.request_id for r in records}) == 3
    assert [r.scheduled_s for r in records] == [0.0, 0.001, 0.002]
    assert all(r.send_s >= r.scheduled_s for r in records)
    capped = await run_load(items, EchoClient(), max_requests=2, max_duration_s=5.0, timeout_s=1.0)
    assert len(capped) == 2


async def test_run_load_refuses_an_unbounded_run():
    with pytest.raises(ValueError, match="max_duration_s"):
        await run_load([WorkItem(0.0, (1,), 1)], EchoClient(), max_requests=1, max_duration_s=float("inf"))


def test_make_client_rejects_unknown_targets():
    with pytest.raises(ValueError, match="target"):
        loadgen.make_client("https://example.invalid")
    with pytest.raises(ValueError, match="grpc_service"):
        loadgen.make_client("grpc://127.0.0.1:1", grpc_service="prefill")


def test_sse_parser_handles_splits_crlf_comments_and_multiline_data():
    p = SseParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b": 1}\r\n\r\n: ping\n\ndata: x\ndata:y\nevent: e\n\nda") == ['{"a": 1}', "x\ny"]
    assert p.feed(b"ta: [DONE]\n\n") == ["[DONE]"]
