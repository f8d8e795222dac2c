"""bench/fleet_sim.py, the planner study's event model: decode-local prefill (conditional
disaggregation) and the worker accounting the study's breakdown reads."""

from __future__ import annotations

from bench.fleet_sim import FleetSim, SimRequest
from services.model.timing import load_profile

H100 = load_profile("splitwise-h100-llama70b")


def _run(reqs, pools, local, *, ttft=1.0, itl=0.05):
    sim = FleetSim(
        H100, initial=pools, startup_s=20, interval_s=10, local_prefill=local, ttft_slo_s=ttft, itl_slo_s=itl
    )
    return sim.run(reqs, lambda obs, now: pools)


def test_off_by_default_every_prompt_goes_to_a_prefill_worker():
    reqs = [SimRequest(0.1 * i, 500, 20) for i in range(50)]
    r = FleetSim(H100, initial=(1, 1), startup_s=20, interval_s=10).run(reqs, lambda obs, now: (1, 1))
    assert r.local_prefills == 0 and len(r.outcomes) == 50


def test_an_idle_decode_worker_prefills_a_prompt_itself_and_saves_the_transfer():
    """Nothing runs on the decode worker, so the stall costs no decode: local is the cheaper tie (no KV
    transfer); the first token then comes at exactly the prompt's prefill time."""
    r = _run([SimRequest(0.0, 2000, 10)], (1, 1), True)
    (o,) = r.outcomes
    assert r.local_prefills == 1
    assert abs(o.ttft_s - H100.prefill_ms(2000) / 1000) < 1e-9
    remote = _run([SimRequest(0.0, 2000, 10)], (1, 1), False).outcomes[0]
    assert remote.ttft_s > o.ttft_s  # the remote path adds the transfer


def test_a_prompt_goes_remote_when_the_stall_would_push_running_decodes_past_their_itl_slo():
    """20 decodes run at an ITL SLO 20% above their step: a 4,000-token prefill (0.49 s) eats a good share
    of each one's slack (priced (stall / slack)^2 each), and the idle prefill worker meets the TTFT SLO,
    so remote wins: a running decode's stall is a cost in the score, so with decodes running a prompt
    stays local only when the remote path would miss the TTFT SLO (as services/decode/disagg_policy.py)."""
    warm = [SimRequest(0.0, 100, 400) for _ in range(20)]
    late = SimRequest(2.0, 4000, 10)
    step_ms = H100.decode_ms(20, 20 * 300)
    remote_ttft = H100.prefill_ms(4000) / 1000 + H100.transfer_s(4000)
    tight = _run([*warm, late], (1, 1), True, itl=step_ms / 1000 * 1.2)
    out = next(o for o in tight.outcomes if o.req is late)
    assert abs(out.ttft_s - remote_ttft) < 1e-9


def test_decodes_already_past_their_slack_still_price_a_stall():
    """The ITL SLO below the step: every running decode reads as past its slack. Priced at nothing (as
    until session 21), the stall looked free, the tie went to the local path's saved transfer, and a
    worker of late decodes took every prompt (static 7 P + 5 D collapsed from 0.813 to 0.720 of requests
    within the SLOs). Against each decode's whole budget it is a cost, and the idle prefill worker, which
    meets the TTFT SLO, takes the prompt."""
    warm = [SimRequest(0.0, 100, 400) for _ in range(20)]
    late = SimRequest(2.0, 4000, 10)
    step_ms = H100.decode_ms(20, 20 * 300)
    remote_ttft = H100.prefill_ms(4000) / 1000 + H100.transfer_s(4000)
    itl = step_ms / 1000 * 0.8
    r = _run([*warm, late], (1, 1), True, itl=itl)
    out = next(o for o in r.outcomes if o.req is late)
    assert abs(out.ttft_s - remote_ttft) < 1e-9
    assert r.local_prefills == _run(warm, (1, 1), True, itl=itl).local_prefills  # not the late prompt


