"""The synchronous core end to end on the tiny built-in model."""

from __future__ import annotations

import dataclasses

import pytest

from kvtransfer.layout import LayoutMismatch
from services.engine.api import (
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    KvEventKind,
    SamplingParams,
)
from services.model.tokenizer import IncrementalDetokenizer
from tests.unit.engine.conftest import assert_pool_restored, prompt_of, request

SEEDED = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}


def mixed_requests(n: int = 16) -> list[EngineRequest]:
    """Prompt lengths 1..~300 (long ones need chunked prefill), greedy and seeded, mixed max_tokens."""
    reqs = []
    for i in range(n):
        length = [1, 5, 17, 31, 64, 90, 150, 300][i % 8] + i
        sampling = SEEDED | {"seed": 1000 + i} if i % 2 else {}
        reqs.append(request(f"r{i}", prompt_of(length, seed=i), max_tokens=8 + 3 * i, **sampling))
    return reqs


def run_alone(make_engine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    engine = make_engine(enable_prefix_caching=False)
    out = {}
    for r in reqs:
        out |= engine.generate([r])
    return out


def test_batched_equals_each_request_alone(make_engine):
    reqs = mixed_requests()
    engine = make_engine(max_num_batched_tokens=128)
    batched = engine.generate(reqs)
    assert batched == run_alone(make_engine, reqs)
    assert all(len(batched[r.request_id]) == r.sampling.max_tokens for r in reqs)
    stats = engine.stats()
    assert stats.prompt_tokens_computed == sum(len(r.prompt_token_ids) for r in reqs)
    assert stats.decode_tokens_computed == sum(r.sampling.max_tokens - 1 for r in reqs)


def test_decodes_of_very_different_lengths_run_in_groups_and_match_alone(make_engine, monkeypatch):
    """One long context among short ones: the decode batch splits by length (so the short rows
    are not padded to the long one) and every request still gets exactly its tokens alone."""
    from services.engine import model_runner

    seen: list[list[list[int]]] = []
    real = model_runner.group_by_length
    monkeypatch.setattr(model_runner, "group_by_length", lambda w: seen.append(real(w)) or seen[-1])
    reqs = [request("long", prompt_of(1100, seed=1), max_tokens=6)]
    reqs += [
        request(f"s{i}", prompt_of(20 + i, seed=10 + i), max_tokens=6, **SEEDED, seed=i) for i in range(4)
    ]
    engine = make_engine(num_blocks=160, max_num_batched_tokens=2048)
    batched = engine.generate(reqs)
    assert any(len(groups) > 1 for groups in seen)
    assert batched == run_alone(
        lambda **kw: make_engine(num_blocks=160, max_num_batched_tokens=2048, **kw), reqs
    )


def test_group_by_length_bounds_padding():
    from services.engine.model_runner import group_by_length

    assert group_by_length([]) == [[]]
    assert group_by_length([3, 1, 2]) == [[0, 1, 2]]  # small: one group, rows in order
    groups = group_by_length([2, 140, 3, 130, 2, 70])
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups == [[1, 3, 5], [2, 0, 4]]  # longest first; the short rows apart from the long
    widths = [2, 140, 3, 130, 2, 70]
    for g in groups:  # each group's padding is within the bounds
        padded, real = max(widths[i] for i in g) * len(g), sum(widths[i] for i in g)
        assert padded <= 1.5 * real or padded - real <= 32


def test_outputs_stream_one_token_per_step_and_report_usage(make_engine):
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request(request("a", prompt_of(70, seed=1), max_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    # 70 prompt tokens in chunks of 32: the first token comes with the third step.
    assert [o.token_ids.__len__() for o in outs] == [1, 1, 1, 1]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert all(not o.finished for o in outs[:-1])
    assert outs[0].num_prompt_tokens == 70 and outs[0].num_computed_prompt_tokens == 70


def test_prefix_cache_reuses_blocks_and_keeps_output(make_engine):
    shared = prompt_of(144, seed=7)  # 9 full blocks = 90% of the 160-token prompts
    first = request("first", shared + prompt_of(16, seed=8), max_tokens=12)
    second = request("second", shared + prompt_of(16, seed=9), max_tokens=12, **SEEDED, seed=5)
    engine = make_engine()
    engine.generate([first])
    assert engine.prefix_lookup(second.prompt_token_ids) == 144
    engine.add_request(second)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 144
    assert outs[0].num_computed_prompt_tokens == 16
    assert engine.stats().prompt_tokens_cached == 144
    assert [t for o in outs for t in o.token_ids] == run_alone(make_engine, [second])["second"]


def test_identical_prompt_keeps_its_last_token_to_compute(make_engine):
    engine = make_engine()
    prompt = prompt_of(64, seed=3)  # exactly 4 blocks
    a = engine.generate([request("a", prompt, max_tokens=6)])["a"]
    engine.add_request(request("b", prompt, max_tokens=6))
    out = engine.step()[0]
    # The last block is recomputed: its last token's logits give the first sample.
    assert out.num_cached_tokens == 48 and out.num_computed_prompt_tokens == 16
    while engine.has_unfinished_requests():
        out.token_ids.extend(t for o in engine.step() for t in o.token_ids)
    assert out.token_ids == a


def test_eviction_under_pressure_keeps_outputs(make_engine):
    engine = make_engine(num_blocks=24)  # 384 tokens: room for about two requests' blocks
    reqs = [request(f"e{i}", prompt_of(100, seed=20 + i), max_tokens=20) for i in range(6)]
    first_pass = {}
    for r in reqs:
        first_pass |= engine.generate([r])
    removed = [e for e in engine.kv_events_since(0) if e.kind is KvEventKind.REMOVED]
    assert removed, "a pool this small must have evicted cached blocks"
    again = engine.generate([EngineRequest(r.request_id + "'", r.prompt_token_ids, r.sampling) for r in reqs])
    assert [again[r.request_id + "'"] for r in reqs] == [first_pass[r.request_id] for r in reqs]
    assert first_pass == run_alone(make_engine, reqs)


def test_preemption_recomputes_and_keeps_outputs(make_engine):
    engine = make_engine(num_blocks=14, max_num_batched_tokens=64)
    reqs = [request(f"p{i}", prompt_of(40, seed=40 + i), max_tokens=50, **SEEDED, seed=i) for i in range(4)]
    out = engine.generate(reqs)
    assert engine.stats().preemptions > 0
    assert out == run_alone(make_engine, reqs)


def test_kv_events_are_numbered_and_snapshot_matches(make_engine):
    engine = make_engine(num_blocks=16)
    for i in range(4):
        engine.generate([request(f"k{i}", prompt_of(70, seed=60 + i), max_tokens=4)])
    events = engine.kv_events_since(0)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind is KvEventKind.STORED and events[0].parent_hash is None
    cached: dict[int, int | None] = {}
    for e in events:
        if e.kind is KvEventKind.STORED:
            parent = e.parent_hash
            for h in e.block_hashes:
                cached[h] = parent
                parent = h
        elif e.kind is KvEventKind.REMOVED:
            for h in e.block_hashes:
                del cached[h]
    seq, pairs = engine.kv_snapshot()
    assert seq == events[-1].seq
    assert dict((h, p) for p, h in pairs) == cached
    assert engine.kv_events_since(seq) == []
    engine.reset_prefix_cache()
    assert engine.kv_events_since(seq)[0].kind is KvEventKind.CLEARED
    assert engine.kv_snapshot() == (seq + 1, [])


def test_max_tokens_and_stop_token_ids(make_engine):
    engine = make_engine()
    prompt = prompt_of(20, seed=11)
    full = engine.generate([request("full", prompt, max_tokens=24)])["full"]
    stop = full[6]
    engine.add_request(request("stop", prompt, max_tokens=24, stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == full[: full.index(stop) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_stop_string_ends_at_the_token_that_completes_it(make_engine):
    engine = make_engine()
    prompt = prompt_of(12, seed=5, vocab=128)  # ASCII prompt: the model echoes printable bytes
    full = engine.generate([request("full", prompt, max_tokens=40)])["full"]
    detok = IncrementalDetokenizer(engine.tokenizer)
    texts = [detok.push(t) for t in full]
    text = "".join(texts)
    stop = next(text[i : i + 2] for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2])
    # The first token after which the decoded text contains the stop string:
    cut = next(i for i in range(len(full)) if stop in "".join(texts[: i + 1]))
    out = engine.generate([request("s", prompt, max_tokens=40, stop=(stop,))])["s"]
    assert out == full[: cut + 1]


@pytest.mark.parametrize("sampling", [{}, SEEDED | {"seed": 77}])
def test_resume_continues_exactly(make_engine, sampling):
    engine = make_engine()
    prompt = prompt_of(30, seed=13)
    full = engine.generate([request("u", prompt, max_tokens=30, **sampling)])["u"]
    resumed = engine.generate(
        [EngineRequest("m", prompt, SamplingParams(max_tokens=30, ignore_eos=True, **sampling), full[:11])]
    )["m"]
    assert resumed == full[11:]


def test_unseeded_sampling_gets_a_seed_and_varies(make_engine):
    engine = make_engine()
    prompt = prompt_of(10, seed=1)
    outs = engine.generate([request(f"x{i}", prompt, max_tokens=16, temperature=1.0) for i in range(4)])
    assert len({tuple(v) for v in outs.values()}) > 1


def test_abort_mid_stream_frees_every_block(make_engine):
    engine = make_engine()
    free = engine.stats().free_blocks
    engine.add_request(request("a", prompt_of(50, seed=2), max_tokens=100))
    engine.add_request(request("b", prompt_of(90, seed=3), max_tokens=100))
    for _ in range(5):
        engine.step()
    assert engine.stats().free_blocks < free
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a")
    assert engine.stats().free_blocks == free
    assert_pool_restored(engine)


@pytest.mark.parametrize(
    ("field", "req"),
    [
        ("prompt_token_ids", EngineRequest("long", [1] * 128 * 16)),
        ("prompt_token_ids", EngineRequest("empty", [])),
        ("prompt_token_ids", EngineRequest("vocab", [1, 258])),
        ("request_id", EngineRequest("", [1])),
        ("sampling.temperature", EngineRequest("t", [1], SamplingParams(temperature=3.0))),
        ("sampling.top_p", EngineRequest("p", [1], SamplingParams(top_p=0.0))),
        ("sampling.top_k", EngineRequest("k", [1], SamplingParams(top_k=1000))),
        ("sampling.max_tokens", EngineRequest("m", [1], SamplingParams(max_tokens=0))),
        ("sampling.seed", EngineRequest("s", [1], SamplingParams(seed=-1))),
        ("sampling.stop_token_ids", EngineRequest("i", [1], SamplingParams(stop_token_ids=(999,)))),
        ("sampling.stop", EngineRequest("e", [1], SamplingParams(stop=("",)))),
        ("resume_token_ids", EngineRequest("r", [1], SamplingParams(max_tokens=2), [5, 6])),
    ],
)
def test_bad_requests_are_typed_errors_and_allocate_nothing(make_engine, field, req):
    engine = make_engine()
    for call in (engine.add_request, engine.reserve_external):
        with pytest.raises(InvalidRequestError) as err:
            call(req)
        assert err.value.field == field
    assert_pool_restored(engine)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(make_engine):
    engine = make_engine()
    engine.add_request(request("dup", [1, 2, 3], max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(request("dup", [4], max_tokens=2))
    engine.generate([])
    assert_pool_restored(engine)


def test_generation_stops_at_the_context_limit(make_engine):
    engine = make_engine(num_blocks=4)  # 64 tokens of context
    out = engine.generate([request("c", prompt_of(60, seed=1), max_tokens=50)])["c"]
    assert len(out) == 4


def test_import_refuses_a_layout_mismatch(make_engine):
    engine = make_engine()
    res = engine.reserve_external(request("x", prompt_of(40, seed=4), max_tokens=4))
    layout = engine.info.layout
    blocks = engine.export_blocks(res.transfer_block_ids)
    for bad in (
        type(layout)(
            layout.num_layers + 1, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_size
        ),
        type(layout)(layout.num_layers, layout.num_kv_heads, layout.head_dim, "bfloat16", layout.block_size),
        type(layout)(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, 32),
    ):
        with pytest.raises(LayoutMismatch):
            engine.import_blocks(res.transfer_block_ids, blocks, bad)
    with pytest.raises(LayoutMismatch):
        engine.import_blocks(res.transfer_block_ids, blocks[:1], layout)
    with pytest.raises(InvalidRequestError, match="not reserved"):
        engine.import_blocks([engine.info.num_blocks - 1], blocks[:1], layout)
    assert engine.cancel_external("x") and not engine.cancel_external("x")
    assert_pool_restored(engine)


def test_tokens_waiting_counts_the_rest_of_a_prompt_being_prefilled_in_chunks(make_engine):
    from tests.unit.engine.conftest import prompt_of, request

    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request(request("long", prompt_of(200, 1), max_tokens=2))
    assert engine.stats().tokens_waiting == 200
    engine.step()  # 32 of 200 prompt tokens computed; the request is running
    s = engine.stats()
    assert (s.running, s.waiting, s.tokens_waiting) == (1, 0, 168)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().tokens_waiting == 0


def test_a_watched_request_reports_its_start_once_before_its_first_pass(make_engine):
    """EngineRequest.on_started (the router's tied hedge): called once, when the scheduler
    first takes the request and before that pass runs; a queued request that is aborted
    never reports."""
    engine = make_engine(max_num_seqs=1)
    log: list[str] = []
    real_run = engine.runner.run
    engine.runner.run = lambda scheduled: log.append("pass") or real_run(scheduled)

    def watched(rid: str, length: int, seed: int) -> EngineRequest:
        r = request(rid, prompt_of(length, seed=seed), max_tokens=3)
        return dataclasses.replace(r, on_started=lambda: log.append(f"started {rid}"))

    engine.add_request(watched("a", 20, 1))
    engine.add_request(watched("b", 20, 2))  # waits: one sequence at a time
    engine.add_request(watched("c", 20, 3))
    engine.step()
    assert log == ["started a", "pass"]  # before the pass, and only the one scheduled
    while engine.has_unfinished_requests() and "started b" not in log:
        engine.step()
    assert engine.abort("c")  # still queued behind b: never started, never reported
    while engine.has_unfinished_requests():
        engine.step()
    assert [e for e in log if e.startswith("started")] == ["started a", "started b"]
    assert log.index("started b") < len(log) - 1 and log[log.index("started b") + 1] == "pass"


def _old_then_new(engine) -> tuple[list, list[str], dict[str, list[int]]]:
    """With one slot: "old" queued at t = 0 and "new" at t = 2 (the scheduler's clock), run to
    the end; the requests, the order of their first tokens and every request's tokens."""
    t = [0.0]
    engine.scheduler._clock = lambda: t[0]
    reqs = [request(rid, prompt_of(20, seed=i), max_tokens=4) for i, rid in enumerate(("old", "new"))]
    engine.add_request(reqs[0])
    t[0] = 2.0
    engine.add_request(reqs[1])
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.token_ids and o.request_id not in order:
                order.append(o.request_id)
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    return reqs, order, tokens


def test_queue_late_after_s_admits_an_on_time_request_first_with_the_same_tokens(make_engine):
    """The engine's on-time-first admission (Scheduler.late_after_s) through LLMEngine: with one
    slot, a request that has waited past the setting yields it to a newer one; both produce
    exactly the tokens they produce alone, the Stats count the overtaking, the pool comes back."""
    engine = make_engine(max_num_seqs=1, queue_late_after_s=1.0)
    reqs, order, tokens = _old_then_new(engine)
    assert order == ["new", "old"]
    assert engine.stats().admitted_ahead == 1
    assert_pool_restored(engine)
    assert tokens == run_alone(make_engine, reqs)


def test_queue_late_max_s_gives_an_overdue_request_its_place_back(make_engine):
    """EngineConfig.queue_late_max_s through LLMEngine: the same two requests, but the old one
    has waited past the bound, so it keeps its first-come slot; tokens as alone."""
    engine = make_engine(max_num_seqs=1, queue_late_after_s=1.0, queue_late_max_s=1.5)
    reqs, order, tokens = _old_then_new(engine)
    assert order == ["old", "new"]
    assert (engine.stats().admitted_ahead, engine.stats().admitted_overdue) == (0, 1)
    assert_pool_restored(engine)
    assert tokens == run_alone(make_engine, reqs)
