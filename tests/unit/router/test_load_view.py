"""LoadView: the router's own per-worker account, and how it blends with load reports."""

from services.router.load_view import LoadView
from services.router.policy import Candidate, WorkerLoad


def cand(worker_id, tokens_waiting=0, decode_blocks=0):
    return Candidate(worker_id, WorkerLoad(tokens_waiting=tokens_waiting, active_decode_blocks=decode_blocks))


def loads(view, cands):
    return {c.worker_id: (c.load.tokens_waiting, c.load.active_decode_blocks) for c in view.blend(cands)}


def test_prefill_ends_at_the_first_token_and_decode_at_the_end():
    v = LoadView()
    k = v.begin("a", prefill_tokens=100, decode_blocks=10)
    assert v.own("a") == (100, 10)
    v.first_token(k)
    assert v.own("a") == (0, 10)
    v.first_token(k)  # every later token message says the same: no double subtraction
    assert v.own("a") == (0, 10)
    v.end(k)
    assert v.own("a") == (0, 0) and len(v) == 0


def test_end_without_a_first_token_releases_both_parts_once():
    v = LoadView()
    k1 = v.begin("a", 50, 5)
    k2 = v.begin("a", 30, 3)
    v.end(k1)  # failed or cancelled before its first token
    v.end(k1)
    assert v.own("a") == (30, 3)
    v.end(k2)
    assert v.own("a") == (0, 0) and len(v) == 0


def test_negative_amounts_count_as_zero():
    v = LoadView()
    v.begin("a", -5, -1)
    assert v.own("a") == (0, 0)


def test_without_reports_the_own_view_is_the_load():
    v = LoadView()
    v.begin("a", 64, 4)
    assert loads(v, [cand("a"), cand("b")]) == {"a": (64, 4), "b": (0, 0)}


def test_a_stale_report_does_not_hide_what_was_routed_since():
    v = LoadView()
    v.begin("a", 64, 4)
    v.begin("a", 64, 4)
    assert loads(v, [cand("a", 0, 0)]) == {"a": (128, 8)}


def test_own_traffic_in_a_report_is_not_counted_twice():
    v = LoadView()
    v.begin("a", 64, 4)
    assert loads(v, [cand("a", 64, 4)]) == {"a": (64, 4)}


def test_a_report_above_the_own_view_shows_other_routers_traffic():
    v = LoadView()
    v.begin("a", 64, 4)
    assert loads(v, [cand("a", 264, 24), cand("b", 50, 0)]) == {"a": (264, 24), "b": (50, 0)}


def test_each_component_takes_the_larger_of_the_two():
    # The worker undercounts a long prompt's running chunks but sees more decode blocks.
    v = LoadView()
    v.begin("a", 1000, 70)
    assert loads(v, [cand("a", 200, 90)]) == {"a": (1000, 90)}


def test_candidates_keep_everything_else():
    v = LoadView()
    v.begin("a", 10, 1)
    c = Candidate("a", WorkerLoad(running=3, free_blocks=7), healthy=True, inflight=2)
    (out,) = v.blend([c])
    assert (out.load.running, out.load.free_blocks, out.inflight) == (3, 7, 2)


def test_policies_given_the_totals_rank_as_on_blended_candidates():
    """`rank(..., own=view.totals())` (the request flow's path) equals ranking `blend`'s output."""
    import random

    from services.router.policy import PolicyConfig, make_policy

    rng = random.Random(5)
    view = LoadView()
    cands = []
    for i in range(12):
        w = f"w{i}"
        cands.append(
            Candidate(
                w, WorkerLoad(tokens_waiting=rng.randrange(5000), active_decode_blocks=rng.randrange(900))
            )
        )
        if i % 3:
            view.begin(w, rng.randrange(9000), rng.randrange(1500))
    overlaps = {f"w{i}": rng.randrange(60) for i in range(0, 12, 2)}
    for name in ("kv_aware", "least_loaded"):
        for dw in (1.0, 0.1):
            cfg = PolicyConfig(block_size=16, decode_weight=dw)
            a = make_policy(name, cfg, random.Random(1)).rank(view.blend(cands), 50, overlaps)
            b = make_policy(name, cfg, random.Random(1)).rank(cands, 50, overlaps, own=view.totals())
            assert a == b
            assert b != make_policy(name, cfg, random.Random(1)).rank(cands, 50, overlaps)  # own matters


# ---- reports that hold this router's traffic (LoadView.reported) ------------------------


def test_a_report_taken_before_our_requests_ended_does_not_keep_them():
    # The report (1 s stale) still shows our two requests; both have ended since: the
    # worker is idle, and max(own, reported) used to keep it busy until the next report.
    v = LoadView()
    k1 = v.begin("a", 64, 5, prompt_tokens=64, block_size=16)
    k2 = v.begin("a", 32, 3, prompt_tokens=96, block_size=16)
    v.reported("a")  # taken now: 160 prompt tokens and 4 + 6 prompt blocks of ours in it
    report = cand("a", 160, 10)
    assert loads(v, [report]) == {"a": (96, 8)}  # exactly ours
    v.first_token(k1)
    v.end(k1)
    v.end(k2)
    assert loads(v, [report]) == {"a": (0, 0)}


def test_other_routers_traffic_in_a_report_stays_after_ours_ends():
    v = LoadView()
    k = v.begin("a", 64, 4, prompt_tokens=64, block_size=16)
    v.reported("a")
    report = cand("a", 264, 24)  # 200 tokens and 20 blocks are another router's
    assert loads(v, [report]) == {"a": (264, 24)}
    v.end(k)
    assert loads(v, [report]) == {"a": (200, 20)}
    v.begin("a", 10, 2, prompt_tokens=10, block_size=16)  # routed after the report: added
    assert loads(v, [report]) == {"a": (210, 22)}


def test_the_next_report_replaces_what_was_ours_in_the_last():
    v = LoadView()
    k = v.begin("a", 64, 4, prompt_tokens=64, block_size=16)
    v.reported("a")
    v.end(k)
    v.reported("a")  # a fresh report without our request: nothing of ours to subtract
    assert loads(v, [cand("a", 50, 3)]) == {"a": (50, 3)}
    assert len(v.totals()) == 0  # and nothing left tracked for the worker


def test_a_report_with_nothing_of_ours_is_all_other_traffic():
    v = LoadView()
    v.reported("a")
    v.begin("a", 64, 4, prompt_tokens=64, block_size=16)  # after the report: not in it
    assert loads(v, [cand("a", 100, 10)]) == {"a": (100, 10)}  # max(own, reported) until the next


def test_the_policy_blends_inline_as_blend_does():
    from random import Random

    from services.router.policy import PolicyConfig, make_policy

    v = LoadView()
    k = v.begin("a", 640, 40, prompt_tokens=800, block_size=16)
    v.begin("b", 160, 20, prompt_tokens=160, block_size=16)
    v.reported("a")
    v.first_token(k)
    cands = [cand("a", 900, 120), cand("b", 0, 5), cand("c", 300, 0)]
    for name in ("kv_aware", "least_loaded"):
        cfg = PolicyConfig(decode_weight=0.1)
        inline = make_policy(name, cfg, Random(1)).rank(cands, 20, {"a": 10}, own=v.totals())
        copied = make_policy(name, cfg, Random(1)).rank(v.blend(cands), 20, {"a": 10})
        assert inline == copied
