"""Workflow KV pins in a real decode worker process (sim backend), issue 21 item 2.

kvtransfer + prefill + decode on loopback (port 0). A workflow step that ends
pins its cached blocks for the next step: the next step hits them, the pin goes
on its TTL (the idle engine wakes for it) or under pressure, or at the
workflow's final step, and the pool goes back to full each time.
"""

from __future__ import annotations

import pytest

from pdmesh.launcher import flags
from pdmesh.v1 import common_pb2, decode_pb2
from tests.e2e.helpers import start_mesh, wait_until
from tests.unit.engine.conftest import prompt_of

pytestmark = pytest.mark.e2e

BLOCKS = 64  # 16-token blocks: 1024 tokens of KV
LOCAL = decode_pb2.DISAGG_MODE_LOCAL


def sim(ttl_s: float) -> tuple[str, ...]:
    return flags(
        engine_backend="sim",
        engine_sim_speedup=50.0,
        engine_num_blocks=BLOCKS,
        engine_workflow_pin_ttl_s=ttl_s,
    )


def step(stub, prompt, rid, wf="", final=False, max_tokens=8):
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        disagg_mode=LOCAL,
    )
    if wf:
        req.workflow.CopyFrom(common_pb2.WorkflowContext(workflow_id=wf, final_step=final))
    tokens, final_msg = [], None
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("tokens"):
            tokens += msg.tokens.token_ids
        else:
            final_msg = msg.final
    assert final_msg is not None
    return tokens


@pytest.fixture(scope="module")
def long_ttl(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("pins_long"), decode_args=sim(600.0), prefill_args=sim(0.0))
    yield m
    m.close()


@pytest.fixture(scope="module")
def short_ttl(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("pins_short"), decode_args=sim(0.5), prefill_args=sim(0.0))
    yield m
    m.close()


def test_next_step_hits_the_pin_and_pressure_releases_it(long_ttl):
    stub = long_ttl.decode_stub()
    start = long_ttl.decode_stats()
    full = start.load.free_blocks
    convo = prompt_of(200, seed=1)
    out = step(stub, convo, "s0", wf="wf-a")
    pinned = long_ttl.decode_stats()
    assert pinned.counters.pinned_blocks == 12  # 200 prompt + 7 fed-back outputs -> 12 full blocks
    assert pinned.load.free_blocks == full - 12
    # Step 1: the conversation so far plus a tool result; its prefix is still cached.
    cached_before = pinned.counters.prompt_tokens_cached
    convo = [*convo, *out, *prompt_of(40, seed=2)]
    step(stub, convo, "s1", wf="wf-a")
    after = long_ttl.decode_stats()
    assert after.counters.prompt_tokens_cached - cached_before >= 192
    # Pressure: a request needing (almost) the whole pool takes the pinned blocks.
    step(stub, prompt_of(BLOCKS * 16 - 20, seed=3), "big", max_tokens=4)
    st = long_ttl.decode_stats()
    assert st.counters.pins_evicted == 1 and st.counters.pinned_blocks == 0
    wait_until(lambda: long_ttl.decode_stats().load.free_blocks == full, what="pool back to full")


def test_the_final_step_releases_the_pin(long_ttl):
    stub = long_ttl.decode_stub()
    full = long_ttl.decode_stats().load.free_blocks
    convo = prompt_of(100, seed=4)
    out = step(stub, convo, "f0", wf="wf-b")
    assert long_ttl.decode_stats().counters.pinned_blocks > 0
    step(stub, [*convo, *out, 5, 6, 7], "f1", wf="wf-b", final=True)
    assert long_ttl.decode_stats().counters.pinned_blocks == 0
    wait_until(lambda: long_ttl.decode_stats().load.free_blocks == full, what="pool back to full")


def test_an_idle_worker_releases_the_pin_on_its_ttl(short_ttl):
    stub = short_ttl.decode_stub()
    full = short_ttl.decode_stats().load.free_blocks
    step(stub, prompt_of(100, seed=5), "t0", wf="wf-c")
    wait_until(lambda: short_ttl.decode_stats().counters.pins_expired == 1, what="pin expired")
    st = short_ttl.decode_stats()
    assert st.counters.pinned_blocks == 0 and st.load.free_blocks == full


def test_requests_without_a_workflow_pin_nothing(short_ttl):
    stub = short_ttl.decode_stub()
    full = short_ttl.decode_stats().load.free_blocks
    step(stub, prompt_of(100, seed=6), "n0")
    assert short_ttl.decode_stats().counters.pinned_blocks == 0
    wait_until(lambda: short_ttl.decode_stats().load.free_blocks == full, what="pool back to full")
