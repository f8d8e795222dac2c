"""The workflow -> worker hint (services/router/workflow_affinity.py), on a fake clock."""

from __future__ import annotations

import pytest

from services.model.hashing import BlockHashChain
from services.router.policy import Choice
from services.router.workflow_affinity import WorkflowAffinity, WorkflowRoutingConfig

BS = 4


def chain(tokens) -> BlockHashChain:
    return BlockHashChain(list(tokens), BS)


def test_the_home_worker_is_credited_the_previous_prompt_when_the_new_one_extends_it():
    aff = WorkflowAffinity()
    step0 = list(range(10))  # 2 full blocks
    aff.record("wf", "w1", chain(step0), now=0.0)
    step1 = [*step0, 90, 91, 92, 93, 94, 95]  # 4 blocks, extends step 0's prompt
    got = aff.credit("wf", chain(step1), {"w2": 1}, now=1.0)
    assert got == {"w2": 1, "w1": 2}
    assert aff.hits == 1 and aff.misses == 0


def test_no_credit_when_the_prompt_diverges_the_hint_expired_or_the_home_is_not_eligible():
    aff = WorkflowAffinity(WorkflowRoutingConfig(affinity_ttl_s=10.0))
    aff.record("wf", "w1", chain(range(8)), now=0.0)
    other = [0, 1, 2, 3, 99, 5, 6, 7, 8]  # block 1 differs
    assert aff.credit("wf", chain(other), {}, now=1.0) == {}
    assert aff.credit("wf", chain(range(12)), {}, now=1.0, eligible={"w2"}) == {}
    assert aff.credit("wf", chain(range(12)), {}, now=10.0) == {}  # expired
    assert aff.misses == 3 and aff.hits == 0 and len(aff) == 0


def test_the_index_overlap_wins_when_it_is_larger_and_unknown_workflows_are_passed_through():
    aff = WorkflowAffinity()
    aff.record("wf", "w1", chain(range(8)), now=0.0)
    overlaps = {"w1": 3}
    assert aff.credit("wf", chain(range(16)), overlaps, now=0.0) is overlaps
    assert aff.credit("other", chain(range(16)), overlaps, now=0.0) is overlaps
    assert aff.credit("", chain(range(16)), overlaps, now=0.0) is overlaps
    assert (aff.hits, aff.misses) == (1, 0)


def test_forget_and_forget_worker_and_the_bound():
    aff = WorkflowAffinity(WorkflowRoutingConfig(max_workflows=2))
    for i in range(3):
        aff.record(f"wf{i}", "w1" if i else "w2", chain(range(8)), now=float(i))
    assert len(aff) == 2 and aff.home("wf0", 3.0) is None  # least recently seen dropped
    assert aff.forget_worker("w1") == 2 and len(aff) == 0
    aff.record("a", "w1", chain(range(8)), now=0.0)
    aff.forget("a")
    assert aff.home("a", 0.0) is None
    aff.record("", "w1", chain(range(8)), now=0.0)
    aff.record("b", "w1", chain(range(3)), now=0.0)  # under a block: nothing to credit
    assert len(aff) == 0


def test_config_is_validated():
    with pytest.raises(ValueError):
        WorkflowRoutingConfig(affinity_ttl_s=0)


def ranking(*ids):
    return [Choice(w, float(i), 0) for i, w in enumerate(ids)]


def test_steer_keeps_the_step_home_unless_the_home_is_backed_up():
    aff = WorkflowAffinity(WorkflowRoutingConfig(home_extra_waiting=1))
    aff.record("wf", "w1", chain(range(8)), now=0.0)
    nxt = chain(range(12))
    ranked = ranking("w2", "w3", "w1")  # the policy preferred a lighter worker
    # home has one more waiting than the least: within the margin, it goes first
    got = aff.steer("wf", nxt, ranked, {"w1": 2, "w2": 1, "w3": 4}, now=1.0)
    assert [c.worker_id for c in got] == ["w1", "w2", "w3"] and aff.steered == 1
    # two more: backed up, the policy's ranking stands
    assert aff.steer("wf", nxt, ranked, {"w1": 3, "w2": 1, "w3": 4}, now=1.0) is ranked
    assert aff.steered == 1


def test_steer_leaves_the_ranking_without_a_live_matching_ranked_home():
    aff = WorkflowAffinity(WorkflowRoutingConfig(affinity_ttl_s=10.0))
    aff.record("wf", "w1", chain(range(8)), now=0.0)
    ranked = ranking("w2", "w1")
    idle = {"w1": 0, "w2": 0}
    assert aff.steer("other", chain(range(12)), ranked, idle, now=1.0) is ranked  # unknown workflow
    diverged = [0, 1, 2, 3, 99, 5, 6, 7, 8]
    assert aff.steer("wf", chain(diverged), ranked, idle, now=1.0) is ranked
    assert aff.steer("wf", chain(range(12)), ranking("w2", "w3"), idle, now=1.0) == ranking("w2", "w3")
    assert aff.steer("wf", chain(range(12)), ranked, idle, now=10.0) is ranked  # hint expired
    off = WorkflowAffinity(WorkflowRoutingConfig(home_extra_waiting=-1))
    off.record("wf", "w1", chain(range(8)), now=0.0)
    assert off.steer("wf", chain(range(12)), ranked, idle, now=1.0) is ranked
    assert aff.steered == 0 and off.steered == 0
