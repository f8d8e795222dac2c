"""Decode and prefill workers with `--engine-backend sim`, as real processes.

kvtransfer + one sim prefill worker + one sim decode worker on loopback (port
0 everywhere). The sim's tokens are a pure function of prompt and position, so
the worker's output must equal the in-process sim engine's, by the local and
the remote (NIXL handoff of the tiny pool) path alike.
"""

from __future__ import annotations

import pytest

from pdmesh.launcher import flags
from pdmesh.v1 import decode_pb2
from tests.e2e.helpers import generate, start_mesh, wait_until
from tests.unit.engine.conftest import prompt_of, request
from tests.unit.sim.conftest import sim_core

pytestmark = pytest.mark.e2e

SIM = flags(engine_backend="sim", engine_sim_speedup=50.0, engine_num_blocks=1024)
LOCAL, REMOTE = decode_pb2.DISAGG_MODE_LOCAL, decode_pb2.DISAGG_MODE_REMOTE


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("sim"), decode_args=SIM, prefill_args=SIM)
    yield m
    m.close()


def test_sim_decode_worker_serves_local_and_remote_with_the_sim_tokens(mesh):
    stub = mesh.decode_stub()
    before = mesh.decode_stats()
    assert before.info.engine_backend == "sim"
    initial = before.load.free_blocks
    prompts = [prompt_of(n, seed=n) for n in (20, 150, 400)]
    want = sim_core().generate([request(f"w{i}", p, max_tokens=24) for i, p in enumerate(prompts)])

    remote = [
        generate(stub, p, request_id=f"r{i}", mode=REMOTE, max_tokens=24) for i, p in enumerate(prompts)
    ]
    after_remote = mesh.decode_stats()
    local = [generate(stub, p, request_id=f"l{i}", mode=LOCAL, max_tokens=24) for i, p in enumerate(prompts)]

    for i in range(len(prompts)):
        assert remote[i][0] == local[i][0] == want[f"w{i}"], f"prompt {i}"
    assert all(f.prefill_path == "remote" for _, f in remote)
    assert after_remote.transfers.count > before.transfers.count  # real (tiny) bytes moved
    assert after_remote.counters.prompt_tokens_transferred > 0
    # The local replays found the remote prompts' full blocks in this worker's prefix cache
    # (all but the last token: its logits give the next sample, so it is always computed).
    after = mesh.decode_stats()
    assert after.counters.prompt_tokens_cached - after_remote.counters.prompt_tokens_cached == (
        sum((len(p) - 1) // 16 * 16 for p in prompts)
    )
    wait_until(lambda: mesh.decode_stats().load.free_blocks == initial, what="decode pool back")
    wait_until(lambda: mesh.prefill_stats().leases.held == 0, what="prefill leases released")