def test_a_saturated_prefill_pool_overflows_to_decode_workers_with_slack_and_more_meet_the_ttft_slo():
    """One prefill worker at ~1.6x its capacity: its queue would pass the TTFT SLO; decode workers with
    plenty of ITL slack take the overflow, and the share within the TTFT SLO rises."""
    reqs = [SimRequest(0.08 * i, 1000, 50) for i in range(600)]  # 12.5 prompts/s x 1000 tokens
    off, on = _run(reqs, (1, 2), False), _run(reqs, (1, 2), True)
    share = lambda r: sum(o.ttft_s <= 1.0 for o in r.outcomes) / len(r.outcomes)  # noqa: E731
    assert on.local_prefills > 0
    assert share(on) > share(off) + 0.2
    assert len(on.outcomes) == len(reqs)  # nothing lost on either path


def test_a_local_prefill_stalls_the_decodes_running_there():
    """A long prompt arrives while the prefill worker is busy with another (remote TTFT past the SLO):
    the decode worker prefills it itself, and the decode running there finishes later by about that
    prefill's time."""
    running = SimRequest(0.0, 100, 200)
    blocker = SimRequest(0.99, 7000, 2)  # remote: the prefill worker is idle and meets the SLO
    long_prompt = SimRequest(1.0, 6000, 2)  # remote would wait ~0.95 s for the blocker: local
    alone = _run([running, blocker], (1, 1), True, itl=1.0)
    both = _run([running, blocker, long_prompt], (1, 1), True, itl=1.0)
    assert (alone.local_prefills, both.local_prefills) == (1, 2)  # `running` (an idle decode worker's tie)
    out = {o.req: o for o in both.outcomes}
    assert out[long_prompt].ttft_s <= H100.prefill_ms(6000) / 1000 + 1e-9
    delay = out[running].finish_s - next(o for o in alone.outcomes if o.req is running).finish_s
    assert delay > 0.9 * H100.prefill_ms(6000) / 1000


def test_workers_record_when_they_were_told_to_drain():
    reqs = [SimRequest(0.5 * i, 500, 20) for i in range(100)]
    sim = FleetSim(H100, initial=(2, 2), startup_s=5, interval_s=10)
    r = sim.run(reqs, lambda obs, now: (1, 1) if now >= 20 else (2, 2))
    drained = [w for w in r.workers if w.drain_s is not None]
    assert len(drained) == 2 and all(w.drain_s <= w.stopped_s for w in drained)


def test_a_draining_decode_worker_migrates_its_sequences_and_stops_at_once():
    """migrate_on_drain: the decodes of a worker told to stop move to the others (their tokens left and
    context kept) and it stops when they are gone, not when its longest output ends; every request
    still finishes with all its tokens."""
    reqs = [SimRequest(0.05 * i, 200, 2000) for i in range(40)]  # long outputs: ~60 s of decode each

    def policy(obs, now):
        return (1, 1) if now >= 10 else (1, 2)

    runs = {}
    for migrate in (False, True):
        sim = FleetSim(H100, initial=(1, 2), startup_s=5, interval_s=10, migrate_on_drain=migrate)
        runs[migrate] = sim.run(reqs, policy)
    for r in runs.values():
        assert len(r.outcomes) == 40 and r.failed_scaling == 0
    drained = {m: next(w for w in r.workers if w.drain_s is not None) for m, r in runs.items()}
    assert drained[True].stopped_s - drained[True].drain_s < 0.1
    assert drained[False].stopped_s - drained[False].drain_s > 30
    assert runs[True].worker_s < runs[False].worker_s - 30
    # the moved sequences lost no tokens: each finished no earlier than its tokens at the fastest step
    fastest = H100.decode_ms(1, 0) / 1000
    assert all(o.finish_s - o.first_token_s >= 1999 * fastest for o in runs[True].outcomes)
