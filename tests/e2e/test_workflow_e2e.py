"""A 20-step agent workflow through the router keeps hitting its worker's cache (issue 21,
"Done when"): real processes on loopback, ports chosen by the OS.

Two decode workers (sim backend, workflow pins on) behind a kv_aware router. Each
step's prompt is the conversation so far (every earlier prompt and output) plus a
new tool result, sent with its WorkflowContext; between steps a plain request of
other tokens goes through the router too. Then:

- every step runs on the worker of step 0, and each step after the first finds
  the previous step's whole prompt cached there (its full blocks);
- the router counts the workflow as completed, with 19 affinity credits;
- after the final step no blocks stay pinned and both pools are back to full.
"""

from __future__ import annotations

import grpc
import pytest

from pdmesh.launcher import Launcher, flags
from pdmesh.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.helpers import metric_value, scrape, start_decodes_and_router, wait_until
from tests.unit.engine.conftest import prompt_of

pytestmark = pytest.mark.e2e

BS = 16
BLOCKS = 512
STEPS = 20
DECODE = flags(
    engine_backend="sim",
    engine_sim_speedup=50.0,
    engine_num_blocks=BLOCKS,
    engine_workflow_pin_ttl_s=300.0,
)
ROUTER = flags(policy="kv_aware", stats_interval_s=0.2, resubscribe_max_s=0.5, metrics_port=0)


def run(stub, prompt, workflow=None, rid="", max_tokens=8):
    req = router_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    if workflow is not None:
        req.workflow.CopyFrom(workflow)
    out, final = [], None
    for msg in stub.Generate(req, timeout=120):
        if msg.HasField("delta"):
            out += msg.delta.token_ids
        else:
            final = msg.final
    assert final is not None
    return out, final


def test_a_20_step_workflow_keeps_hitting_its_workers_cache(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        decodes, router = start_decodes_and_router(launcher, 2, DECODE, ROUTER)
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.address))
        stats = {
            f"decode-{i}": decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(d.address)).Stats
            for i, d in enumerate(decodes)
        }

        def worker_stats(w):
            return stats[w](worker_pb2.StatsRequest(), timeout=10)

        full = {w: worker_stats(w).load.free_blocks for w in stats}
        convo = prompt_of(120, seed=11)
        spent, home, previous = 0, None, 0
        for k in range(STEPS):
            ctx = common_pb2.WorkflowContext(
                workflow_id="agent-1", step_index=k, tokens_spent=spent, final_step=k == STEPS - 1
            )
            out, final = run(stub, convo, ctx, rid=f"step-{k}")
            if k == 0:
                home = final.worker_id
            else:
                assert final.worker_id == home, f"step {k} ran on {final.worker_id}, not {home}"
                assert final.usage.cached_prompt_tokens >= previous // BS * BS, f"step {k} missed its cache"
            previous = len(convo)
            spent += len(convo) + len(out)
            run(stub, prompt_of(64, seed=1000 + k), rid=f"plain-{k}", max_tokens=4)  # other traffic
            convo = [*convo, *out, *prompt_of(24, seed=100 + k)]  # the tool's answer
        # The router publishes its workflow gauges from housekeeping (every 0.5 s).
        wait_until(
            lambda: (
                metric_value(scrape(router), "pdmesh_router_workflows", tenant="", outcome="completed") == 1
            ),
            what="the router counts the workflow completed",
        )
        assert metric_value(scrape(router), "pdmesh_router_workflow_affinity", result="hit") == STEPS - 1
        for w in stats:
            wait_until(
                lambda w=w: (
                    worker_stats(w).counters.pinned_blocks == 0
                    and worker_stats(w).load.free_blocks == full[w]
                ),
                what=f"{w}: no pins and the pool back to full",
            )
    finally:
        launcher.close()
