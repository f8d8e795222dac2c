"""bench/disagg_sim.py, the event model of the GPU-regime disaggregation study: its passes
agree with the real sim engine's, its paths cost what the profile says, and its
conditional deployment runs the product's rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.disagg_gpu import agent_specs, mix_specs
from bench.disagg_sim import Req, Sim, Spec, goodput, make_requests, simulate, unloaded_ttft_s
from services.engine.api import EngineRequest, SamplingParams
from services.model.timing import load_profile
from tests.unit.engine.conftest import prompt_of
from tests.unit.sim.conftest import FakeClock, sim_core

MOCKER = "dynamo-mocker"


def one(spec: Spec, at: float = 0.0, i: int = 0) -> Req:
    return Req(i, at, spec, ttft_slo=1e9, tpot_slo=1e9)


def test_first_and_last_tokens_match_the_real_sim_engine():
    """The same prompts on the real Scheduler + BlockManager + SimRunner (a fake clock that
    moves by each modeled pass) and on the event model: the same token times."""
    lengths = [(300, 4), (700, 3), (90, 6), (400, 2)]
    budget, seqs = 256, 8
    clock = FakeClock([])
    core = sim_core(profile=MOCKER, clock=clock, max_num_batched_tokens=budget, max_num_seqs=seqs)
    for i, (p, o) in enumerate(lengths):
        core.add_request(
            EngineRequest(f"r{i}", prompt_of(p, i + 1), SamplingParams(max_tokens=o, ignore_eos=True))
        )
    first, last = {}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.token_ids:
                first.setdefault(out.request_id, clock.now)
                last[out.request_id] = clock.now
    prof = replace(core.runner.profile, max_num_batched_tokens=budget, max_num_seqs=seqs)
    sim = Sim(prof, 0, 1, "agg")
    reqs = sim.run([one(Spec(p, o), i=i) for i, (p, o) in enumerate(lengths)])
    for i, r in enumerate(reqs):
        assert r.first_at == pytest.approx(first[f"r{i}"], rel=0.02), i
        assert r.done_at == pytest.approx(last[f"r{i}"], rel=0.02), i


def test_a_remote_prefill_costs_its_prefill_plus_the_transfer_at_the_link_bandwidth():
    prof = load_profile("splitwise-h100-llama70b")
    for gbps in (450.0, 50.0):
        p = replace(prof, kv_bandwidth_gbps=gbps)
        (r,) = Sim(p, 1, 1, "disagg").run([one(Spec(4000, 10))])
        want = unloaded_ttft_s(p, 4000) + 4000 * p.kv_bytes_per_token / (gbps * 1e9)
        assert r.first_at == pytest.approx(want)
        assert r.path == "remote"
    (r,) = Sim(prof, 0, 1, "agg").run([one(Spec(4000, 10))])
    assert r.first_at == pytest.approx(unloaded_ttft_s(prof, 4000)) and r.path == "local"
    # Each later token is one decode step of a batch of one.
    assert (r.done_at - r.first_at) / 9 == pytest.approx(prof.decode_ms(1, 4005) / 1000, rel=0.01)


def test_a_cached_prefix_is_neither_prefilled_nor_moved():
    prof = load_profile("splitwise-h100-llama70b")
    units = tuple(range(8))  # 4,096 tokens in 512-token units
    sim = Sim(prof, 0, 1, "agg")
    a, b = sim.run([one(Spec(4200, 2, units)), one(Spec(4200, 2, units), at=10.0, i=1)])
    assert a.first_at == pytest.approx(unloaded_ttft_s(prof, 4200))
    assert b.first_at - b.arrival == pytest.approx(prof.prefill_ms(104, 4096) / 1000)


def test_the_conditional_deployment_runs_the_products_rule():
    """Idle prefill GPUs and a decode GPU already decoding: the rule sends long prompts away
    and keeps prefilling locally when that is sooner and stalls nobody."""
    prof = load_profile("splitwise-h100-llama70b")
    specs = mix_specs(200, 0)
    att, decisions = simulate(prof, 4, 4, "cond", specs, rate=4.0, seed=1)
    assert decisions["local"] > 0 and decisions["remote"] > 0
    assert sum(decisions.values()) == 200 and 0.0 <= att <= 1.0
    _, forced = simulate(prof, 4, 4, "disagg", specs, rate=4.0, seed=1)
    assert forced == {"local": 0, "remote": 200}


def test_goodput_is_the_highest_rate_that_keeps_attainment():
    prof = load_profile("splitwise-h100-llama70b")
    specs = agent_specs(120, 0)
    g, curve, _ = goodput(prof, 0, 8, "agg", specs, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], seed=1, refine=2)
    assert curve == sorted(curve)  # by rate
    good = [r for r, a in curve if a >= 0.9]
    assert good and g >= max(r for r in good if all(a >= 0.9 for x, a in curve if x <= r))
    reqs = make_requests(prof, specs, g, 1)
    assert len(reqs) == 120


def test_the_agent_workload_shares_its_context():
    specs = agent_specs(50, 0)
    assert all(s.units[:8] == tuple(range(8)) for s in specs)  # the shared system + tools context
    assert all(s.prompt >= len(s.units) * 512 for s in specs) and all(16 <= s.output <= 64 for s in specs)
