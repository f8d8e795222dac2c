"""Fuzzed lease requests at the real prefill worker (issue 13, item 3).

Hypothesis draws bursts of Prefill calls with any `lease_ms` (up to 2^32-1, the
49.7-day lease of the issue), an empty, real or made-up `requester_agent`, one
or several requester ids and prompt lengths, sends them to the in-process mesh
(inproc.py, the prefill worker's default PrefillConfig) and checks what the
issue asked for: an empty requester agent is INVALID_ARGUMENT, every granted
lease ends within max_lease_ms, the pool's held share never passes
max_held_share (new calls are RESOURCE_EXHAUSTED with a retry hint instead),
no requester holds more than its share, and once the handles are released the
mesh is as it was.
"""

from __future__ import annotations

import time

import grpc
from hypothesis import given
from hypothesis import strategies as st

from pdmesh.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.config import PrefillConfig
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.test_rpc_fuzz import Baseline, assert_settled

CONFIG = PrefillConfig()  # what the in-process prefill worker runs with
C = grpc.StatusCode

call = st.fixed_dictionaries(
    {
        "lease_ms": st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1])),
        "agent": st.sampled_from(["", "real", "ghost-agent"]),
        "requester": st.sampled_from(["fuzz-decode", "fuzz-decode", "other-decode"]),
        "tokens": st.integers(1, 600),
    }
)


def test_fuzzed_leases_are_bounded_and_the_pool_is_never_pinned(mesh):
    base = Baseline(mesh)
    stub = prefill_pb2_grpc.PrefillServiceStub(mesh.channels["prefill"])
    pool = base.snapshot.prefill_free
    real_agent = mesh.decode.transport.agent_name
    seq = iter(range(10**9))

    @fuzz_settings(8)
    @given(burst=st.lists(call, min_size=1, max_size=40))
    def run(burst):
        handles = []
        try:
            for c in burst:
                n = next(seq)
                req = prefill_pb2.PrefillRequest(
                    request_id=f"lease-fuzz-{n}",
                    prompt_token_ids=[(n * 131 + k) % 256 for k in range(c["tokens"])],
                    requester_id=c["requester"],
                    requester_agent=real_agent if c["agent"] == "real" else c["agent"],
                    lease_ms=c["lease_ms"],
                )
                req.sampling.max_tokens = 2
                asked_at_ms = time.time() * 1000
                try:
                    resp = stub.Prefill(req, timeout=30)
                except grpc.RpcError as e:
                    if c["agent"] == "":
                        assert e.code() == C.INVALID_ARGUMENT, e.details()
                    else:
                        assert e.code() == C.RESOURCE_EXHAUSTED, f"{e.code().name}: {e.details()}"
                        assert int(dict(e.trailing_metadata())["retry-after-ms"]) > 0
                    continue
                assert c["agent"] != "", "a lease without a requester agent was granted"
                if resp.handle.handle_id:
                    handles.append(resp.handle.handle_id)
                    end = resp.handle.lease_expires_unix_ms - asked_at_ms
                    assert end <= CONFIG.max_lease_ms + 1_000, f"lease of {end:.0f} ms granted"
                snap = mesh.snapshot()
                assert snap.lease_blocks <= CONFIG.max_held_share * pool, snap
            by_requester = mesh.call(_held_by_requester(mesh))
            for who, blocks in by_requester.items():
                assert blocks <= CONFIG.max_requester_held_share * pool, (who, blocks)
        finally:
            for h in handles:
                mesh.release(h)
        assert_settled(mesh, base, "a burst of fuzzed leases")

    run()


async def _held_by_requester(mesh) -> dict[str, int]:
    return {who: mesh.leases.held_blocks_of(who) for who in ("fuzz-decode", "other-decode")}
