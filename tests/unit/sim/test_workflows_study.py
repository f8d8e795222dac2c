"""bench/workflows.py on a tiny overloaded fleet: every workflow is accounted
for, the KV pools go back to full, and the workflow-aware policy wastes less."""

from __future__ import annotations

import argparse
import math

from bench.workflows import Sim, make_workload, mean_context, policies
from services.router.admission import AdmissionConfig


def test_tiny_study_accounts_for_every_workflow_and_frees_every_block():
    args = argparse.Namespace(workers=2, slots=2, blocks=2048, pin_ttl_s=5.0)
    workload = make_workload(rate=1.5, duration_s=60.0, seed=3)
    args.batch_context = args.slots * mean_context(workload)
    base = AdmissionConfig(max_inflight=8, queue_limit_per_priority=4, queue_timeout_s=20.0)
    results = {}
    for pol in policies(base, args.workers * args.slots):
        sim = Sim(pol, workload, args)
        sim.run()
        results[pol.name] = sim.results()
        stats = sim.ledger.stats()
        assert stats.completed + stats.failed == len(workload) and stats.open == 0
        assert sum(sim.failures.values()) == stats.failed  # every failure has its cause
        assert all(w.done for w in sim.workload)
        for bm in sim.fleet.bms:
            bm.expire_pins(now=math.inf)
            assert bm.num_free_blocks == bm.num_blocks and bm.pin_stats().pinned_blocks == 0
        assert sim.ctl.inflight == 0 and sim.ctl.queued == 0
    assert results["pdmesh"]["waste"] < results["fifo"]["waste"]
